"""The main job's config compiles every program in its first RL step and none after it, although its
batches' longest samples fall in more than one width bucket (``step.train_width``: what
``optim.width_buckets`` would cut each batch to, one compile per new width)."""
import importlib.util
import pathlib

import jax

from rl_fusion_jax import config as config_lib
from rl_fusion_jax.orchestration import loop, phases
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.train import step as step_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Trace events: every jit cache miss traces its function first (a compile, or a persistent-cache load).
TRACE = "/jax/core/compile/jaxpr_trace_duration"


def main_job(**overrides) -> config_lib.ExperimentConfig:
  """experiments/configs/arithmetic.py (the main job) with a short warm-up and run, and a small held-out
  set: its model, rollout shapes and update as shipped."""
  spec = importlib.util.spec_from_file_location("arithmetic_config", ROOT / "experiments/configs/arithmetic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("")
  c.warmup.update(steps=24, checkpoint_every=0)
  c.run.update(steps=8, checkpoint_every=0, eval_every=0, progress_every_s=0.0)
  c.task.update(eval_problems=16, eval_samples=0, pass_k=1)
  for path, value in overrides.items():
    section, name = path.split(".")
    c[section][name] = value
  return config_lib.experiment_from_dict(c.to_dict())


def traces_per_step(cfg, workdir: str) -> tuple[list[int], list[dict]]:
  """(jaxpr traces during each RL step and after it until the next, step 1 first; the steps' metrics)."""
  events: list[str] = []
  listener = lambda event, duration, **kw: events.append(event) if event == TRACE else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  marks: list[int] = []
  original = phases.rl_step

  def marked(*args, **kwargs):
    marks.append(len(events))
    return original(*args, **kwargs)

  phases.rl_step = marked
  try:
    loop.run(cfg, workdir)
  finally:
    phases.rl_step = original
    jax.monitoring.unregister_event_duration_listener(listener)
  bounds = marks + [len(events)]
  rows = [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]
  return [b - a for a, b in zip(bounds, bounds[1:])], rows


def test_main_job_compiles_nothing_after_its_first_step(tmp_path):
  traces, rows = traces_per_step(main_job(), str(tmp_path))
  assert len(traces) == 8 and traces[0] > 0
  assert traces[1:] == [0] * 7, traces          # steps 2.. and the final evaluation: no new program
  assert {r["train_width"] for r in rows} == {14.0}
  buckets = [step_lib.train_width(int(r["sample_len_max"]), 14) for r in rows]
  assert len(set(buckets)) > 1, buckets

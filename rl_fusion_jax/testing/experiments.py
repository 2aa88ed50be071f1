"""Seconds-scale experiment configs for tests of the loop (2-layer model, 4 prompts x 2 samples)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from rl_fusion_jax import config as config_lib


def tiny_dict(**overrides: Any) -> dict[str, Any]:
  """The tiny experiment as a plain dict; ``overrides`` are dotted paths, e.g. ``{"run.steps": 5}``."""
  c = dict(
      model=dict(model_type="qwen2", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                 num_kv_heads=2, intermediate_size=64, qkv_bias=True, tie_word_embeddings=True,
                 # Unrolled (see tests/conftest.py): the suite's loop runs on 8 virtual CPU devices saw
                 # XLA:CPU collectives deadlock intermittently with the 2 layers in a rolled scan.
                 max_position_embeddings=32, scan_unroll=2),
      mesh=dict(data=-1, fsdp=2, tensor=1),
      task=dict(name="arithmetic", kwargs=dict(max_digits=2), eval_problems=8),
      rollout=dict(num_prompts=4, group_size=2, max_prompt_len=8, max_new_tokens=4),
      optim=dict(learning_rate=1e-3),
      warmup=dict(steps=2, batch_size=8),
      run=dict(steps=3, checkpoint_every=0, progress_every_s=0.0))   # a checkpoint at the end only
  for path, value in overrides.items():
    node = c
    *parents, leaf = path.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return c


# The tiny model as a Qwen3-MoE-style policy: 8 experts (E divides data x fsdp = 8 on the test mesh),
# top-2 of hidden 16, renormalised weights, q/k norm, both router losses on.
TINY_MOE = {"model.model_type": "qwen3_moe", "model.qkv_bias": False, "model.qk_norm": True,
            "model.num_experts": 8, "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 16,
            "model.norm_topk_prob": True, "model.router_aux_loss_coef": 0.01,
            "model.router_z_loss_coef": 0.001}


def tiny(**overrides: Any) -> config_lib.ExperimentConfig:
  return config_lib.experiment_from_dict(tiny_dict(**overrides))


@contextlib.contextmanager
def rl_step_traces() -> Iterator[dict[tuple[str, int], int]]:
  """While active, counts the jaxpr traces each ``phases.rl_step`` call makes; yields the dict
  (deployment mode, step index) -> traces, filled as the loop runs (the no-recompile checks). Starts with
  no shared programs (``shared_programs.clear``), so the first run's first step traces its programs; a later
  run may trace nothing at all, where it shares them."""
  import jax  # pylint: disable=import-outside-toplevel
  from rl_fusion_jax import shared_programs  # pylint: disable=import-outside-toplevel
  from rl_fusion_jax.orchestration import phases  # pylint: disable=import-outside-toplevel
  shared_programs.clear()
  traces: list[str] = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: traces.append(event) if "trace" in event else None)
  original = phases.rl_step
  per_step: dict[tuple[str, int], int] = {}

  def counting(setup, programs, state, ref, step, *args):
    before = len(traces)
    out = original(setup, programs, state, ref, step, *args)
    per_step[(programs.deployment.mode, step)] = len(traces) - before
    return out

  phases.rl_step = counting
  try:
    yield per_step
  finally:
    phases.rl_step = original


def traces_per_step(cfg: config_lib.ExperimentConfig, workdir: str) -> list[list[str]]:
  """Runs ``cfg`` in this process (``loop.run``) and returns the functions traced in each RL step (a
  synchronous ``phases.rl_step`` or a ``StaleSync.step``), from its start to the start of the next (what
  runs between, a checkpoint or an evaluation, counts with the step before), step 1 first. Every jit cache
  miss traces its function first: a new compile, or a persistent-cache load."""
  import jax  # pylint: disable=import-outside-toplevel
  from rl_fusion_jax.orchestration import loop, phases, stalesync  # pylint: disable=import-outside-toplevel
  trace = "/jax/core/compile/jaxpr_trace_duration"
  events: list[str] = []
  listener = lambda event, duration, **kw: events.append(kw.get("fun_name", "?")) if event == trace else None
  marks: list[int] = []

  def marked(step_fn):
    def fn(*args, **kwargs):
      marks.append(len(events))
      return step_fn(*args, **kwargs)
    return fn

  originals = phases.rl_step, stalesync.StaleSync.step
  phases.rl_step, stalesync.StaleSync.step = marked(originals[0]), marked(originals[1])
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    loop.run(cfg, workdir)
  finally:
    phases.rl_step, stalesync.StaleSync.step = originals
    jax.monitoring.unregister_event_duration_listener(listener)
  bounds = marks + [len(events)]
  return [events[a:b] for a, b in zip(bounds, bounds[1:])]

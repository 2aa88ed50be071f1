"""Programs compiled in a run's first RL step and not after it.

The main job's config (at one of its four layers) compiles none after its first step, although its batches'
longest samples fall in more than one width bucket (``step.train_width``: what ``optim.width_buckets`` would
cut each batch to, one compile per new width). A packed update with ``optim.fixed_row_count`` compiles nothing
after its first step either, although its batches fill different row buckets and their streams differ in
length."""
import importlib.util
import pathlib

from rl_fusion_jax import config as config_lib
from rl_fusion_jax import shared_programs
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax.testing import experiments
from rl_fusion_jax.testing.experiments import tiny
from rl_fusion_jax.train import packing
from rl_fusion_jax.train import step as step_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main_job(**overrides) -> config_lib.ExperimentConfig:
  """experiments/configs/arithmetic.py (the main job) with a short warm-up and run (a checkpoint and an
  evaluation every 4 steps), and a small held-out set: its model, rollout shapes and update as shipped,
  but for ``overrides`` ("section.field": value)."""
  spec = importlib.util.spec_from_file_location("arithmetic_config", ROOT / "experiments/configs/arithmetic.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("")
  c.warmup.update(steps=24, checkpoint_every=0)
  c.run.update(steps=8, checkpoint_every=4, eval_every=4, progress_every_s=0.0)
  c.task.update(eval_problems=16, eval_samples=0, pass_k=1)
  for path, value in overrides.items():
    section, name = path.split(".")
    c[section][name] = value
  return config_lib.experiment_from_dict(c.to_dict())


def traces_per_step(cfg, workdir: str) -> tuple[list[list[str]], list[dict]]:
  """(the functions traced during each RL step and after it until the next, step 1 first; the steps'
  metrics)."""
  traced = experiments.traces_per_step(cfg, workdir)
  return traced, [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]


def test_main_job_compiles_nothing_after_its_first_step(tmp_path):
  # One of the main job's four layers: which programs a step needs follows the batches' shapes, not depth.
  traces, rows = traces_per_step(main_job(**{"model.num_layers": 1}), str(tmp_path))
  assert len(traces) == 8 and "rl_step" in traces[0]
  # Steps 2.., a checkpoint and a held-out evaluation after step 4, the last ones: no new program.
  assert traces[1:] == [[]] * 7, traces
  assert {r["train_width"] for r in rows} == {14.0}
  buckets = [step_lib.train_width(int(r["sample_len_max"]), 14) for r in rows]
  assert len(set(buckets)) > 1, buckets


def test_fixed_row_count_compiles_the_packed_update_once(tmp_path):
  shared_programs.clear()   # count this test's own traces: none shared from earlier tests
  # Chained-arithmetic responses of 2-8 operands: the batches fill 18-25 rows of 8 x 8 (rows split over the
  # 8 batch shards); row buckets 24 and 32 would each compile the update.
  cfg = tiny(**{"rollout.num_prompts": 16, "rollout.group_size": 4, "run.steps": 6, "run.checkpoint_every": 0,
                "rollout.max_prompt_len": 25, "rollout.max_new_tokens": 20, "model.max_position_embeddings": 48,
                "task.name": "arithmetic_steps", "task.kwargs": dict(min_terms=2, max_terms=8, tail=2.0),
                "warmup.steps": 30, "warmup.learning_rate": 3e-3, "optim.pack_rows": True,
                "optim.tokens_per_micro_batch": 128, "optim.fixed_row_count": True})
  traces, rows = traces_per_step(cfg, str(tmp_path))
  assert traces[0].count("packed_rl_step") == 1
  assert traces[1:] == [[]] * 5, traces
  assert {r["pack/rows"] for r in rows} == {64.0}
  assert len({r["pack/stream_bytes"] for r in rows}) > 1     # bucketed, each length would compile
  buckets = packing.row_buckets(cfg.rollout.batch_size, 8, per_doubling=2)
  assert len({packing.choose_rows(int(r["pack/rows_used"]), buckets) for r in rows}) > 1

"""One process of a two-process async separated run (tests/separated_test.py), or its one-process reference.

  python -m rl_fusion_jax.testing.separated_worker PORT PROCESS_ID WORKDIR [name=value ...]

PROCESS_ID 0 / 1: the rollout / training side of ``orchestration.separated.run`` on ``devices`` CPU
devices, joined with the other process by jax.distributed on 127.0.0.1:PORT. PROCESS_ID ``sync``: the
synchronous one-process loop (``loop.run``, PORT unused) on 2 x ``devices`` devices with
fusion.mode=separated and rollout_device_fraction=0.5, i.e. the same rollout and training mesh shapes.

Options (defaults in ``OPTIONS``): devices, steps, staleness, schedule (reproducible | opportunistic),
transport (collective | kv), warmup (warm-up steps), new_tokens (rollout.max_new_tokens), epochs (algo.ppo_epochs
and algo.mini_batches: that many epochs of that many mini-batches per batch). Prints one JSON
line: the run's summary.
"""
import json
import os
import sys

OPTIONS = {"devices": 2, "steps": 3, "staleness": 0, "schedule": "reproducible", "transport": "kv",
           "warmup": 15, "new_tokens": 6, "epochs": 1}


def experiment(opts: dict, sync: bool = False):
  """The tiny experiment (testing/experiments.py) in separated mode, with a reference model (kl > 0)."""
  from rl_fusion_jax.testing.experiments import tiny
  return tiny(**{"fusion.mode": "separated", "fusion.rollout_device_fraction": 0.5, "algo.kl_coef": 0.05,
                 "run.steps": int(opts["steps"]), "run.checkpoint_every": 0,
                 "rollout.max_new_tokens": int(opts["new_tokens"]), "model.max_position_embeddings": 32,
                 "warmup.steps": int(opts["warmup"]), "warmup.learning_rate": 6e-3, "stalesync.enabled": not sync,
                 "stalesync.max_staleness": int(opts["staleness"]), "algo.ppo_epochs": int(opts["epochs"]),
                 "algo.mini_batches": int(opts["epochs"])})


def parse(argv) -> dict:
  opts = dict(OPTIONS)
  for arg in argv:
    name, _, value = arg.partition("=")
    if name not in opts:
      raise SystemExit(f"unknown option {name!r}; known: {sorted(opts)}")
    opts[name] = value
  return opts


def main(port: int, process: str, workdir: str, opts: dict) -> None:
  import jax
  from rl_fusion_jax import gc_policy  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.testing import compile_log, launch  # pylint: disable=g-import-not-at-top
  gc_policy.tune()
  compile_log.install()
  jax.config.update("jax_compilation_cache_dir", launch.TEST_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if process == "sync":
    from rl_fusion_jax.orchestration import loop
    summary = loop.run(experiment(opts, sync=True), workdir)
  else:
    from rl_fusion_jax import distributed
    from rl_fusion_jax.distributed import DistributedConfig
    from rl_fusion_jax.orchestration import separated
    separated.initialize(DistributedConfig(f"127.0.0.1:{port}", 2, int(process)), opts["transport"])
    # Each side compiles its own programs: without this the training process would recompile its
    # warm-up and update in every run (~50 s on 2 cores).
    distributed.cache_from_every_process()
    options = separated.Options(reproducible=opts["schedule"] == "reproducible",
                                weight_transport=opts["transport"], timeout_s=180.0)
    summary = separated.run(experiment(opts), workdir, options)
  print(json.dumps(summary), flush=True)
  if process != "sync":
    jax.distributed.shutdown()


if __name__ == "__main__":
  # Set before the backend starts (importing jax does not start it); never when imported by a test.
  _opts = parse(sys.argv[4:])
  _count = int(_opts["devices"]) * (2 if sys.argv[2] == "sync" else 1)
  from rl_fusion_jax.testing.launch import xla_flags  # pylint: disable=g-import-not-at-top
  os.environ["XLA_FLAGS"] = xla_flags(devices=_count)
  os.environ["JAX_PLATFORMS"] = "cpu"
  main(int(sys.argv[1]), sys.argv[2], sys.argv[3], _opts)

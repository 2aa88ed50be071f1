r"""What a checkpoint save costs the run, at a config's own params and optimizer state.

  python experiments/benchmark_checkpoint.py --config=experiments/configs/tiny_grpo.py --devices=8

Places the config's params and AdamW state in the training layout on a mesh of ``--devices`` CPU devices
(the config's fsdp x tensor, data filling the rest), then saves them ``--saves`` times
through ``checkpointing.Checkpointer`` (what the loop does every ``run.checkpoint_every`` steps) and prints,
per save, the seconds ``save`` blocks the caller (fingerprints, space check, device-to-host copies) and
the seconds ``wait`` then takes (the asynchronous write's rest); then the medians of the saves after the
first. The first save includes its programs' compiles (no persistent compilation cache is set).
``--min_replica_parallel_bytes`` overrides ``checkpointing.MIN_REPLICA_PARALLEL_BYTES`` (0: orbax's own
default, every replicated shard split among its replicas).
"""
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_DEVICES = flags.DEFINE_integer("devices", 8, "CPU devices of the mesh (set before JAX starts).")
_SAVES = flags.DEFINE_integer("saves", 6, "Saves, each waited for before the next.")
_MIN_BYTES = flags.DEFINE_integer("min_replica_parallel_bytes", -1,
                                  "Override of checkpointing.MIN_REPLICA_PARALLEL_BYTES (-1: keep it; 0: orbax's "
                                  "default, no threshold).")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  flags_env = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags_env} --xla_force_host_platform_device_count={_DEVICES.value}".strip()
  import jax
  from rl_fusion_jax import checkpointing, models
  from rl_fusion_jax import config as config_lib
  from rl_fusion_jax.sharding.mesh import make_mesh
  from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
  from rl_fusion_jax.train import state as state_lib
  if _MIN_BYTES.value >= 0:
    checkpointing.set_replica_parallel_threshold(_MIN_BYTES.value or None)
  cfg = config_lib.experiment_from_dict(_CONFIG.value)
  m = cfg.model.config
  mesh = make_mesh(dataclasses.replace(cfg.mesh, data=-1))
  abstract = models.abstract_params(m)
  shardings = param_shardings(abstract, models.param_logical_axes(m), mesh, TRAIN_RULES)
  params = jax.device_put(models.init_params(m, jax.random.key(0)), shardings)
  tx = state_lib.make_optimizer(cfg.optim)
  state = state_lib.create_train_state(params, tx, state_lib.state_shardings(tx, abstract, shardings, mesh))
  items = {"params": state.params, "opt_state": state.opt_state}
  root = tempfile.mkdtemp(prefix="bench_ckpt_")
  ckpt = checkpointing.Checkpointer(os.path.join(root, "ckpt"))
  rows = []
  try:
    for i in range(_SAVES.value):
      t0 = time.perf_counter()
      ckpt.save(i, items, {"step": i})
      t1 = time.perf_counter()
      ckpt.wait()
      rows.append((t1 - t0, time.perf_counter() - t1))
      print(json.dumps({"save": i, "blocking_s": round(rows[-1][0], 4), "wait_s": round(rows[-1][1], 4)}),
            flush=True)
  finally:
    ckpt.close()
    shutil.rmtree(root, ignore_errors=True)
  later = rows[1:] or rows
  print(json.dumps({"devices": jax.device_count(), "mesh": dict(mesh.shape),
                    "bytes": sum(int(x.nbytes) for x in jax.tree.leaves(items)),
                    "min_replica_parallel_bytes": (checkpointing.MIN_REPLICA_PARALLEL_BYTES if _MIN_BYTES.value < 0
                                                   else _MIN_BYTES.value),
                    "first_blocking_s": round(rows[0][0], 4),
                    "median_blocking_s": round(statistics.median(r[0] for r in later), 4),
                    "median_wait_s": round(statistics.median(r[1] for r in later), 4)}))


if __name__ == "__main__":
  app.run(main)

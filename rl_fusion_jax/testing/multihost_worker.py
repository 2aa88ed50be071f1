"""One process of a 2-process CPU run (tests/multihost_test.py): global batch + one RL update.

Run as ``python -m rl_fusion_jax.testing.multihost_worker PORT PROCESS_ID``. Each process owns 2 CPU
devices; the mesh spans all 4. Both processes hold the same host batch and build the global array shard
by shard (``orchestration.data.to_global``), so each device receives only its own rows. Prints one JSON
line with the update's metrics.
"""
import json
import os
import sys

import jax
import numpy as np


def batch_arrays(batch: int = 8, seq: int = 10, prompt: int = 3, seed: int = 0):
  """A fixed host batch (numpy) for the tiny model, identical in every process."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, 64, size=(batch, seq)).astype(np.int32)
  mask = np.zeros((batch, seq), np.float32)
  mask[:, prompt:] = 1.0
  adv = rng.normal(size=batch).astype(np.float32)
  behaviour = (rng.normal(size=(batch, seq)) * 0.1 - 4).astype(np.float32) * mask
  return tokens, mask, adv, behaviour


def tiny_model():
  from rl_fusion_jax import models
  return models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, qkv_bias=True, max_position_embeddings=32)


def update_metrics(mesh_cfg) -> dict:
  """One RL update of the tiny model on ``mesh_cfg`` over all (global) devices."""
  from rl_fusion_jax import models
  from rl_fusion_jax.config import AlgoConfig, OptimConfig
  from rl_fusion_jax.orchestration.data import to_global
  from rl_fusion_jax.sharding.mesh import make_mesh
  from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
  from rl_fusion_jax.train import state as state_lib
  from rl_fusion_jax.train import step as step_lib
  from rl_fusion_jax.types import TrainBatch

  cfg, mesh = tiny_model(), make_mesh(mesh_cfg)
  psh = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  tx = state_lib.make_optimizer(OptimConfig(learning_rate=1e-2))
  ssh = state_lib.state_shardings(tx, models.abstract_params(cfg), psh, mesh)
  params = jax.jit(lambda k: models.init_params(cfg, k, init_std=0.3), out_shardings=psh)(jax.random.key(0))
  state = state_lib.create_train_state(params, tx, ssh)
  tokens, mask, adv, behaviour = batch_arrays()
  g = lambda x: to_global(mesh, x)
  batch = TrainBatch(tokens_bt=g(tokens), mask_bt=g(mask), advantages_b=g(adv), behaviour_logp_bt=g(behaviour),
                     ref_logp_bt=g(np.zeros_like(mask)), version_bt=g(np.zeros(mask.shape, np.int32)))
  step = step_lib.make_rl_step(cfg, AlgoConfig(), 1.0, tx, 1, mesh, 7, ssh)
  state, metrics = step(state, batch)
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def main(port: int, process_id: int) -> None:
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id)
  from rl_fusion_jax.config import MeshConfig
  out = update_metrics(MeshConfig(data=2, fsdp=2, tensor=1))
  out.update(process_index=jax.process_index(), devices=jax.device_count(),
             local_devices=jax.local_device_count())
  print(json.dumps(out), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  # Set before the backend starts (importing jax does not start it); never when imported by a test.
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  os.environ["JAX_PLATFORMS"] = "cpu"
  main(int(sys.argv[1]), int(sys.argv[2]))

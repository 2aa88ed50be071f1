"""One process of a 2-process CPU run (tests/multihost_test.py): global batches + one RL update.

Run as ``python -m rl_fusion_jax.testing.multihost_worker PORT PROCESS_ID``. Each process owns 2 CPU
devices; each mesh in ``MESHES`` spans all 4. On each mesh the global batch is built twice:
  host:  every process holds the whole host batch and copies its devices' rows (``to_global``);
  queue: every process fills a DistQueue with the batch's samples (a stand-in for one shared queue
         service) and reads from it only the rows of its own devices, once per data-parallel group
         (``queue_arrays``), counting what it read.
On the meshes marked ``update`` the same RL update then runs on both batches (the others only compare
the batches: a second compile of the update would double the test's time). Prints one JSON line: per
mesh, the queue reads, where each row landed, whether both batches agree, and the updates' metrics.
"""
import json
import os
import sys

import jax
import numpy as np

# name -> (mesh sizes, run the update). fsdp2_tp2: the 2 devices of a tensor pair share their rows.
MESHES = {"dp2_fsdp2": (dict(data=2, fsdp=2, tensor=1), True),
          "fsdp2_tp2": (dict(data=1, fsdp=2, tensor=2), False)}
# TrainBatch field -> (queue field, dtype, per token). Token rows are stored packed, unpadded.
QUEUE_FIELDS = {"tokens_bt": ("tokens", np.int32, True), "mask_bt": ("mask", np.float32, True),
                "advantages_bt": ("advantages", np.float32, True),
                "behaviour_logp_bt": ("behaviour_logp", np.float32, True),
                "ref_logp_bt": ("ref_logp", np.float32, True), "version_bt": ("version", np.int32, True)}
CONSUMER = "train"


def host_batch(batch: int = 8, seq: int = 10, prompt: int = 3, seed: int = 0):
  """A fixed host batch (numpy, TrainBatch field names) with rows of different lengths, identical in every
  process; returns (fields, lengths). Positions past a row's length are 0 in every field."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(prompt + 2, seq + 1, size=batch)
  real = (np.arange(seq)[None, :] < lengths[:, None])
  mask = (real & (np.arange(seq)[None, :] >= prompt)).astype(np.float32)
  fields = {"tokens_bt": rng.integers(3, 64, size=(batch, seq)).astype(np.int32) * real,
            "mask_bt": mask, "advantages_bt": rng.normal(size=(batch, 1)).astype(np.float32) * mask,
            "behaviour_logp_bt": (rng.normal(size=(batch, seq)) * 0.1 - 4).astype(np.float32) * mask,
            "ref_logp_bt": np.zeros_like(mask), "version_bt": np.zeros(mask.shape, np.int32)}
  return fields, lengths


def fill_queue(fields: dict, lengths: np.ndarray):
  """A DistQueue holding every sample (index = row), token fields packed to each row's length."""
  from rl_fusion_jax.queue.distqueue import DistQueue, FieldSpec
  queue = DistQueue([FieldSpec(*spec) for spec in QUEUE_FIELDS.values()], capacity=len(lengths))
  queue.register_consumer(CONSUMER, [name for name, _, _ in QUEUE_FIELDS.values()])
  rows = lambda x: [x[i, :n] for i, n in enumerate(lengths)]
  queue.put(np.arange(len(lengths)), **{name: rows(fields[f]) if per_token else fields[f]
                                        for f, (name, _, per_token) in QUEUE_FIELDS.items()})
  return queue


def host_train_batch(mesh, fields: dict):
  from rl_fusion_jax.orchestration.data import to_global
  from rl_fusion_jax.types import TrainBatch
  return TrainBatch(**{f: to_global(mesh, x) for f, x in fields.items()})


def queue_train_batch(mesh, queue, rows: int, width: int):
  """The global TrainBatch read from ``queue``: only this process's rows; returns (batch, reads)."""
  from rl_fusion_jax.queue.global_batch import queue_arrays
  from rl_fusion_jax.types import TrainBatch
  reads = []

  def read(indices):
    reads.append(indices.tolist())
    return queue.read(CONSUMER, indices)

  arrays = queue_arrays(mesh, read, np.arange(rows), width)
  return TrainBatch(**{f: arrays[name] for f, (name, _, _) in QUEUE_FIELDS.items()}), reads


def tiny_model():
  from rl_fusion_jax.testing.tiny import tiny_model_config
  return tiny_model_config(max_position_embeddings=32)


def make_update(mesh):
  """``update(batch) -> metrics``: one RL update of the tiny model from a fresh state (same every call)."""
  from rl_fusion_jax import models
  from rl_fusion_jax.config import AlgoConfig, OptimConfig
  from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
  from rl_fusion_jax.train import state as state_lib
  from rl_fusion_jax.train import step as step_lib

  cfg = tiny_model()
  psh = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  tx = state_lib.make_optimizer(OptimConfig(learning_rate=1e-2))
  ssh = state_lib.state_shardings(tx, models.abstract_params(cfg), psh, mesh)
  init = jax.jit(lambda k: models.init_params(cfg, k, init_std=0.3), out_shardings=psh)
  step = step_lib.make_rl_step(cfg, AlgoConfig(), 1.0, tx, 1, mesh, 7, ssh)

  def update(batch) -> dict:
    state = state_lib.create_train_state(init(jax.random.key(0)), tx, ssh)  # the step donates it
    _, metrics = step(state, batch)
    return {k: float(v) for k, v in jax.device_get(metrics).items()}
  return update


def update_metrics(mesh_cfg) -> dict:
  """One RL update on ``mesh_cfg`` over all (global) devices, from the host batch."""
  from rl_fusion_jax.sharding.mesh import make_mesh
  mesh = make_mesh(mesh_cfg)
  return make_update(mesh)(host_train_batch(mesh, host_batch()[0]))


def shard_rows(array) -> dict:
  """Device id -> [start, stop) of the rows its shard of ``array`` holds (this process's devices)."""
  return {s.device.id: list(s.index[0].indices(array.shape[0])[:2]) for s in array.addressable_shards}


def same_local_shards(a, b) -> bool:
  """Same dtype, sharding and, on every device of this process, the same shard."""
  b_shards = {s.device: s.data for s in b.addressable_shards}
  return (a.dtype == b.dtype and a.sharding == b.sharding
          and all(np.array_equal(s.data, b_shards[s.device]) for s in a.addressable_shards))


def run_mesh(mesh_cfg, update: bool) -> dict:
  """Both global batches on one mesh: queue reads, row layout, whether the shards agree (and metrics)."""
  from rl_fusion_jax.sharding.mesh import make_mesh
  mesh, (fields, lengths) = make_mesh(mesh_cfg), host_batch()
  host = host_train_batch(mesh, fields)
  width = fields["mask_bt"].shape[1]
  queued, reads = queue_train_batch(mesh, fill_queue(fields, lengths), len(lengths), width)
  out = {"reads": reads, "device_rows": shard_rows(queued.tokens_bt), "rows": len(lengths),
         "mesh_device_ids": mesh.device_ids.tolist(),
         "same_shards": all(same_local_shards(getattr(host, f), getattr(queued, f)) for f in QUEUE_FIELDS)}
  if update:
    step = make_update(mesh)
    out.update(host=step(host), queue=step(queued))
  return out


# The vocabulary ``fill_rows_check`` sends its tokens for (host_batch's ids are below it: 1 byte each).
VOCAB = 64
# Which process holds each of the 8 samples' responses in ``fill_rows_check`` (as ``Engine.local_rows``
# leaves them), and which rows each process's devices train on comes from the dp2_fsdp2 mesh.
READERS = (0, 1, 1, 0, 1, 0, 0, 1)


def fill_rows_check() -> dict:
  """``processes.fill_rows`` across the 2 processes: each starts from the rows it holds (the others'
  responses blank), needs the rows of its devices on the dp2_fsdp2 mesh. Returns, per row, whether it
  equals the full batch's row afterwards, whether its response is still blank, and the bytes crossed."""
  from rl_fusion_jax.config import MeshConfig
  from rl_fusion_jax.orchestration import processes
  from rl_fusion_jax.queue import global_batch
  from rl_fusion_jax.sharding.mesh import batch_sharding, make_mesh
  from rl_fusion_jax.types import Rollout
  fields, lengths = host_batch()
  prompt = 3
  full = Rollout(tokens_bt=fields["tokens_bt"], prompt_len_b=np.full((8,), prompt, np.int32),
                 response_len_b=(lengths - prompt).astype(np.int32), logp_bt=fields["behaviour_logp_bt"],
                 version_bt=np.where(fields["mask_bt"] > 0, 7, -1).astype(np.int32),
                 finished_b=np.ones((8,), bool), sample_id_b=np.arange(100, 108, dtype=np.int32))
  mine = np.asarray(READERS) == jax.process_index()
  response = (np.arange(10)[None, :] >= prompt) & ~mine[:, None]
  local = full.replace(tokens_bt=np.where(response, 0, full.tokens_bt), logp_bt=np.where(response, 0, full.logp_bt),
                       version_bt=np.where(response, -1, full.version_bt))
  share = processes.Share(jax.process_index(), 2, readers=dict(zip(range(100, 108), READERS)))
  need = global_batch.rows_by_process(batch_sharding(make_mesh(MeshConfig(data=2, fsdp=2)), 1), 8, 2)
  filled, crossed = processes.fill_rows(share, local, need, vocab_size=VOCAB)
  same = [all(np.array_equal(getattr(filled, f)[b], getattr(full, f)[b])
              for f in ("tokens_bt", "logp_bt", "version_bt")) for b in range(8)]
  blank = [bool((filled.tokens_bt[b, prompt:] == 0).all() and (filled.version_bt[b, prompt:] == -1).all())
           for b in range(8)]
  return {"same": same, "blank": blank, "crossed": int(crossed), "need": need.tolist(),
          "response_len": full.response_len_b.tolist()}


def engine_check() -> dict:
  """The generation engine over both processes' 4 devices (4 batch shards of 2 slots), twice with the same
  requests and seed: exchanging every row (the library's default) and keeping rows by process
  (``local_rows``), then ``hold_finished`` (``processes.fill_rows`` to every process). Each run returns one
  complete group and leaves a finished sample unreturned, whose row only one process lacks. Returns, per sample of either kind: whether the
  row of the local-rows engine equals the exchanging engine's (before and after ``hold_finished``),
  whether it was blank before, its reader, and the oldest versions from both."""
  from rl_fusion_jax import models
  from rl_fusion_jax.config import MeshConfig
  from rl_fusion_jax.orchestration import processes
  from rl_fusion_jax.rollout.decode import GenerateSpec
  from rl_fusion_jax.rollout.engine import Engine, EngineConfig, Request
  from rl_fusion_jax.rollout.sampling import SamplingParams
  from rl_fusion_jax.sharding.mesh import make_mesh
  from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings
  cfg = tiny_model()
  mesh = make_mesh(MeshConfig(data=-1))
  psh = param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh, TRAIN_RULES)
  params = jax.jit(lambda k: models.init_params(cfg, k, init_std=0.5), out_shardings=psh)(jax.random.key(0))
  rng = np.random.default_rng(0)
  # Group 2 (samples 4, 5: process 1's slots) ends first, sample 0 (process 0's) with it: the one unreturned
  # row is blank on process 1 only, and both processes must still take part in hold_finished's exchange.
  forced = [2, 9, 9, 9, 2, 2, 12, 4, 11, 6]
  requests = [Request(i, i // 2, rng.integers(3, 60, size=3).astype(np.int32), forced[i]) for i in range(10)]
  fields = ("tokens_st", "logp_st", "version_st")
  out = {}
  for local in (False, True):
    engine = Engine(EngineConfig(GenerateSpec(cfg, SamplingParams(1.0), 4, 14, 1), num_slots=8, chunk_steps=2,
                                 group_size=2), mesh, psh)
    engine.local_rows = local
    engine.add(requests)
    result = engine.run(params, 0, target_groups=1)
    finished = engine._finished   # pylint: disable=protected-access
    unreturned = {int(f.row["sample_id_s"]): f for f in finished}
    ro = result.rollout
    rows = {int(s): {"tokens_st": ro.tokens_bt[b], "logp_st": ro.logp_bt[b], "version_st": ro.version_bt[b]}
            for b, s in enumerate(ro.sample_id_b)}
    rows |= {s: {k: np.array(f.row[k]) for k in fields} for s, f in unreturned.items()}
    out[local] = {"rows": rows, "min_version": result.min_version_b.tolist(), "readers": dict(engine.readers),
                  "unreturned": sorted(unreturned), "returned": ro.sample_id_b.tolist()}
    if local:
      share = processes.Share(jax.process_index(), jax.process_count(), readers=engine.readers)
      everyone = lambda rollout: processes.fill_rows(share, rollout, np.ones((2, len(rollout.sample_id_b)), bool),
                                                     vocab_size=cfg.vocab_size)[0]
      out["filled"] = engine.hold_finished(everyone)
      out["after"] = {int(f.row["sample_id_s"]): {k: np.array(f.row[k]) for k in fields} for f in finished}
  same = lambda a, b: all(np.array_equal(a[k], b[k]) for k in fields)
  full, local = out[False], out[True]
  return {"returned": local["returned"], "unreturned": local["unreturned"],
          "same_samples": full["returned"] == local["returned"] and full["unreturned"] == local["unreturned"],
          "same": {s: same(local["rows"][s], full["rows"][s]) for s in local["rows"]},
          "blank": {s: bool((local["rows"][s]["version_st"] == -1).all()) for s in local["rows"]},
          "same_after": {s: same(row, full["rows"][s]) for s, row in out["after"].items()},
          "readers": local["readers"], "full_readers": full["readers"], "filled": out["filled"],
          "min_version": [local["min_version"], full["min_version"]]}


def precision_check() -> dict:
  """`loop.check_same_precision`: the processes' own resolutions of ``model.dtype='auto'`` agree (no error),
  then process 1 resolves to another policy, as on a CPU of another kind: both refuse the run."""
  from rl_fusion_jax import model_config  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.orchestration import loop  # pylint: disable=g-import-not-at-top
  own = model_config.default_precision()
  loop.check_same_precision("auto", own)
  loop.check_same_precision("float32", "float32" if jax.process_index() == 0 else "bf16_matmul")  # not auto
  other = {"float32": "bf16_matmul", "bf16_matmul": "float32"}[own]
  try:
    loop.check_same_precision("auto", own if jax.process_index() == 0 else other)
    return {"own": own, "error": ""}
  except ConfigError as e:
    return {"own": own, "error": str(e)}


def main(port: int, process_id: int) -> None:
  from rl_fusion_jax import gc_policy
  from rl_fusion_jax.testing import compile_log
  gc_policy.tune()
  compile_log.install()
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id)
  from rl_fusion_jax.config import MeshConfig
  out = {name: run_mesh(MeshConfig(**sizes), update) for name, (sizes, update) in MESHES.items()}
  out["fill_rows"] = fill_rows_check()
  out["engine"] = engine_check()
  out["precision"] = precision_check()
  out.update(process_index=jax.process_index(), devices=jax.device_count(),
             local_devices=sorted(d.id for d in jax.local_devices()))
  print(json.dumps(out), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  # Set before the backend starts (importing jax does not start it); never when imported by a test.
  from rl_fusion_jax.testing.launch import xla_flags  # pylint: disable=g-import-not-at-top
  os.environ["XLA_FLAGS"] = xla_flags(devices=2)
  os.environ["JAX_PLATFORMS"] = "cpu"
  main(int(sys.argv[1]), int(sys.argv[2]))

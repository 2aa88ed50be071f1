"""Cost parameters at cluster scale, from hardware and model figures: every figure here is ASSUMED.

Nothing in this module was measured on this project's machines. ``ASSUMPTIONS`` lists each figure with
its source; ``experiments/simulate_main.py --sweep`` varies the ones the results depend on. The device
figures are an NVIDIA H100 SXM's (datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB, 900 GB/s
NVLink i.e. 450 GB/s per direction, one 400 Gb/s NIC per GPU); the supernode is the reference system's
size (384 accelerators on one high-bandwidth fabric), which we give NVLink-class bandwidth between any
two of its devices, and 400 Gb/s per device between supernodes. The model is a Qwen2.5-32B-shaped dense
decoder (64 layers, 8 KV heads of 128, 32.8 B parameters, bf16). Efficiencies (MFU, achieved bandwidth)
are round figures of the kind reported for such systems, not measurements.

Cost model (``GenCost`` / ``TrainCost`` of ``costs.py``), generation replicas of ``tp`` devices running
in lockstep (one SPMD decode program, as the engine does):
  * a decode step reads the replica's weight shard once: weights / tp / (HBM bandwidth x efficiency),
    plus a fixed per-step overhead (kernel launches, sampling);
  * each active sample's step reads its KV context: 2 x layers x kv_heads x head_dim x 2 bytes per
    context token, spread over the replicas; and computes 2 x params FLOPs per generated token;
  * prefill: 2 x params FLOPs per token at the prefill MFU; a chunk costs a host round trip;
  * the update: (6 + 2 + 2) x params FLOPs per trained token (forward + backward, the old-policy and the
    reference forward passes) over the training devices at the training MFU, plus the optimizer step
    (reading and writing 16 bytes per parameter of the device's shard: parameters and optimizer state
    are sharded within a supernode and replicated across supernodes) and, across supernodes, the ring
    all-reduce of each device's fp32 gradient shard over the inter-supernode links;
  * colocated switch (both directions): the generation layout's weight shard over the fabric plus the
    optimizer state (12 bytes per parameter) to host memory and back over PCIe (64 GB/s per device);
  * separated: the new weights broadcast to the rollout devices over the fabric after each update.
"""
from __future__ import annotations

import dataclasses

from rl_fusion_jax.sim.costs import Costs, GenCost, TrainCost
from rl_fusion_jax.sim.schedules import Schedule
from rl_fusion_jax.sim.workload import Workload


@dataclasses.dataclass(frozen=True)
class Hardware:
  flops: float = 989e12            # dense bf16 FLOP/s per device (H100 SXM datasheet)
  hbm_bw: float = 3.35e12          # bytes/s per device (H100 SXM datasheet)
  hbm_bytes: float = 80e9
  fabric_bw: float = 450e9         # per device per direction inside a supernode (NVLink-class)
  inter_bw: float = 50e9           # per device between supernodes (400 Gb/s NIC)
  host_bw: float = 64e9            # device <-> host memory (PCIe Gen5 x16)
  devices_per_node: int = 384      # the reference system's supernode


@dataclasses.dataclass(frozen=True)
class Model:
  params: float = 32.8e9
  layers: int = 64
  kv_heads: int = 8
  head_dim: int = 128
  bytes_per_param: int = 2

  @property
  def weight_bytes(self) -> float:
    return self.params * self.bytes_per_param

  @property
  def kv_bytes_per_token(self) -> float:
    return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclasses.dataclass(frozen=True)
class Efficiency:
  train_mfu: float = 0.40
  prefill_mfu: float = 0.50
  decode_mfu: float = 0.30         # the compute part of a decode step
  hbm_eff: float = 0.70            # achieved / peak HBM bandwidth while decoding
  fabric_eff: float = 0.70
  step_overhead_s: float = 2e-3    # per decode step: launches, sampling, the lockstep barrier
  chunk_s: float = 1e-3            # per decode chunk: the host round trip
  phase_s: float = 0.5             # per rollout phase: engine start, cache allocation
  other_s: float = 2.0             # per step, colocated or trainer: reward, bookkeeping, host work


@dataclasses.dataclass(frozen=True)
class Cluster:
  nodes: int = 1
  tp: int = 8                      # devices per generation replica
  hw: Hardware = Hardware()
  model: Model = Model()
  eff: Efficiency = Efficiency()
  slots_per_replica: int = 256     # concurrent sequences per replica (KV memory bounds it)
  chunk_steps: int = 64            # decode steps per host round trip (rollout.chunk_steps)

  @property
  def devices(self) -> int:
    return self.nodes * self.hw.devices_per_node


ASSUMPTIONS = (
    ("device bf16 FLOP/s", "989e12", "NVIDIA H100 SXM datasheet (dense)"),
    ("device HBM bandwidth", "3.35e12 B/s", "NVIDIA H100 SXM datasheet"),
    ("devices per supernode", "384", "the reference system's supernode"),
    ("fabric bandwidth in a supernode", "450e9 B/s per device per direction", "NVLink 4 (900 GB/s bidirectional)"),
    ("bandwidth between supernodes", "50e9 B/s per device", "one 400 Gb/s NIC per device"),
    ("host link", "64e9 B/s per device", "PCIe Gen5 x16"),
    ("model", "32.8e9 params, 64 layers, 8 KV heads x 128, bf16", "Qwen2.5-32B's shape"),
    ("training MFU", "0.40", "round figure for a dense decoder at this scale"),
    ("prefill MFU / decode MFU", "0.50 / 0.30", "round figures"),
    ("achieved HBM / fabric efficiency", "0.70 / 0.70", "round figures"),
    ("decode step overhead", "2 ms", "launch + sampling + barrier, round figure"),
    ("per rollout phase / per chunk / per step host", "0.5 s / 1 ms / 2 s", "round figures"),
    ("decode chunk", "64 steps", "rollout.chunk_steps for responses of thousands of tokens"),
    ("generation replica", "tp = 8, 256 slots", "a 32B model in bf16 on 8 devices: 8.2 GB of weights and, "
     "at the workload's mean context (~2.7k tokens), ~23 GB of KV per device"),
    ("workload", "512 prompts x 16 samples per supernode, prompts 512 tokens, responses log-normal "
     "median 2,048 sigma 0.9 capped at 16,384", "a long-tail reasoning workload (assumed)"),
)


def gen_cost(c: Cluster, devices: int) -> GenCost:
  """A rollout phase on ``devices`` devices: devices / tp replicas in lockstep."""
  hw, m, e = c.hw, c.model, c.eff
  replicas = devices // c.tp
  bw = hw.hbm_bw * e.hbm_eff
  return GenCost(
      phase=e.phase_s,
      decode_steps=m.weight_bytes / c.tp / bw + e.step_overhead_s,
      decode_chunks=e.chunk_s,
      kv_token_steps=m.kv_bytes_per_token / c.tp / bw / replicas,
      generated_tokens=2 * m.params / (c.tp * hw.flops * e.decode_mfu) / replicas,
      prefill_tokens=2 * m.params / (c.tp * hw.flops * e.prefill_mfu) / replicas)


def train_cost(c: Cluster, devices: int, nodes: int) -> TrainCost:
  hw, m, e = c.hw, c.model, c.eff
  per_token = 10 * m.params / (devices * hw.flops * e.train_mfu)
  # Sharded within a supernode, replicated across supernodes (hybrid FSDP): each device updates
  # 1 / (its supernode's training devices) of the parameters, whatever the supernode count.
  optimizer = 16 * m.params / (devices / nodes) / (hw.hbm_bw * e.hbm_eff)
  allreduce = 0.0
  if nodes > 1:     # each device's fp32 gradient shard, ring all-reduce across the supernodes
    shard = 4 * m.params / (devices / nodes)
    allreduce = 2 * (nodes - 1) / nodes * shard / (hw.inter_bw * e.fabric_eff)
  return TrainCost(fixed=optimizer + allreduce, per_token=per_token)


def switch_s(c: Cluster, devices: int) -> float:
  """Both directions of the colocated phase switch (optimizer state sharded within a supernode)."""
  hw, m, e = c.hw, c.model, c.eff
  reshard = m.weight_bytes / c.tp / (hw.fabric_bw * e.fabric_eff)
  offload = 12 * m.params / (devices / c.nodes) / hw.host_bw
  return 2 * (reshard + offload)


def costs(c: Cluster, mode: str) -> Costs:
  """The deployment's costs; separated splits every supernode's devices in half."""
  if mode == "colocated":
    return Costs(gen_cost(c, c.devices), train_cost(c, c.devices, c.nodes),
                 other_s=c.eff.other_s + switch_s(c, c.devices))
  half = c.devices // 2
  push = c.model.weight_bytes / (c.hw.fabric_bw * c.eff.fabric_eff)   # a pipelined broadcast
  return Costs(gen_cost(c, half), train_cost(c, half, c.nodes), other_s=c.eff.other_s,
               rollout_other_s=0.0, push_s=push)


def workload(c: Cluster, prompts_per_node: int = 512, group_size: int = 16, median: float = 2048,
             sigma: float = 0.9, max_len: int = 16384, prompt_len: int = 512) -> Workload:
  """Weak scaling: the batch grows with the supernodes."""
  return Workload(prompts_per_node * c.nodes, group_size, prompt_len, max_len, median, sigma, seed=0,
                  forced=False)


def schedule(c: Cluster, mode: str, s: int, f: float) -> Schedule:
  devices = c.devices if mode == "colocated" else c.devices // 2
  replicas = devices // c.tp
  return Schedule(mode=mode, max_staleness=s, rollout_fraction=f, num_slots=replicas * c.slots_per_replica,
                  chunk_steps=c.chunk_steps, batch_shards=replicas)

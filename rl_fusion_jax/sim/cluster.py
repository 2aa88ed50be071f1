"""The cluster model: cost parameters at cluster scale and the effects that decide how a step scales.

Nothing here was measured at cluster scale. Every input is a field of a frozen dataclass whose docstring
(the string under the field) says where its value comes from, with one of these labels:
  CITED      a public figure (datasheet, model config), named;
  REFERENCE  a figure of the reference system (the RL Fusion / StaleSync / DistQueue design this project
             implements: 384-accelerator supernodes);
  DERIVED    computed from other inputs or from this codebase's data layout;
  ASSUMED    a round figure or a choice of ours, with no measurement behind it.
``input_table()`` lists them all (RESULTS.md prints it).

Costs of one step (``costs``), replayed by ``schedules.simulate`` on one supernode:
  * a decode step reads the replica's weight shard once (weights / tp / achieved HBM bandwidth) plus a
    fixed overhead; each active sample reads its KV context and computes 2 x params FLOPs per token;
    prefill computes 2 x params FLOPs per token; a chunk costs a host round trip;
  * the update: 10 x params FLOPs per trained token (forward + backward, old-policy and reference forward
    passes) at the training MFU, and the optimizer step over the device's shard (parameters and optimizer
    state sharded within a supernode), ``train_passes`` times;
  * colocated switch (both directions): the weight shard over the fabric and the optimizer state to host
    memory and back; separated: the new weights broadcast to the rollout devices after each update.

Scaling over supernodes (``scaled``, Table 2: weak scaling, the batch grows with the supernodes): the one-
supernode replay's step, plus the effects that grow with the supernode count, each a function here:
  * ``barrier_s``: a synchronous step waits for the slowest data-parallel group's longest sample, the
    longest of all the step's samples; more groups draw more samples, so the expected longest grows
    (``workload.expected_longest``) and each extra decode step costs one near-empty step. Under StaleSync
    a sample may run over s + 1 rollout phases, so (first order) the phase grows by 1 / (s + 1) of it;
  * ``allreduce_s``: the gradient all-reduce across supernodes (hybrid sharding);
  * ``publish_s``: weight publication across supernodes before generation uses the new version;
  * ``queue_traffic``: DistQueue reads of the batch, padded or packed, once per data-parallel group
    (hierarchical) or once per device, over the fabric and, for the share held on other supernodes, the
    inter-supernode links;
  * ``straggler_factor``: a synchronous SPMD step is as slow as its slowest device.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from rl_fusion_jax.sim.costs import Costs, GenCost, TrainCost
from rl_fusion_jax.sim.schedules import Schedule
from rl_fusion_jax.sim.workload import Workload, expected_longest

LABELS = ("MEASURED", "CITED", "REFERENCE", "DERIVED", "ASSUMED")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One accelerator and its links (an NVIDIA H100 SXM stands in for the reference's accelerator)."""
  flops: float = 989e12
  """CITED: NVIDIA H100 SXM datasheet, dense BF16 FLOP/s."""
  hbm_bw: float = 3.35e12
  """CITED: NVIDIA H100 SXM datasheet, HBM3 bytes/s."""
  hbm_bytes: float = 80e9
  """CITED: NVIDIA H100 SXM datasheet, 80 GB."""
  fabric_bw: float = 450e9
  """CITED: NVLink 4, 900 GB/s bidirectional per GPU (450e9 per direction); ASSUMED to hold between any
  two devices of a supernode."""
  inter_bw: float = 50e9
  """CITED: one 400 Gb/s NIC per GPU (DGX H100: 8 x 400 Gb/s for 8 GPUs), bytes/s between supernodes."""
  host_bw: float = 64e9
  """CITED: PCIe Gen5 x16, device <-> host memory bytes/s."""
  devices_per_node: int = 384
  """REFERENCE: the reference system's supernode, 384 accelerators on one high-bandwidth fabric."""


@dataclasses.dataclass(frozen=True)
class Model:
  """The policy: a Qwen2.5-32B-shaped dense decoder in bf16."""
  params: float = 32.8e9
  """CITED: Qwen2.5-32B, 32.8 B parameters (its model card)."""
  layers: int = 64
  """CITED: Qwen2.5-32B config.json, num_hidden_layers."""
  kv_heads: int = 8
  """CITED: Qwen2.5-32B config.json, num_key_value_heads."""
  head_dim: int = 128
  """CITED: Qwen2.5-32B config.json, hidden_size / num_attention_heads."""
  bytes_per_param: int = 2
  """ASSUMED: bf16 weights for generation."""

  @property
  def weight_bytes(self) -> float:
    return self.params * self.bytes_per_param

  @property
  def kv_bytes_per_token(self) -> float:
    return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclasses.dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of the peaks and fixed overheads."""
  train_mfu: float = 0.40
  """ASSUMED: round figure for a dense decoder's training at this scale."""
  prefill_mfu: float = 0.50
  """ASSUMED: round figure."""
  decode_mfu: float = 0.30
  """ASSUMED: round figure for the compute part of a decode step."""
  hbm_eff: float = 0.70
  """ASSUMED: achieved / peak HBM bandwidth while decoding."""
  fabric_eff: float = 0.70
  """ASSUMED: achieved / peak bandwidth of every link."""
  step_overhead_s: float = 2e-3
  """ASSUMED: per decode step (launches, sampling, the lockstep barrier)."""
  chunk_s: float = 1e-3
  """ASSUMED: per decode chunk, the host round trip."""
  phase_s: float = 0.5
  """ASSUMED: per rollout phase (engine start, cache allocation)."""
  other_s: float = 2.0
  """ASSUMED: per step, colocated or trainer (reward, bookkeeping, host work)."""


@dataclasses.dataclass(frozen=True)
class WorkloadInputs:
  """The work per supernode and step (weak scaling: per supernode, whatever the supernode count)."""
  prompts_per_node: int = 512
  """ASSUMED: prompts per step per supernode."""
  group_size: int = 16
  """ASSUMED: samples per prompt (GRPO group)."""
  prompt_len: int = 512
  """ASSUMED: prompt tokens."""
  median: float = 2048
  """ASSUMED: median response length of a long-tail reasoning workload (log-normal)."""
  sigma: float = 0.9
  """ASSUMED: sigma of the log of the response length."""
  max_len: int = 16384
  """ASSUMED: the response-length cap (rollout.max_new_tokens)."""

  @property
  def samples_per_node(self) -> int:
    return self.prompts_per_node * self.group_size


QUICK_WORK = WorkloadInputs(prompts_per_node=64, median=1024, max_len=4096)


@dataclasses.dataclass(frozen=True)
class ScalingInputs:
  """The effects that grow with the supernode count, beyond the one-supernode replay."""
  straggler_prob: float = 0.0
  """ASSUMED: the probability that one device runs one step slow. 0 by default: we found no public
  per-device figure we could check (arXiv:2505.05713 studies stragglers in ByteDance's LLM training traces;
  no figure of it is used here); the sweep varies it."""
  straggler_slowdown: float = 0.5
  """ASSUMED: a slow device's step takes this fraction longer, and the synchronous SPMD step with it."""
  publish_latency_s: float = 0.05
  """ASSUMED: a cross-supernode rendezvous before generation uses a new version (a few RPC rounds)."""
  fsdp_across_nodes: bool = False
  """ASSUMED layout: False, hybrid sharding (sharded within a supernode, replicated across, so the new
  weights are on every supernode after the all-reduce); True, FSDP over every device, so each generation
  replica gathers (N - 1) / N of its weight shard from the other supernodes."""
  packed: bool = True
  """DERIVED from DistQueue (queue/distqueue.py): token fields stored packed (real tokens only); False:
  padded to prompt_len + max_len."""
  hierarchical: bool = True
  """DERIVED from DistQueue: one read per data-parallel group (False: one read per device of the group)."""
  token_field_bytes: int = 16
  """DERIVED from the queue's token columns read by the update: tokens (int32), behaviour log-probs
  (float32), versions (int32), reference log-probs (float32): 4 x 4 bytes per token."""
  train_group_devices: int = 8
  """ASSUMED: devices that read one batch shard in training (a tensor-parallel group of 8)."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A cluster of ``nodes`` supernodes and everything the model reads."""
  nodes: int = 1
  """The supernode count (Table 2: 1, 2 and 4)."""
  tp: int = 8
  """ASSUMED: devices per generation replica (a 32B model in bf16: 8.2 GB of weights per device)."""
  slots_per_replica: int = 256
  """ASSUMED: concurrent sequences per replica; at the workload's mean context (~2.7k tokens) ~23 GB of
  KV per device, within 80 GB beside the weights."""
  chunk_steps: int = 64
  """ASSUMED: decode steps per host round trip (rollout.chunk_steps) for responses of thousands of tokens."""
  train_passes: int = 1
  """ASSUMED: optimizer passes over each batch (GRPO with one minibatch); sets the rollout / training split."""
  hw: Hardware = Hardware()
  model: Model = Model()
  eff: Efficiency = Efficiency()
  work: WorkloadInputs = WorkloadInputs()
  scaling: ScalingInputs = ScalingInputs()

  @property
  def devices(self) -> int:
    return self.nodes * self.hw.devices_per_node


def field_sources(cls) -> list[tuple[str, object, str]]:
  """(name, default, docstring) of each field of the dataclass ``cls``: the string literal under it."""
  body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
  docs = {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
          if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
          and isinstance(b.value.value, str)}
  return [(f.name, f.default, docs.get(f.name, "")) for f in dataclasses.fields(cls)]


INPUT_CLASSES = (Hardware, Model, Efficiency, WorkloadInputs, ScalingInputs)


def input_table() -> list[tuple[str, str, str]]:
  """(input, default value, source) for every cluster input (nested inputs by class)."""
  rows = [(f"Cluster.{n}", f"{v:g}" if isinstance(v, float) else str(v), d)
          for n, v, d in field_sources(Cluster) if not dataclasses.is_dataclass(v) and n != "nodes"]
  for cls in INPUT_CLASSES:
    rows += [(f"{cls.__name__}.{n}", f"{v:g}" if isinstance(v, float) else str(v), d) for n, v, d in field_sources(cls)]
  return rows


# ------------------------------------------------------------------------------------- one step's costs


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


def allreduce_s(c: Cluster, nodes: int, node_devices: int | None = None) -> float:
  """Each training device's fp32 gradient shard (``node_devices`` per supernode, all by default), ring
  all-reduce across the supernodes (0 on one)."""
  if nodes <= 1:
    return 0.0
  shard = 4 * c.model.params / (node_devices or c.hw.devices_per_node)
  return 2 * (nodes - 1) / nodes * shard / (c.hw.inter_bw * c.eff.fabric_eff)


def train_cost(c: Cluster, devices: int, nodes: int) -> TrainCost:
  """``train_passes`` optimizer passes over the batch; sharded within a supernode, replicated across
  (hybrid FSDP): each device updates 1 / (its supernode's training devices) of the parameters."""
  hw, m, e = c.hw, c.model, c.eff
  per_token = 10 * m.params / (devices * hw.flops * e.train_mfu)
  optimizer = 16 * m.params / (devices / nodes) / (hw.hbm_bw * e.hbm_eff)
  return TrainCost(fixed=c.train_passes * (optimizer + allreduce_s(c, nodes, devices // nodes)),
                   per_token=c.train_passes * per_token)


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


def workload(c: Cluster) -> Workload:
  """Weak scaling: the batch grows with the supernodes."""
  w = c.work
  return Workload(w.prompts_per_node * c.nodes, w.group_size, w.prompt_len, w.max_len, w.median, w.sigma,
                  seed=0, forced=False)


def schedule(c: Cluster, mode: str, s: int, f: float) -> Schedule:
  devices = c.devices if mode == "colocated" else c.devices // 2
  replicas = devices // c.tp
  return Schedule(mode=mode, max_staleness=s, train_fraction=f, num_slots=replicas * c.slots_per_replica,
                  chunk_steps=c.chunk_steps, batch_shards=replicas)


# ------------------------------------------------------------------------- what grows with supernodes


def tail_step_s(c: Cluster) -> float:
  """One decode step near a phase's end (a few samples left): the weight shard read, the step overhead
  and the chunk's round trip spread over its steps (the per-sample terms are negligible)."""
  g = gen_cost(c, c.hw.devices_per_node)
  return g.decode_steps + g.decode_chunks / c.chunk_steps


def longest(c: Cluster, nodes: int) -> float:
  """Expected longest response of a step's batch on ``nodes`` supernodes."""
  w = c.work
  return expected_longest(w.median, w.sigma, w.max_len, nodes * w.samples_per_node)


def barrier_s(c: Cluster, nodes: int, max_staleness: int) -> float:
  """Extra generate seconds on ``nodes`` supernodes against one: the longer expected tail of more draws,
  one near-empty decode step per extra token; divided by s + 1 under StaleSync (first order: a sample
  may span s + 1 rollout phases before it must finish)."""
  extra = longest(c, nodes) - longest(c, 1)
  return extra * tail_step_s(c) / (max_staleness + 1)


def publish_s(c: Cluster, nodes: int) -> float:
  """Weight publication across supernodes per step: a rendezvous, plus (FSDP over every device) the
  (N - 1) / N of each replica device's weight shard that lives on other supernodes."""
  if nodes <= 1:
    return 0.0
  sc = c.scaling
  gathered = c.model.weight_bytes / c.tp * (nodes - 1) / nodes if sc.fsdp_across_nodes else 0.0
  return sc.publish_latency_s + gathered / (c.hw.inter_bw * c.eff.fabric_eff)


def queue_traffic(c: Cluster, nodes: int) -> dict[str, float]:
  """DistQueue reads of one step's batch by the update. Per sample: ``token_field_bytes`` per token of
  the real prompt + response (packed; the mean response is ``expected_longest`` of one draw) or of
  prompt_len + max_len (padded). Each sample is read once per data-parallel group (hierarchical) or by
  each of the group's ``train_group_devices`` devices. Samples are served by the hosts that generated
  them, so each device's link serves (readers x batch bytes) / devices per supernode (constant under weak
  scaling), of which (N - 1) / N goes to other supernodes over the slower inter-supernode links."""
  w, sc, hw = c.work, c.scaling, c.hw
  response = expected_longest(w.median, w.sigma, w.max_len, 1) if sc.packed else w.max_len
  per_sample = sc.token_field_bytes * (w.prompt_len + response)
  readers = 1 if sc.hierarchical else sc.train_group_devices
  per_device = w.samples_per_node * per_sample * readers / hw.devices_per_node
  cross = (nodes - 1) / nodes
  seconds = per_device * (cross / hw.inter_bw + (1 - cross) / hw.fabric_bw) / c.eff.fabric_eff
  return {"bytes_per_sample": per_sample, "bytes_per_device": per_device, "seconds": seconds}


def straggler_factor(c: Cluster, nodes: int) -> float:
  """Expected step time / step time without stragglers: 1 + slowdown x P(at least one of the step's
  nodes x devices_per_node devices is slow), for a step that waits for every device."""
  sc = c.scaling
  return 1 + sc.straggler_slowdown * (1 - (1 - sc.straggler_prob) ** (nodes * c.hw.devices_per_node))


@dataclasses.dataclass(frozen=True)
class Scaled:
  """One schedule's step on ``nodes`` supernodes: the one-supernode replay's step and what grows."""
  nodes: int
  base_s: float            # the one-supernode replay's step (generate, update, switch, host)
  tokens: float            # trained tokens per step (the one-supernode replay's x nodes)
  barrier_s: float
  allreduce_s: float
  publish_s: float
  queue_s: float
  straggler: float         # multiplier

  @property
  def step_s(self) -> float:
    return (self.base_s + self.barrier_s + self.allreduce_s + self.publish_s + self.queue_s) * self.straggler

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / self.step_s


def scaled(c: Cluster, base_step_s: float, base_tokens: float, max_staleness: int, nodes: int) -> Scaled:
  """The step on ``nodes`` supernodes from the one-supernode replay's (``c.nodes`` is ignored)."""
  return Scaled(nodes, base_step_s, base_tokens * nodes, barrier_s(c, nodes, max_staleness),
                c.train_passes * allreduce_s(c, nodes), publish_s(c, nodes), queue_traffic(c, nodes)["seconds"],
                straggler_factor(c, nodes))

r"""Benchmark of the phase switch of a MoE model: what each device receives against an all-gather of every leaf.

  python experiments/benchmark_moe_switch_main.py --model=100m --bucket_mb=16
  python experiments/benchmark_moe_switch_main.py --model=100m --bucket_mb=16 --train_expert_axes=data,fsdp

Presets: ``tiny`` is the test model of tests/expert_switch_test.py (Qwen3-MoE style, vocab 64, hidden 32,
2 layers, 8 experts top-2 of 16; 0.03M params); ``100m`` is Qwen3-MoE style with vocab 32000, hidden 512,
8 layers, 8 heads, 4 KV heads, 16 experts top-2 of intermediate 384, q/k norm, tied embeddings, float32
(98.2M params, 75.5M of them in the experts).

``--train_expert_axes`` replaces the 'expert' entry of TRAIN_RULES (default fsdp,data: the rule table's
own order). Prints one JSON line: per direction the median seconds over ``--repeats`` untracked round
trips, then from one tracked round trip the peak live bytes per device, and from ``SwitchStats.traffic``
the bytes the fullest device must receive (all moved params, and the expert leaves alone) against the
all-gather baseline (every device gathering each moved leaf whole, minus its own shard), and their
ratio. The traffic figures are bookkeeping from the shardings, not wire measurements; on CPU every
"device" is host RAM and the times say little.
"""
import gc
import json
import statistics

from absl import app, flags

import common

_MODEL = flags.DEFINE_enum("model", "100m", ["tiny", "100m"], "Model size preset.")
_BUCKET_MB = flags.DEFINE_float("bucket_mb", 16.0, "Bucket size in MiB (per-device destination bytes).")
_MESH = flags.DEFINE_list("mesh", ["2", "4", "1"], "Mesh sizes data,fsdp,tensor.")
_EXPERT_AXES = flags.DEFINE_list("train_expert_axes", ["fsdp", "data"], "Mesh axes of 'expert' in training.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "Virtual CPU devices (set before JAX starts).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed round trips after one warm-up round trip.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache ('' disables).")

_PRESETS = {
    "tiny": dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16),
    "100m": dict(vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                 intermediate_size=1024, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=384,
                 tie_word_embeddings=True),
}


def _setup():
  """Mesh, layouts (TRAIN_RULES with the chosen expert axes) and a train-layout TrainState."""
  import jax  # pylint: disable=g-import-not-at-top  (after common.setup_jax)
  from rl_fusion_jax import config as config_lib, models
  from rl_fusion_jax.sharding import mesh as mesh_lib, reshard, rules
  from rl_fusion_jax.train import state as state_lib
  data, fsdp, tensor = (int(v) for v in _MESH.value)
  mesh = mesh_lib.make_mesh(config_lib.MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
  cfg = models.ModelConfig(**_PRESETS[_MODEL.value], model_type="qwen3_moe", qk_norm=True)
  train_rules = tuple((n, tuple(_EXPERT_AXES.value) if n == "expert" else a) for n, a in rules.TRAIN_RULES)
  tx = state_lib.make_optimizer(config_lib.OptimConfig(learning_rate=1e-4))
  abstract = models.abstract_params(cfg)
  layouts = reshard.make_layouts(mesh, abstract, models.param_logical_axes(cfg), tx, train_rules=train_rules)
  shardings = state_lib.state_shardings(tx, abstract, layouts.params[reshard.Phase.TRAIN], mesh)
  params = jax.device_put(models.init_params(cfg, jax.random.key(0)), shardings.params)
  return mesh, layouts, state_lib.create_train_state(params, tx, shardings)


def _switch(state, layouts, phase, track):
  from rl_fusion_jax.sharding.reshard import to_phase  # pylint: disable=g-import-not-at-top
  return to_phase(state, phase, layouts=layouts, bucket_bytes=max(1, int(_BUCKET_MB.value * 2**20)),
                  track_memory=track)


def _timed(state, layouts):
  """Median seconds of each direction over --repeats untracked round trips (after one warm-up)."""
  from rl_fusion_jax.sharding.reshard import Phase  # pylint: disable=g-import-not-at-top
  times = []
  for _ in range(1 + _REPEATS.value):
    state, to_gen = _switch(state, layouts, Phase.GENERATE, track=False)
    state, to_train = _switch(state, layouts, Phase.TRAIN, track=False)
    times.append((to_gen.seconds, to_train.seconds))
  return state, [round(statistics.median(t[k] for t in times[1:]), 4) for k in (0, 1)]


def _direction(name, stats, seconds):
  m = stats.traffic.maxima()
  ratio = lambda a, b: round(a / b, 2) if b else None
  return {f"{name}_median_s": seconds, f"{name}_peak_bytes_per_device": max(stats.peak_per_device.values()),
          f"{name}_transient_bytes_per_device": stats.transient_bytes(),
          **{f"{name}_{k}": v for k, v in m.items()},
          f"{name}_allgather_over_received": ratio(m["allgather_bytes_max"], m["received_bytes_max"]),
          f"{name}_expert_allgather_over_received": ratio(m["expert_allgather_bytes_max"],
                                                          m["expert_received_bytes_max"])}


def main(argv):
  del argv
  common.setup_jax(_CPU_DEVICES.value, _CACHE.value)
  import jax  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.sharding.reshard import Phase  # pylint: disable=g-import-not-at-top
  mesh, layouts, state = _setup()
  experts = state.params["layers"]["moe"]["experts"]
  out = {"model": _MODEL.value, "params": sum(x.size for x in jax.tree.leaves(state.params)),
         "expert_params": sum(x.size for x in jax.tree.leaves(experts)), "devices": jax.device_count(),
         "platform": jax.devices()[0].platform, "mesh": dict(mesh.shape), "repeats": _REPEATS.value,
         "train_expert_axes": _EXPERT_AXES.value, "bucket_bytes": int(_BUCKET_MB.value * 2**20)}
  state, (gen_s, train_s) = _timed(state, layouts)
  gc.collect()   # garbage freed during the tracked switch would understate its peak
  state, to_gen = _switch(state, layouts, Phase.GENERATE, track=True)
  state, to_train = _switch(state, layouts, Phase.TRAIN, track=True)
  out |= {**_direction("to_generate", to_gen, gen_s), **_direction("to_train", to_train, train_s)}
  print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
  app.run(main)

r"""Compile time of the RL update against model depth.

  python experiments/benchmark_compile_main.py --config=experiments/configs/tiny_grpo.py --layers=4,24

For each layer count, the config's model with `num_layers` replaced (and `scan_unroll` set by
--scan_unroll; 0: every layer unrolled) is lowered and compiled ahead of time as
the loop's RL update (`train.step.make_rl_step`: forward, backward, AdamW, one micro-batch) on one device
at the config's batch shape, from abstract arguments: nothing runs. Prints one JSON line per depth (median
lower and compile seconds over --repeats fresh compiles; no persistent compilation cache: before each
repeat the process forgets every program it made, `rl_fusion_jax.shared_programs.clear()` and
`jax.clear_caches()`, so a repeat traces, lowers and compiles again). --concurrent=N times
N such compiles (distinct row widths) one after another against N threads at once. --phases also traces
one more fresh compile with jax.profiler and prints where XLA:CPU spent it (its HLO passes, the code
generation of the fused kernels, the thunk sequence; the names its profiler events carry). Only APIs that
also existed before the layers were scanned are used, so the same binary times an older checkout
(`PYTHONPATH=OLD_CHECKOUT python experiments/benchmark_compile_main.py ...`).
"""
import collections
import dataclasses
import glob
import gzip
import json
import os
import statistics
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_LAYERS = flags.DEFINE_list("layers", ["4", "24"], "Layer counts to compile.")
_UNROLL = flags.DEFINE_integer("scan_unroll", 1, "model.scan_unroll (0: num_layers, every layer unrolled).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Fresh compiles per depth (medians reported).")
_PHASES = flags.DEFINE_bool("phases", False, "Also profile one more fresh compile per depth and print XLA:CPU's "
                             "compile phases (seconds of the profiler events named in _PHASE_EVENTS).")
_CONCURRENT = flags.DEFINE_integer("concurrent", 0, "N > 1: instead, compile N RL updates of distinct row widths "
                                   "one after another and in N threads at once, alternating --repeats rounds each.")


def _update(exp, layers: int, scan_unroll: int):
  """(fields, lower(width)): the RL update at ``layers`` layers on one device, and a function that traces and
  lowers a fresh copy of it at a row width from abstract arguments."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax import models  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.sharding.rules import TRAIN_RULES, param_shardings  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.train import state as state_lib  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.train import step as step_lib  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.types import TrainBatch  # pylint: disable=g-import-not-at-top
  fields = {"num_layers": layers}
  if "scan_unroll" in {f.name for f in dataclasses.fields(exp.model.config)}:
    fields["scan_unroll"] = min(scan_unroll or layers, layers)
  cfg = dataclasses.replace(exp.model.config, **fields)
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  tx = state_lib.make_optimizer(exp.optim)
  abstract = models.abstract_params(cfg)
  shardings = state_lib.state_shardings(tx, abstract, param_shardings(abstract, models.param_logical_axes(cfg),
                                                                      mesh, TRAIN_RULES), mesh)
  state = jax.eval_shape(lambda p: state_lib.TrainState(jnp.int32(0), p, tx.init(p), jnp.int32(0)), abstract)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  rows = exp.rollout.batch_size
  dtypes = dict(tokens_bt=jnp.int32, version_bt=jnp.int32)

  def lower(width: int):
    batch = TrainBatch(**{f.name: jax.ShapeDtypeStruct((rows, width), dtypes.get(f.name, jnp.float32))
                          for f in dataclasses.fields(TrainBatch)})
    batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch,
                         step_lib.batch_shardings(mesh))
    step = step_lib.make_rl_step(cfg, exp.algo, exp.rollout.temperature, tx, 1, mesh, width, shardings)
    return step.lower(state, batch)

  return fields, lower


def _forget_programs():
  """Drops every program this process made, so the next lowering and compile start from nothing: the
  shared factories (``make_rl_step`` returns the jitted function it made before for equal arguments) and
  JAX's in-memory caches would otherwise answer a repeat without compiling (0.0 s)."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    from rl_fusion_jax import shared_programs  # pylint: disable=g-import-not-at-top
    shared_programs.clear()
  except ImportError:   # a checkout from before the shared factories
    pass
  jax.clear_caches()


# XLA:CPU's profiler events inside one compile (jaxlib 0.10): the compile as a whole, its HLO passes (two
# pipelines), the backend (code generation of the fused kernels, then the thunk sequence that runs them).
_PHASE_EVENTS = ("PjRtCpuClient::Compile", "HLO passes through layout assignment",
                 "HLO passes after layout assignment", "CpuCompiler::RunBackend", "Codegen",
                 "FusionCompiler::Compile", "ThunkEmitter::EmitEntryComputation")


def compile_phases(lowered) -> dict:
  """Seconds of each ``_PHASE_EVENTS`` event (summed over its occurrences; a prefix match, so a pipeline
  named after its module counts) while compiling ``lowered`` once under jax.profiler, and how many fused
  kernels were generated."""
  import jax  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp, create_perfetto_trace=True)
    try:
      lowered.compile()
    finally:
      jax.profiler.stop_trace()
    traces = glob.glob(os.path.join(tmp, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    with gzip.open(traces[0]) as f:
      events = json.load(f)["traceEvents"]
  seconds, counts = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") != "X":
      continue
    for name in _PHASE_EVENTS:
      if e["name"].startswith(name):
        seconds[name] += e["dur"] / 1e6
        counts[name] += 1
  out = {name: round(seconds[name], 3) for name in _PHASE_EVENTS if name in seconds}
  out["fused_kernels"] = counts["FusionCompiler::Compile"]
  return out


def compile_seconds(exp, layers: int, scan_unroll: int) -> dict:
  """(lower s, compile s) of the RL update at `layers` layers, each a fresh trace and compile."""
  fields, lower_at = _update(exp, layers, scan_unroll)
  width = exp.rollout.seq_len
  lower, comp = [], []
  for _ in range(_REPEATS.value):
    _forget_programs()
    t0 = time.perf_counter()
    lowered = lower_at(width)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    lower.append(t1 - t0)
    comp.append(t2 - t1)
  out = {"layers": layers, "scan_unroll": fields.get("scan_unroll"), "rows": exp.rollout.batch_size,
         "width": width, "lower_s": round(statistics.median(lower), 3), "compile_s": round(statistics.median(comp), 3),
         "compile_s_each": [round(x, 3) for x in comp]}
  if _PHASES.value:
    _forget_programs()
    out["phases_s"] = compile_phases(lower_at(width))
  return out


def concurrent_seconds(exp, layers: int, scan_unroll: int, count: int) -> dict:
  """Wall seconds of compiling ``count`` RL updates one after another and all at once in ``count`` threads
  (XLA compiles outside the GIL), alternating, --repeats rounds each; medians. Every compile is of a program
  not compiled before in the process (an identical one would be found in JAX's caches): round r takes the
  row widths seq_len - 4 (count r + i), i < count, each lowered first, outside the timing."""
  import threading  # pylint: disable=g-import-not-at-top
  _, lower_at = _update(exp, layers, scan_unroll)
  times = {"one_after_another_s": [], "threads_s": []}
  widths = []
  for r in range(2 * _REPEATS.value):
    widths.append([exp.rollout.seq_len - 4 * (count * r + i) for i in range(count)])
    if min(widths[-1]) < 2:
      raise app.UsageError(f"--concurrent={count} x 2 --repeats={_REPEATS.value} programs need row widths down "
                           f"to {min(widths[-1])}; fewer programs or rounds")
    _forget_programs()
    lowered = [lower_at(w) for w in widths[-1]]
    t0 = time.perf_counter()
    if r % 2 == 0:
      for x in lowered:
        x.compile()
    else:
      threads = [threading.Thread(target=x.compile) for x in lowered]
      for t in threads:
        t.start()
      for t in threads:
        t.join()
    times["threads_s" if r % 2 else "one_after_another_s"].append(time.perf_counter() - t0)
  return {"layers": layers, "programs": count, "widths_per_round": widths,
          **{k: round(statistics.median(v), 3) for k, v in times.items()},
          "rounds": {k: [round(x, 2) for x in v] for k, v in times.items()}}


def main(argv):
  del argv
  from rl_fusion_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  exp = config_lib.experiment_from_dict(_CONFIG.value)
  for layers in _LAYERS.value:
    if _CONCURRENT.value > 1:
      print(json.dumps(concurrent_seconds(exp, int(layers), _UNROLL.value, _CONCURRENT.value)), flush=True)
    else:
      print(json.dumps(compile_seconds(exp, int(layers), _UNROLL.value)), flush=True)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)

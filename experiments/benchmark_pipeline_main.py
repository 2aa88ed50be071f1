r"""Pipeline bubble: time of the pipelined layers (forward + backward) against the micro-batch count M.

  python experiments/benchmark_pipeline_main.py --stages=4 --micro=4,8,16
  python experiments/benchmark_pipeline_main.py --stages=2 --micro=2,4,8

One JSON line per M. The model is tiny-grpo's shape with 8 layers (vocab 512, hidden 256, 4 heads, 2 KV
heads, MLP 688, float32); the batch is ``--rows`` x ``--width`` tokens of one segment each. Timed: one
jitted ``value_and_grad`` of a scalar readout of ``pipeline.pipelined_hidden`` on the mesh (stage=S,
data=devices/S), median of ``--repeats`` calls after one warm-up, blocking on every call, interleaved
call by call with the unpipelined program below.

What each line holds:

* ``iterations``, ``idle_stage_iterations``, ``bubble_formula``: counted from the schedule
  (``pipeline.Schedule``): M + S - 1 iterations, S (S - 1) stage-iterations without a micro-batch, and
  their share (S - 1) / (M + S - 1) (the GPipe formula).
* ``unpipelined_s``: the same work without a pipeline: the M micro-batches (rows m, m + M, ... as the
  pipeline cuts them) through all layers unpipelined (``decoder.hidden_with_aux``), on one stage's worth of
  devices (stage=1, data=devices/S) with the same rows per device. Every (micro-batch, stage's layers)
  unit of the pipeline's M * S useful ones is computed once, at the same shapes; the pipeline computes
  S (M + S - 1) such units, S (S - 1) of them on zeros (its bubble).
* ``measured_bubble`` = 1 - unpipelined_s / step_s: the share of the pipelined time that the same work
  without a pipeline does not need.

On virtual CPU devices the stages do not overlap: all devices share the machine's cores, and XLA:CPU runs
one multi-device program at a time. A bubble stage-iteration here is not idle time but work on zeros (the
SPMD program computes every stage every iteration, as it does on a GPU, where that work fills the idle
slot instead), so on CPU the bubble shows as extra CPU work, and ``measured_bubble`` compares total work
(summed over the devices sharing the cores) rather than overlapped time. It also counts what else the
pipeline adds: the ppermutes between stages, the final psum of the outputs, masking, and running 8 device
threads instead of devices/S on the same cores.
"""
import json

from absl import app, flags

import common

_STAGES = flags.DEFINE_integer("stages", 4, "Pipeline stages (mesh.stage); data = devices / stages.")
_MICRO = flags.DEFINE_list("micro", ["4", "8", "16"], "Micro-batch counts M to measure.")
_ROWS = flags.DEFINE_integer("rows", 32, "Rows of the batch.")
_WIDTH = flags.DEFINE_integer("width", 64, "Tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed calls per measurement after one warm-up.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "Virtual CPU devices (set before JAX starts).")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache ('' disables).")

MODEL = dict(vocab_size=512, hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2,
             intermediate_size=688, qkv_bias=True)


def _program(hidden_fn, cfg, mesh_cfg, devices=None):
  """(jitted value_and_grad of a readout of hidden_fn, params) on ``mesh_cfg``'s mesh over ``devices``."""
  import jax  # pylint: disable=g-import-not-at-top  (after common.setup_jax)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax import models  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.sharding import mesh as mesh_lib, rules  # pylint: disable=g-import-not-at-top
  mesh = mesh_lib.make_mesh(mesh_cfg, devices)
  shardings = rules.param_shardings(models.abstract_params(cfg), models.param_logical_axes(cfg), mesh,
                                    rules.TRAIN_RULES)
  params = jax.device_put(models.init_params(cfg, jax.random.key(0)), shardings)
  tokens = jax.random.randint(jax.random.key(1), (_ROWS.value, _WIDTH.value), 0, cfg.vocab_size)
  tokens = jax.device_put(tokens, mesh_lib.batch_sharding(mesh, 2))

  def loss(p):
    h_btd, _ = hidden_fn(cfg, p, tokens, mesh=mesh)
    return jnp.mean(jnp.square(h_btd))

  def step(p):
    value, grads = jax.value_and_grad(loss)(p)
    return value + optax.global_norm(grads)

  return jax.jit(step), params


def _interleaved(programs) -> list[float]:
  """Median seconds of each (fn, params) over --repeats rounds, one call of each per round (after a
  warm-up round): a slow window of a shared machine then slows every program alike."""
  import statistics  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  times = [[] for _ in programs]
  for round_ in range(1 + _REPEATS.value):
    for t, (fn, params) in zip(times, programs):
      start = time.perf_counter()
      fn(params).block_until_ready()
      if round_:
        t.append(time.perf_counter() - start)
  return [statistics.median(t) for t in times]


def main(argv):
  del argv
  common.setup_jax(_CPU_DEVICES.value, _CACHE.value)
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax import config as config_lib, models  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.models import decoder  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.sharding import pipeline  # pylint: disable=g-import-not-at-top
  cfg, stages = models.ModelConfig(**MODEL), _STAGES.value
  devices = jax.device_count()

  def unpipelined_hidden(c, p, tokens_bt, *, mesh, num_micro):
    del mesh
    return jnp.concatenate([decoder.hidden_with_aux(c, p, tokens_bt[m::num_micro])[0]
                            for m in range(num_micro)]), {}

  for micro in (int(m) for m in _MICRO.value):
    schedule = pipeline.Schedule(stages, micro)
    seconds, unpipelined = _interleaved([
        _program(functools.partial(pipeline.pipelined_hidden, num_micro=micro), cfg,
                 config_lib.MeshConfig(stage=stages, data=devices // stages)),
        _program(functools.partial(unpipelined_hidden, num_micro=micro), cfg,
                 config_lib.MeshConfig(data=devices // stages), jax.devices()[:devices // stages])])
    print(json.dumps({"platform": jax.devices()[0].platform, "devices": devices, "stages": stages,
                      "micro": micro, "rows": _ROWS.value, "width": _WIDTH.value,
                      "iterations": schedule.iterations, "idle_stage_iterations": schedule.idle_slots,
                      "bubble_formula": round(schedule.bubble_fraction, 4), "step_s": round(seconds, 4),
                      "per_iteration_s": round(seconds / schedule.iterations, 4),
                      "unpipelined_s": round(unpipelined, 4),
                      "measured_bubble": round(1 - unpipelined / seconds, 4)}), flush=True)


if __name__ == "__main__":
  app.run(main)

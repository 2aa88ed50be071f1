r"""Step-time benchmark of the GRPO loop: warm-up steps, then N measured steps, one JSON line out.

  python experiments/benchmark_main.py --config=experiments/configs/tiny_grpo.py --steps=10

Prints median step time and per-phase seconds and tokens/s (generate, train, overhead = everything else:
host scoring, reference log-probs, batch assembly), plus the first step's time (compile included; the
persistent compilation cache makes later runs' first step fast), the wall time of every step, the first
included (`run_steps_s`), and the programs compiled after the first step and their seconds
(`compiles_after_first_step`, `compile_s_after_first_step`: a step that meets a new shape), and where
the start-up's and the first step's compile time went (`startup_compile_s`, `first_step_compile_s`:
tracing, lowering and XLA's compile per program, from JAX's compile events); with
--turn_steps, `run_steps_s` includes the other side's turns. `generate_cores` and `train_cores`: the
phase's process CPU seconds (every thread: the host loop and XLA's pools) per wall second, medians over
the measured steps: how many of the machine's cores the phase keeps busy (compare the thread counts of
the simulator's processor-sharing model, `sim/costs.py::Sharing`).

With --spinners=K, K processes that each keep one core busy (a Python loop) run through the measured
steps. With --alone (the JSON line of the same run without them) it adds each phase's slowdown and the
thread count the simulator's processor-sharing model would need to predict it
(`generate_threads` / `train_threads`: `sim/costs.py::Sharing.threads_from_slowdown`, at most the core
count; a phase slowed more than the model allows reports the core count).

With --turn_steps=N the binary takes turns with another process (experiments/turns.py, driven by
experiments/benchmark_vs_trl.py): it ends a turn after the warm-up and after every N measured steps,
reporting those steps' seconds, and waits on stdin before going on.
"""
import contextlib
import json
import statistics
import time

from absl import app, flags
from ml_collections import config_flags

import common
import turns

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 10, "Measured steps.")
_PEAK = flags.DEFINE_float("peak_tflops", 0.0, "The device's peak dense TFLOP/s in the compute dtype (H200 "
                           "bfloat16: 989); when set, train_mfu = model FLOPs of the update / time / peak.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 2, "Unmeasured steps after the first one.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache ('' disables).")
_PROFILE_DIR = flags.DEFINE_string("profile_dir", "", "Trace the measured steps with jax.profiler into this "
                                   "folder (a Perfetto trace, *.trace.json.gz, beside the XPlane one).")
_TURN_STEPS = flags.DEFINE_integer("turn_steps", 0, "Take turns: wait on stdin after the warm-up and "
                                   "after every N measured steps (0: never).")
_SPINNERS = flags.DEFINE_integer("spinners", 0, "Processes that each keep one core busy during the measured "
                                 "steps (a competitor of known thread count).")
_ALONE = flags.DEFINE_string("alone", "", "With --spinners: the JSON line this binary printed for the same "
                             "config without spinners; adds each phase's slowdown and competing threads.")
_DISTRIBUTED = common.define_distributed_flags()   # several processes: docs/multihost.md
flags.mark_flags_as_required(["config"])

# Per-step figures a turn reports.
TURN_KEYS = ("step_s", "generate_s", "reward_s", "ref_s", "train_s", "switch/to_generate/seconds",
             "switch/to_train/seconds", "response_len_mean")


def maybe_end_turn(done: int, rows: list[dict]) -> None:
  """With --turn_steps, ends a turn once the warm-up and each block of measured steps are done."""
  n, warm = _TURN_STEPS.value, _WARMUP.value
  if n and done >= warm and (done - warm) % n == 0:
    block = rows[len(rows) - n:] if done > warm else []
    turns.end_turn({"steps": [{k: r[k] for k in TURN_KEYS if k in r} for r in block]})


def cpu_timeline():
  """A Timeline that also records each stepped phase's process CPU seconds and wall seconds
  (``.cpu[(name, step)]``)."""
  from rl_fusion_jax.timeline import Timeline  # pylint: disable=g-import-not-at-top

  class CpuTimeline(Timeline):
    def __init__(self):
      super().__init__()
      self.cpu = {}

    @contextlib.contextmanager
    def phase(self, name: str, *, group: str = "all", step: int | None = None):
      c0, w0 = time.process_time(), time.perf_counter()
      with super().phase(name, group=group, step=step):
        yield
      if step is not None:
        self.cpu[name, step] = (time.process_time() - c0, time.perf_counter() - w0)

  return CpuTimeline()


def _spin() -> None:
  while True:
    pass


@contextlib.contextmanager
def spinners(count: int):
  """``count`` processes, each one runnable thread that never waits, for the body's duration."""
  import multiprocessing  # pylint: disable=g-import-not-at-top
  procs = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(count)]
  for p in procs:
    p.start()
  try:
    yield
  finally:
    for p in procs:
      p.terminate()
      p.join()


def model_flops(cfg, response_len_mean: float) -> dict[str, float]:
  """Matmul FLOPs per step (2 per multiply-add; training = 3x forward), attention excluded.

  Generation runs every prompt position once (prefill) and one position per generated token, each
  through the layers and the lm head. The padded update runs forward + backward over B x (T - 1)
  positions through the layers (with ``optim.shared_prompts``, T - 1 + (group - 1) x (max_new_tokens - 1)
  positions a group) and, counted as before that option, the lm head over them all too (an upper bound:
  the update runs the head on a ``rollout.max_new_tokens`` window per row).
  """
  m, r = cfg.model.config, cfg.rollout
  n_kv, hd = m.num_kv_heads, m.head_dim
  per_layer = (m.hidden_size * hd * (2 * m.num_heads + 2 * n_kv)
               + 3 * m.hidden_size * m.intermediate_size)
  layers, head = m.num_layers * per_layer, m.hidden_size * m.vocab_size
  gen_tokens = r.batch_size * (r.max_prompt_len + response_len_mean)
  train_tokens = r.batch_size * (r.seq_len - 1)
  layer_tokens = train_tokens
  if cfg.optim.shared_prompts:
    from rl_fusion_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel
    layer_tokens = r.num_prompts * step_lib.shared_positions(r.seq_len, r.group_size, r.max_new_tokens)
  return {"generate": 2 * (layers + head) * gen_tokens, "train": 6 * (layers * layer_tokens + head * train_tokens)}


class CompileEvents:
  """JAX's compile events in this process (``jax.monitoring`` durations), per program; ``take`` returns those
  since the last call: {"total": {trace, lower, compile}, "programs": {name: {...}}}, seconds, the programs
  that took at least 0.05 s in all. ``compile`` is XLA's (or a persistent-cache load). A program jitted
  inside another is traced inside its caller's trace: its tracing counts in both."""

  KINDS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile"}

  def __init__(self):
    self.events: list[tuple[str, str, float]] = []

  def record(self, event: str, duration: float, **kwargs) -> None:
    if event in self.KINDS:
      name = str(kwargs.get("fun_name") or "?")
      self.events.append((self.KINDS[event], name.removeprefix("jit(").removesuffix(")"), duration))

  def take(self) -> dict:
    events, self.events = self.events, []
    zero = lambda: dict.fromkeys(("trace", "lower", "compile"), 0.0)
    total, programs = zero(), {}
    for kind, name, seconds in events:
      total[kind] += seconds
      programs.setdefault(name, zero())[kind] += seconds
    rnd = lambda d: {k: round(v, 3) for k, v in d.items()}
    return {"total": rnd(total), "programs": {n: rnd(p) for n, p in programs.items() if sum(p.values()) >= 0.05}}


def main(argv):
  del argv
  t_start = time.perf_counter()
  from rl_fusion_jax import config as config_lib
  cfg = config_lib.experiment_from_dict(_CONFIG.value)
  common.setup_jax(cfg.mesh.cpu_devices, _CACHE.value, _DISTRIBUTED())
  import jax
  from rl_fusion_jax import distributed
  from rl_fusion_jax.orchestration import phases, processes, setup as setup_lib
  from rl_fusion_jax.orchestration.programs import Programs
  from rl_fusion_jax.train import state as state_lib

  compile_events = CompileEvents()
  jax.monitoring.register_event_duration_secs_listener(compile_events.record)
  setup = setup_lib.validate(cfg, jax.device_count())
  distributed.check_same_config(config_lib.as_dict(cfg))
  programs = Programs(setup)
  programs.verify.share = processes.Share.of_run()   # host scoring split over the processes
  mesh = programs.mesh
  params = phases.init_policy(setup, programs)
  ref = programs.deployment.place_aux(params, programs.ref_param_shardings,
                                      keep_source=True) if cfg.algo.needs_reference else None
  state = state_lib.create_train_state(params, programs.tx, programs.state_shardings)
  programs.deployment.publish(state.params)
  timeline = cpu_timeline()
  for name, ids in programs.deployment.groups.items():
    timeline.add_group(name, ids)
  compiles = []    # (seconds) of every backend compile after the first step
  after_first = [False]
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(duration)
      if after_first[0] and event == "/jax/core/compile/backend_compile_duration" else None)
  t0 = time.perf_counter()
  startup_compiles = compile_events.take()
  state, first = phases.rl_step(setup, programs, state, ref, 0, timeline)
  first_s = time.perf_counter() - t0
  first_compiles = compile_events.take()
  after_first[0] = True
  rows = []
  maybe_end_turn(0, rows)
  spin = contextlib.ExitStack()
  for step in range(1, 1 + _WARMUP.value + _STEPS.value):
    if _PROFILE_DIR.value and step == _WARMUP.value + 1:
      jax.profiler.start_trace(_PROFILE_DIR.value, create_perfetto_trace=True)
    if step == _WARMUP.value + 1:
      spin.enter_context(spinners(_SPINNERS.value))
    state, m = phases.rl_step(setup, programs, state, ref, step, timeline)
    m = processes.reduce_metrics(step, m)   # of several processes: times are the slowest process's
    if step > _WARMUP.value:
      rows.append(m)
    maybe_end_turn(step, rows)
  run_s = time.perf_counter() - t0
  spin.close()
  if _PROFILE_DIR.value:
    jax.profiler.stop_trace()
  for r in rows:
    r["overhead_s"] = r["step_s"] - r["generate_s"] - r["train_s"]
  med = lambda k: statistics.median(r[k] for r in rows)
  step_s, gen_s, train_s = med("step_s"), med("generate_s"), med("train_s")
  flops = model_flops(cfg, med("response_len_mean"))
  measured = set(range(1 + _WARMUP.value, 1 + _WARMUP.value + _STEPS.value))
  def cores(name: str):
    per_step = [c / w for (n, k), (c, w) in timeline.cpu.items() if n == name and k in measured and w > 0]
    return round(statistics.median(per_step), 2) if per_step else None
  out = {
      "config": cfg.model.config.model_type, "precision": cfg.model.config.precision,
      "devices": jax.device_count(), "processes": jax.process_count(),
      "platform": jax.devices()[0].platform, "mesh": dict(mesh.shape), "steps": len(rows),
      "median_step_s": round(step_s, 4), "first_step_s": round(first_s, 3), "run_steps_s": round(run_s, 3),
      "compiles_after_first_step": len(compiles), "compile_s_after_first_step": round(sum(compiles), 3),
      "startup_s": round(t0 - t_start, 3),
      "startup_compile_s": startup_compiles, "first_step_compile_s": first_compiles,
      "generate_s": round(gen_s, 4), "train_s": round(train_s, 4),
      "generate_cores": cores("generate"), "train_cores": cores("train"),
      "overhead_s": round(med("overhead_s"), 4),
      "reward_s": round(med("reward_s"), 4), "ref_s": round(med("ref_s"), 4),
      "generate_gflop_per_s": round(flops["generate"] / gen_s / 1e9, 1),
      "train_gflop_per_s": round(flops["train"] / train_s / 1e9, 1),
      **({"train_mfu": round(flops["train"] / train_s / (_PEAK.value * 1e12), 4)} if _PEAK.value else {}),
      "generate_tokens_per_s": round(med("generate_tokens_per_s"), 1),
      "train_tokens_per_s": round(med("train_tokens_per_s"), 1),
      "response_len_mean": round(med("response_len_mean"), 2),
      "batch": cfg.rollout.batch_size, "seq_len": cfg.rollout.seq_len, "mode": cfg.fusion.mode,
  }
  for key in sorted({k for r in rows for k in r}):   # phase switch / weight sync figures, when present
    if key.startswith(("switch/", "sync/")):
      value = statistics.median(r[key] for r in rows if key in r)   # memory: only on sampled switches
      out[key] = round(value, 4) if key.endswith("seconds") else value
  if _SPINNERS.value:
    import os  # pylint: disable=g-import-not-at-top
    from rl_fusion_jax.sim.costs import Sharing  # pylint: disable=g-import-not-at-top
    out |= {"spinners": _SPINNERS.value, "cores": os.cpu_count()}
    if _ALONE.value:
      alone = json.loads(_ALONE.value)
      for phase in ("generate", "train"):
        slowdown = out[f"{phase}_s"] / alone[f"{phase}_s"]
        out[f"{phase}_slowdown"] = round(slowdown, 3)
        out[f"{phase}_threads"] = round(Sharing(cores=os.cpu_count()).threads_from_slowdown(
            slowdown, _SPINNERS.value), 2)
  del first
  if distributed.is_writer():
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
  app.run(main)

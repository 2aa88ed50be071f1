"""Start-up shared by the experiment binaries: flag parsing, CPU device count, compilation cache.

``setup_jax`` must run before anything touches a JAX backend: XLA reads its flags once.
``parse_flags`` turns a mistyped ``--config.a.b=...`` override into one line naming the full dotted path
and the closest valid key, instead of ml_collections' traceback.
"""
from __future__ import annotations

import difflib
import logging as std_logging
import os
import runpy
import sys

from absl import flags as absl_flags
from absl import logging


def _config_file(argv) -> tuple[str, str] | None:
  for arg in argv[1:]:
    if arg.startswith("--config="):
      path, _, variant = arg[len("--config="):].partition(":")
      return path, variant
  return None


def unknown_override(argv) -> str | None:
  """A message naming the first ``--config.X`` override whose path the config file does not have."""
  source = _config_file(argv)
  if source is None:
    return None
  try:
    config = runpy.run_path(source[0])["get_config"](source[1])
  except Exception:   # the config file itself is broken: absl's own error is the useful one
    return None
  from rl_fusion_jax.config import RENAMED_FIELDS  # pylint: disable=g-import-not-at-top
  for arg in argv[1:]:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--"):].partition("=")[0]
    if path.removeprefix("config.") in RENAMED_FIELDS:
      return f"--{path} was renamed: use --config.{RENAMED_FIELDS[path.removeprefix('config.')]}"
    node, walked = config, "config"
    for key in path.split(".")[1:]:
      keys = list(node.keys()) if hasattr(node, "keys") else []
      if key not in keys:
        match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
        hint = f"; did you mean --{walked}.{match[0]}?" if match else f"; known in {walked}: {sorted(keys)}"
        return f"--{path}: {walked} has no field {key!r}{hint}"
      node, walked = node[key], f"{walked}.{key}"
  return None


def parse_flags(argv):
  """absl flag parsing where a config override typo exits with one line (status 2), not a traceback."""
  try:
    return absl_flags.FLAGS(argv)
  except absl_flags.Error as e:
    sys.stderr.write(f"FATAL Flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.\n")
    sys.exit(1)
  except (AttributeError, KeyError, TypeError, ValueError):
    message = unknown_override(argv)
    if message is None:
      raise
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


class _DropLibraryInfo(std_logging.Filter):
  """Keeps INFO lines of this project; libraries (orbax logs every save step) only from WARNING up."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or "/site-packages/" not in record.pathname


def quiet_libraries() -> None:
  for handler in std_logging.getLogger().handlers + [logging.get_absl_handler()]:
    handler.addFilter(_DropLibraryInfo())


def median_seconds(fn, *args, repeats: int, warmup: int = 1) -> float:
  """Median wall time of ``fn(*args).block_until_ready()`` over ``repeats`` calls, after ``warmup``."""
  import statistics  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  for _ in range(warmup):
    fn(*args).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn(*args).block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def define_distributed_flags():
  """The multi-process settings of a binary (``rl_fusion_jax/distributed.py``); returns a function giving
  the ``DistributedConfig`` once flags are parsed."""
  f = absl_flags
  coordinator = f.DEFINE_string("coordinator_address", "", "host:port of process 0's coordination service "
                                "(else JAX_COORDINATOR_ADDRESS; unset: one process, or the cluster's own).")
  count = f.DEFINE_integer("num_processes", 0, "Processes in the run (else JAX_NUM_PROCESSES).")
  process = f.DEFINE_integer("process_id", -1, "This process's id, 0..num_processes-1 (else JAX_PROCESS_ID).")
  timeout = f.DEFINE_integer("distributed_timeout_s", 120, "Seconds start-up waits for the coordinator and "
                             "every process.")
  heartbeat = f.DEFINE_integer("heartbeat_timeout_s", 10, "Seconds without a heartbeat after which a process "
                               "counts as dead and the whole run fails.")

  def get():
    from rl_fusion_jax.distributed import DistributedConfig  # pylint: disable=g-import-not-at-top
    return DistributedConfig.from_flags(coordinator.value, count.value, process.value,
                                        timeout_s=timeout.value, heartbeat_timeout_s=heartbeat.value)
  return get


def setup_jax(cpu_devices: int, cache_dir: str, distributed=None) -> None:
  """One virtual CPU device per core by default (more only add overhead on CPU); persistent cache."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    count = cpu_devices or os.cpu_count() or 1
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  quiet_libraries()
  import jax  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax import gc_policy  # pylint: disable=g-import-not-at-top
  from rl_fusion_jax.testing import compile_log  # pylint: disable=g-import-not-at-top
  gc_policy.tune()
  compile_log.install()   # only under the tests (RLFJ_COMPILE_LOG): this process's compile seconds
  if distributed is not None:   # before anything starts the backend
    from rl_fusion_jax import distributed as distributed_lib  # pylint: disable=g-import-not-at-top
    distributed_lib.initialize(distributed)
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if jax.process_count() > 1 and jax.default_backend() == "cpu":   # processes' cache keys differ on CPU
      from rl_fusion_jax import distributed as distributed_lib  # pylint: disable=g-import-not-at-top
      distributed_lib.cache_from_every_process()
  logging.info("JAX %s on %s: %d devices, %d local to process %d of %d", jax.__version__,
               jax.devices()[0].platform, jax.device_count(), jax.local_device_count(), jax.process_index(),
               jax.process_count())


def summary_line(summary: dict) -> str:
  """The last line of a run: held-out greedy accuracy before and after RL, and pass@1 / pass@k when the
  config samples at evaluation (``task.eval_samples``), e.g.
  ``accuracy before RL: 0.270  after RL: 0.520  pass@1 0.180 -> 0.470  pass@8 0.610 -> 0.700  (300 RL steps)``.
  """
  before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
  parts = [f"accuracy before RL: {summary['accuracy_before']:.3f}  after RL: {summary['accuracy_after']:.3f}"]
  for key in sorted((k for k in before if k.startswith("pass@") and k in after), key=lambda k: int(k[5:])):
    parts.append(f"{key} {before[key]:.3f} -> {after[key]:.3f}")
  parts.append(f"({summary['steps']} RL steps)")
  return "  ".join(parts)


def run_binary(binary: str, args: list[str], log_path: str, env: dict[str, str] | None = None,
               cpu_samples: list | None = None) -> float:
  """Runs ``experiments/<binary>`` in a fresh process with ``args`` (its output to ``log_path``; ``env``:
  variables added to this process's environment); returns its wall seconds; raises RuntimeError with the
  log's tail when it fails. ``cpu_samples``: a list that receives ``CpuMonitor``'s rows of the run."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), binary)] + list(args)
  t0 = time.perf_counter()
  with open(log_path, "w") as log:
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None)
    monitor = CpuMonitor(child.pid) if cpu_samples is not None else None
    returncode = child.wait()
    if monitor is not None:
      cpu_samples.extend(monitor.stop())
  if returncode:
    with open(log_path) as log:
      raise RuntimeError(f"{' '.join(cmd)} failed (status {returncode}):\n{log.read()[-3000:]}")
  return time.perf_counter() - t0


class CpuMonitor:
  """Samples, every ``period`` seconds from a thread, what the machine's CPUs did while a run was made
  (Linux ``/proc``; nothing elsewhere): rows of [unix time, busy seconds of all CPUs (user, nice, system,
  irq, softirq), steal seconds (time the hypervisor ran something else on this machine's virtual CPUs),
  CPU seconds of the run's process tree (``pid`` and its descendants, with the children they reaped)].
  Differences between rows give the CPU that other processes used and the steal over any window
  (``cpu_interference``)."""

  def __init__(self, pid: int, period: float = 0.25):
    import threading  # pylint: disable=g-import-not-at-top
    self._pid, self._period, self._rows = pid, period, []
    self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)
    if os.path.isfile("/proc/stat"):
      self._thread.start()

  def _tree_ticks(self) -> int | None:
    stats = {}
    for entry in os.listdir("/proc"):
      if entry.isdigit():
        try:
          with open(f"/proc/{entry}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
          continue   # exited between the listing and the read
        # After the command name: state, ppid (field 4 of proc(5)), ..., utime, stime, cutime, cstime (14-17).
        stats[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    if self._pid not in stats:
      return None   # the run has exited and been reaped
    tree, frontier = {self._pid}, [self._pid]
    while frontier:
      parent = frontier.pop()
      for pid, (ppid, _) in stats.items():
        if ppid == parent and pid not in tree:
          tree.add(pid)
          frontier.append(pid)
    return sum(stats[p][1] for p in tree if p in stats)

  def sample(self) -> list[float] | None:
    """One row, or None once the run has exited."""
    import time  # pylint: disable=g-import-not-at-top
    now = time.time()
    with open("/proc/stat") as f:
      cpu = [int(x) for x in f.readline().split()[1:]]
    busy = cpu[0] + cpu[1] + cpu[2] + cpu[5] + cpu[6]
    steal = cpu[7] if len(cpu) > 7 else 0
    tree = self._tree_ticks()
    if tree is None:
      return None
    return [round(now, 3), busy / self._tick, steal / self._tick, tree / self._tick]

  def _loop(self) -> None:
    while not self._done.is_set():
      try:
        row = self.sample()
      except OSError:
        return
      if row is None:
        return
      self._rows.append(row)
      self._done.wait(self._period)

  def stop(self) -> list[list[float]]:
    if self._thread.is_alive():
      self._done.set()
      self._thread.join()
    return self._rows


def cpu_interference(rows: list[list[float]], cores: int, lo: float, hi: float) -> dict | None:
  """From ``CpuMonitor`` rows, over the samples that bracket the unix-time window [lo, hi]: CPU seconds
  used by processes outside the run (``other_cpu_s``), steal seconds (``steal_s``), both also as a share
  of the window's CPU seconds (``cores`` x its length, ``other_share``, ``steal_share``). None when the
  rows do not cover the window (not recorded, or a window shorter than the sampling period)."""
  before = [r for r in rows if r[0] <= lo]
  after = [r for r in rows if r[0] >= hi]
  if not before or not after:
    return None
  a, b = before[-1], after[0]
  span = b[0] - a[0]
  other = max(0.0, (b[1] - a[1]) - (b[3] - a[3]))
  steal = max(0.0, b[2] - a[2])
  return {"other_cpu_s": round(other, 3), "steal_s": round(steal, 3), "span_s": round(span, 3),
          "other_share": round(other / (cores * span), 4), "steal_share": round(steal / (cores * span), 4)}


def interference_share(interference: dict | None) -> float | None:
  """``cpu_interference``'s other processes plus steal, as one share of the window's CPU seconds (None: none)."""
  return None if interference is None else interference["other_share"] + interference["steal_share"]


# --quick runs of the report's parts: the main job's model at one layer (a quarter of its depth) and half its
# width (compiles faster).
QUICK_MODEL = ("--config.model.num_layers=1", "--config.model.scan_unroll=1", "--config.model.hidden_size=64",
               "--config.model.intermediate_size=192", "--config.model.num_heads=2", "--config.model.num_kv_heads=1")


def exported_warmup(root: str, steps: int, cache: str, extra: tuple[str, ...] = (), variant: str = "") -> str:
  """The main job's warm-up (experiments/configs/arithmetic.py, ``steps`` supervised steps, warmup.seed 0)
  exported as a Hugging Face folder ROOT/warmup_hf (``grpo_main.py --export_hf``), made once and then
  reused: RL runs start from it with ``--config.model.hf_path`` and ``--config.warmup.steps=0``.
  ``extra``: more overrides (``QUICK_MODEL``; the RL runs must then pass the same model fields);
  ``variant``: arithmetic.py's variant (e.g. ``steps``: the task with worked steps)."""
  out = os.path.join(root, "warmup_hf")
  if os.path.isfile(os.path.join(out, "model.safetensors")):
    return out
  os.makedirs(root, exist_ok=True)
  config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "arithmetic.py")
  config += f":{variant}" if variant else ""
  print(f"warm-up ({steps} steps) -> {out}", flush=True)
  run_binary("grpo_main.py", [f"--config={config}", f"--workdir={os.path.join(root, 'warmup_run')}",
                              f"--compilation_cache={cache}", "--config.run.steps=0",
                              f"--config.warmup.steps={steps}", "--config.task.eval_samples=0",
                              f"--export_hf={out}", *extra], os.path.join(root, "warmup_run.log"))
  return out


def run_wall_seconds(log_path: str) -> float:
  """Wall seconds of a finished run from its log (``run_binary``'s): the first to the last absl log line's
  time stamp (``I1202 01:35:49.155530 ...``; a run crossing midnight adds a day). 0 when unreadable."""
  import datetime  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  stamp = re.compile(r"^[IWEF](\d{4}) (\d{2}):(\d{2}):(\d{2})\.(\d{6}) ")
  times = []
  try:
    with open(log_path, errors="replace") as f:
      for line in f:
        m = stamp.match(line)
        if m:
          mmdd, h, mi, sec, us = m.groups()
          times.append((int(mmdd), datetime.timedelta(hours=int(h), minutes=int(mi), seconds=int(sec),
                                                       microseconds=int(us)).total_seconds()))
  except OSError:
    return 0.0
  if len(times) < 2:
    return 0.0
  (d0, t0), (d1, t1) = times[0], times[-1]
  return t1 - t0 + (86400.0 if d1 != d0 else 0.0)


# /proc/cpuinfo flag -> the name a machine record gives it: the vector extensions XLA:CPU's kernels use.
CPU_FEATURES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX"}


def machine_record() -> dict:
  """The machine as a run is made on it (written beside the run as RUN/machine.json by ablation_main.py and
  staleness_main.py, read by the report): CPU model, cores (all, and usable by this process), the 1-minute
  load average, OS, Python and the commit checked out (``+modified`` when tracked files differ from it).
  On Linux also the CPU family and which of ``CPU_FEATURES`` /proc/cpuinfo's flags hold (None elsewhere):
  the vector extensions that decide XLA:CPU's speed, which two machines of one model name can differ in."""
  import platform  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  model, family, features = "", None, None
  try:
    with open("/proc/cpuinfo") as f:
      fields = {}
      for line in f:
        if not line.strip():
          break                            # the first processor's block
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    model = fields.get("model name", "")
    family = int(fields["cpu family"]) if fields.get("cpu family", "").isdigit() else None
    present = set(fields.get("flags", "").split())
    features = [name for flag, name in CPU_FEATURES.items() if flag in present] if present else None
  except OSError:
    pass
  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:   # not Linux
    usable = os.cpu_count()
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10,
                            check=False).stdout.strip()
    # Tracked files changed since that commit: the run is of a working tree, not of the commit alone.
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    commit += "+modified" if commit and dirty else ""
  except (OSError, subprocess.SubprocessError):
    commit = ""
  return {"cpu_model": model or platform.processor() or "unknown", "cpu_family": family, "cpu_features": features,
          "cpu_count": os.cpu_count(), "usable_cores": usable, "load_avg_1m": round(os.getloadavg()[0], 2),
          "system": f"{platform.system()} {platform.release()} {platform.machine()}",
          "python": platform.python_version(), "commit": commit, "unix_time": round(time.time(), 1)}


def run_recorded(binary: str, args: list[str], workdir: str, env: dict[str, str] | None = None) -> float:
  """``run_binary`` of a run into ``workdir`` (log: ``workdir + '.log'``) that also writes
  WORKDIR/machine.json: ``machine_record()`` as the run starts, the load average as it ends and its
  seconds; and WORKDIR/cpu.json: ``CpuMonitor``'s rows over the run (Linux). Returns the seconds."""
  import json  # pylint: disable=g-import-not-at-top
  machine, cpu = machine_record(), []
  seconds = run_binary(binary, args, workdir + ".log", env, cpu_samples=cpu)
  if cpu:
    with open(os.path.join(workdir, "cpu.json"), "w") as f:
      json.dump({"columns": ["unix_time", "busy_s", "steal_s", "run_cpu_s"], "cores": os.cpu_count(),
                 "rows": cpu}, f)
  with open(os.path.join(workdir, "machine.json"), "w") as f:
    json.dump(machine | {"load_avg_1m_after": round(os.getloadavg()[0], 2), "run_seconds": round(seconds, 1)},
              f, indent=1)
  return seconds

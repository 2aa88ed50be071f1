r"""StaleSync in separated mode with one process per side (rollout, training), on this machine.

  python experiments/separated_main.py --config=experiments/configs/tiny_grpo.py --workdir=/tmp/sep \
      --config.fusion.mode=separated --config.stalesync.enabled=True --config.stalesync.max_staleness=1 \
      --config.mesh.cpu_devices=1 --schedule=reproducible --weight_transport=kv

Launches itself twice (process 0: rollout, process 1: training; ``--config.mesh.cpu_devices`` CPU devices
each, ``fusion.rollout_device_fraction=0.5``), joined by jax.distributed on 127.0.0.1, and prints the summary:
accuracy, and the overlap measured on the merged timeline (DIR/timeline.jsonl). Writes DIR/metrics.jsonl
(training side), DIR/summary.json and DIR/config.json. No checkpoints: resume is not supported here.

On two machines (or two shells), start one process per side yourself with the standard settings
(docs/multihost.md): the same command with ``--coordinator_address=HOST0:PORT --num_processes=2``
and ``--process_id=0`` (rollout, on HOST0) or ``--process_id=1`` (training); or the environment variables
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
"""
import json
import os
import socket
import subprocess
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (must hold no earlier run).")
_SCHEDULE = flags.DEFINE_enum("schedule", "reproducible", ["reproducible", "opportunistic"],
                              "Weights at fixed sample boundaries, or the newest at each boundary.")
_TRANSPORT = flags.DEFINE_enum("weight_transport", "kv", ["kv", "collective"], "How weights travel.")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache ('' disables).")
_DISTRIBUTED = common.define_distributed_flags()   # unset: this command starts both sides here
flags.mark_flags_as_required(["config", "workdir"])


def launch(argv) -> int:
  """Starts both sides with this command line; when one fails the other is ended (it would wait for it)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen([sys.executable] + argv + [f"--coordinator_address=127.0.0.1:{port}",
                                                       "--num_processes=2", f"--process_id={i}"]) for i in (0, 1)]
  while not all(p.poll() == 0 for p in procs) and not any(p.poll() for p in procs):
    time.sleep(0.5)
  for p in procs:
    if p.poll() is None:
      p.kill()
  return next((p.wait() for p in procs if p.wait()), 0)


def main(argv):
  del argv
  from rl_fusion_jax import config as config_lib  # after flags parse; imports jax
  from rl_fusion_jax.errors import ConfigError, RunError
  try:
    distributed = _DISTRIBUTED()
  except ConfigError as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(1)
  if not distributed.explicit:
    sys.exit(launch(sys.argv))
  role = distributed.process_id
  try:
    if distributed.num_processes != 2 or role not in (0, 1):
      raise ConfigError(f"--num_processes={distributed.num_processes} --process_id={role}: the separated "
                        "schedule runs exactly 2 processes (0: rollout, 1: training)")
    cfg = config_lib.experiment_from_dict(_CONFIG.value)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +   # per process; before JAX starts
                               f" --xla_force_host_platform_device_count={cfg.mesh.cpu_devices or 1}").strip()
    common.quiet_libraries()
    from rl_fusion_jax.orchestration import separated
    separated.initialize(distributed, _TRANSPORT.value)
    import jax
    from rl_fusion_jax.testing import compile_log  # pylint: disable=g-import-not-at-top
    compile_log.install()   # only under the tests (RLFJ_COMPILE_LOG): this process's compile seconds
    if _CACHE.value:   # each side compiles its own programs: both write their cache entries
      jax.config.update("jax_compilation_cache_dir", os.path.expanduser(_CACHE.value))
      from rl_fusion_jax import distributed as distributed_lib  # pylint: disable=g-import-not-at-top
      distributed_lib.cache_from_every_process()
    options = separated.Options(reproducible=_SCHEDULE.value == "reproducible",
                                weight_transport=_TRANSPORT.value)
    summary = separated.run(cfg, _WORKDIR.value, options)
  except RunError as e:
    sys.stderr.write(f"error ({('rollout', 'training', '?')[role if role in (0, 1) else 2]} process): {e}\n")
    sys.exit(1)
  if role == 0:
    logging.info("summary: %s", json.dumps({k: v for k, v in summary.items() if k != "groups"}, indent=1))
    # After step 0 when the run has steps after it on both sides, else over the whole run.
    key, when = (("overlap_after_first", "after step 0") if "overlap_after_first/both_busy_frac" in summary
                 else ("overlap", "over the run"))
    print(f"accuracy before RL: {summary['accuracy_before']:.3f}  after RL: {summary['accuracy_after']:.3f}  "
          f"both sides busy {summary[f'{key}/both_busy_frac']:.1%} of the time {when} "
          f"(rollout idle {summary[f'{key}/rollout_idle_frac']:.1%}, training idle "
          f"{summary[f'{key}/train_idle_frac']:.1%})")
  jax.distributed.shutdown()


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)

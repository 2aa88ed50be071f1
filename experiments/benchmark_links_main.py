r"""Bytes that cross between hosts in the main job run across processes, per step, one table out.

  python experiments/benchmark_links_main.py --arms=sync,sync_32,stalesync,stalesync_32 --out=/tmp/links.json

Each arm runs ``experiments/grpo_main.py`` on ``experiments/configs/arithmetic.py`` as ``--processes``
local processes x ``--devices`` CPU devices each, joined by ``jax.distributed`` on 127.0.0.1
(``testing.launch``), with the multi-host test's settings (one layer, 8 warm-up steps, 16 held-out
problems, no checkpoint but the last). Arms: ``sync`` (the synchronous step, ``fusion.mode=full``),
``stalesync`` (the ``:stalesync`` variant: s = 1, half the groups per update, colocated), ``hybrid`` (the
``:kl`` variant in ``fusion.mode=hybrid``: the reference on one aux device per process, scoring samples
as they finish; the update on packed rows), each with the config's slots (one per outstanding sample) or,
suffixed ``_32``, 32 slots refilled as samples finish (a sample's slot, and so its process, is then not
the process whose devices train on it).

Per RL step it reads from the run's metrics what one host moved (``*_this_host``: the busiest host's):
the engine's blocks it read from its own devices (``engine_to_host``), the finished rows it received from
the other hosts after each chunk (``engine_rows_between_hosts``), and the rows its devices train on that it
received from their holders (``rows_between_hosts``; ``..._padded``: the same rows as int32 / float32 rows
of the batch's width), the tokens its aux devices score that it received
from their holders (``aux_rows_between_hosts``; hybrid), and the step's loss. Prints a table of the medians
over the steps; ``--out`` writes every step's numbers as JSON. ``PYTHONPATH`` picks the tree that runs
(``testing.launch`` starts that tree's binary), so one command measures two commits.
"""
import json
import os
import statistics
import tempfile

from absl import app, flags

from rl_fusion_jax.testing import launch

_ARMS = flags.DEFINE_list("arms", ["sync", "sync_32", "stalesync", "stalesync_32", "hybrid", "hybrid_32"],
                          "Arms to run (see above).")
_PROCESSES = flags.DEFINE_integer("processes", 2, "Local processes.")
_DEVICES = flags.DEFINE_integer("devices", 2, "CPU devices per process.")
_STEPS = flags.DEFINE_integer("steps", 4, "RL steps per arm.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Where the runs go ('': a temporary folder).")
_OUT = flags.DEFINE_string("out", "", "Write every step's numbers here as JSON ('': print only).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 600, "Seconds an arm may run.")

CONFIG = os.path.join(launch.ROOT, "experiments", "configs", "arithmetic.py")
SETTINGS = ["--config.warmup.steps=8", "--config.warmup.checkpoint_every=0", "--config.task.eval_problems=16",
            "--config.task.eval_samples=0", "--config.run.eval_every=0", "--config.run.checkpoint_every=0",
            "--config.model.num_layers=1", "--config.model.scan_unroll=1"]
LINKS = ("engine_to_host", "engine_rows_between_hosts", "rows_between_hosts", "rows_between_hosts_padded",
         "aux_rows_between_hosts")


def arm_args(arm: str) -> list[str]:
  """An arm's name -> its config and overrides."""
  base, _, slots = arm.partition("_")
  if base not in ("sync", "stalesync", "hybrid") or slots not in ("", "32"):
    raise app.UsageError(f"--arms: unknown arm {arm!r} (sync, stalesync, hybrid, each also with _32)")
  args = {"sync": [f"--config={CONFIG}", "--config.fusion.mode=full"],
          "stalesync": [f"--config={CONFIG}:stalesync"],
          "hybrid": [f"--config={CONFIG}:kl", "--config.fusion.mode=hybrid", "--config.fusion.aux_devices=2",
                     "--config.optim.pack_rows=True"]}[base]
  return args + (["--config.rollout.num_slots=32"] if slots else [])


def run_arm(arm: str, root: str) -> list[dict]:
  """Runs one arm to the end -> per RL step: what the busiest host moved on each link, and the loss."""
  workdir = os.path.join(root, arm)
  run = launch.start("grpo_main.py", arm_args(arm) + SETTINGS + [f"--workdir={workdir}",
                                                                 f"--config.run.steps={_STEPS.value}"],
                     processes=_PROCESSES.value, devices=_DEVICES.value, log_dir=workdir + "_logs")
  codes = run.wait(_TIMEOUT.value)
  if codes != [0] * _PROCESSES.value:
    raise RuntimeError(f"{arm}: exit codes {codes}\n" + "\n".join(run.log(i)[-3000:] for i in range(len(codes))))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  key = lambda link: f"queue/link_bytes/{link}_this_host"
  return [{"step": r["step"], "loss": r["loss"], **{link: r.get(key(link), 0.0) for link in LINKS}}
          for r in rows if "loss" in r]


def main(argv):
  del argv
  root = _WORKDIR.value or tempfile.mkdtemp(prefix="links_")
  results = {arm: run_arm(arm, root) for arm in _ARMS.value}
  print(f"{_PROCESSES.value} processes x {_DEVICES.value} devices, {_STEPS.value} RL steps; bytes per step that "
        "the busiest host moved, median over the steps (min-max)")
  print("| arm | " + " | ".join(LINKS) + " |")
  print("|---" * (len(LINKS) + 1) + "|")
  for arm, steps in results.items():
    cell = lambda link: (f"{statistics.median(s[link] for s in steps):,.0f} "
                         f"({min(s[link] for s in steps):,.0f}-{max(s[link] for s in steps):,.0f})")
    print(f"| {arm} | " + " | ".join(cell(link) for link in LINKS) + " |")
  for arm, steps in results.items():
    print(f"{arm} losses: " + ", ".join(f"{s['loss']:.6f}" for s in steps))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)

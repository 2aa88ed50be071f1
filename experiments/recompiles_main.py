r"""Programs traced after a run's first RL step: a config's run, counted step by step.

  python experiments/recompiles_main.py --config=experiments/configs/arithmetic.py:stalesync --steps=10

Runs the config (warm-up cut to --warmup_steps, a checkpoint and a held-out evaluation every 4 RL steps,
--eval_problems held-out problems) in this process and prints one JSON line: for every RL step after the
first that traced a function (each jit cache miss traces first: a new compile, or a persistent-cache load),
the functions it traced, from the start of that step to the start of the next (the checkpoint and the
evaluation after a step count with it). ``{}``: the run compiled nothing after its first step. No
persistent compilation cache unless --compilation_cache is given. Exits 1 when a step after the first traced
something.
"""
import collections
import json
import sys
import tempfile

from absl import app, flags
from ml_collections import config_flags

import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=False)
_STEPS = flags.DEFINE_integer("steps", 10, "RL steps.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 24, "Supervised warm-up steps (at most the config's).")
_EVAL = flags.DEFINE_integer("eval_problems", 16, "Held-out problems of each evaluation.")
_CACHE = flags.DEFINE_string("compilation_cache", "", "Persistent compilation cache folder ('': none).")


def main(argv):
  del argv
  c = _CONFIG.value
  c.warmup.update(steps=min(c.warmup.steps, _WARMUP.value), checkpoint_every=0)
  c.run.update(steps=_STEPS.value, checkpoint_every=4, eval_every=4, progress_every_s=0.0)
  c.task.update(eval_problems=_EVAL.value)
  from rl_fusion_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.experiment_from_dict(c.to_dict())
  common.setup_jax(cfg.mesh.cpu_devices, _CACHE.value)
  from rl_fusion_jax.testing import experiments  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as workdir:
    per_step = experiments.traces_per_step(cfg, workdir)
  later = {step: dict(collections.Counter(traced)) for step, traced in enumerate(per_step, start=1)
           if step > 1 and traced}
  print(json.dumps({"steps": len(per_step), "traced_in_step_1": len(per_step[0]) if per_step else 0,
                    "traced_after_step_1": later}), flush=True)
  sys.exit(1 if later else 0)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)

r"""The RL binary: GRPO, PPO or DAPO, synchronous or StaleSync, in any single-program deployment mode.

  python experiments/grpo_main.py --config=experiments/configs/arithmetic.py --workdir=/tmp/grpo

Overrides: ``--config.rollout.temperature=0.7``; the config is locked, so a typo fails at start naming
the full path and the closest key. Writes DIR/config.json, DIR/metrics.jsonl, DIR/checkpoints/ and
DIR/summary.json, and resumes from the newest intact checkpoint in DIR (docs/failures.md).
Errors a user can act on (bad config, refused resume, a workdir in use, divergence, a checkpoint that
cannot be written) print one line and exit with status 1. SIGTERM / SIGINT finish the step, write a
checkpoint and exit with status 75 (a second signal exits at once); the same command resumes.
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (created; resumed if it has checkpoints).")
_CACHE = flags.DEFINE_string("compilation_cache", "~/.cache/rl_fusion_jax/jax_cache",
                             "Persistent XLA compilation cache ('' disables).")
_TENSORBOARD = flags.DEFINE_bool("tensorboard", False, "Also write TensorBoard logs (needs tensorboardX).")
_RESUME_OVERRIDE = flags.DEFINE_list(
    "resume_override", [], "Config fields (e.g. rollout.num_prompts) a resumed run may change although "
    "they change the meaning of the run; each is logged and recorded in DIR/resume_log.jsonl.")
_EXPORT_HF = flags.DEFINE_string("export_hf", "", "Also write the final policy as a Hugging Face checkpoint "
                                  "folder here (loadable with --config.model.hf_path).")
_DISTRIBUTED = common.define_distributed_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  from rl_fusion_jax import config as config_lib  # after flags parse; imports jax
  from rl_fusion_jax.errors import PREEMPTED_EXIT, Preempted, RunError
  try:
    cfg = config_lib.experiment_from_dict(_CONFIG.value)
    common.setup_jax(cfg.mesh.cpu_devices, _CACHE.value, _DISTRIBUTED())
    from rl_fusion_jax.orchestration import loop
    logging.info("config:\n%s", _CONFIG.value)
    summary = loop.run(cfg, _WORKDIR.value, tensorboard=_TENSORBOARD.value,
                       resume_overrides=_RESUME_OVERRIDE.value, export_hf=_EXPORT_HF.value)
  except Preempted as e:
    sys.stderr.write(f"preempted: {e}\n")
    sys.exit(PREEMPTED_EXIT)
  except RunError as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(1)
  except OSError as e:   # a file of the run (metrics, timeline, config) could not be written or read
    if e.filename is None:
      raise
    sys.stderr.write(f"error: {e.filename}: {e.strerror}\n")
    sys.exit(1)
  print(common.summary_line(summary))


if __name__ == "__main__":
  app.run(main, flags_parser=common.parse_flags)

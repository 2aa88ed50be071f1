"""Resuming a run: may this config continue the workdir's run, and from which intact checkpoint.

The order is the guarantee (``loop.run`` follows it):
  1. ``check_workdir``: the path is a directory we can write (or can be created), named as ``--workdir``.
  2. ``inspect``: reads only JSON (checkpoint meta records, else ``config.json``) and compares the saved
     config with this one. A difference in a field that changes the meaning of the run (seed, model,
     batch shape, task, algorithm, optimizer, sampling, ...) is a ``ResumeError`` naming every such field,
     unless ``--resume_override`` lists it; the harmless ones (``HARMLESS``: length, logging, cadence,
     layout) are allowed and logged. Nothing is written or compiled.
  3. ``restore``: the newest checkpoint that restores intact (RL checkpoints, then warm-up ones). A
     corrupt newer one is reported and moved aside (never deleted), but only once an older one has
     restored; when none is intact the run stops with every path and reason and nothing is moved.
  4. ``prepare``: only now the workdir is written: ``config.json``, ``tokenizer.json``,
     ``resume_log.jsonl`` (every resume with changed fields), and ``metrics.jsonl`` / ``timeline.jsonl``
     truncated to the restored checkpoint, so every step is recorded exactly once.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from absl import logging

from rl_fusion_jax import checkpointing
from rl_fusion_jax import config as config_lib
from rl_fusion_jax import distributed
from rl_fusion_jax import metrics as metrics_lib
from rl_fusion_jax import timeline as timeline_lib
from rl_fusion_jax.config import ExperimentConfig
from rl_fusion_jax.errors import CheckpointError, ResumeError
from rl_fusion_jax.orchestration.setup import write_json_atomic

RL_DIR, WARMUP_DIR = "checkpoints", "warmup_checkpoints"

# Fields (or sections, ending in '.') a resumed run may change freely: they change how long it runs,
# what it logs, how often it saves, or where arrays live, never what it computes.
HARMLESS = ("run.steps", "run.checkpoint_every", "run.keep_checkpoints", "run.progress_every_s",
            "run.eval_every", "run.on_nonfinite", "run.max_consecutive_skips", "warmup.checkpoint_every",
            "rollout.num_slots", "rollout.chunk_steps", "task.verify_workers", "task.eval_examples", "mesh.",
            "fusion.")


def check_workdir(workdir: str) -> None:
  """Raises a ResumeError naming --workdir when it is not a directory this process can write."""
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ResumeError(f"--workdir={workdir}: exists and is not a directory")
  probe = path
  while not os.path.exists(probe):
    parent = os.path.dirname(probe)
    if parent == probe:
      break
    probe = parent
  if not os.path.isdir(probe):
    raise ResumeError(f"--workdir={workdir}: {probe} is not a directory, so the workdir cannot be created")
  if not os.access(probe, os.W_OK | os.X_OK):
    raise ResumeError(f"--workdir={workdir}: {probe} is not writable")


# ----------------------------------------------------------------------------------------------------
# Config comparison.
# ----------------------------------------------------------------------------------------------------

def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Dotted paths of a config dict (as_dict form); ``model.config.X`` is reported as ``model.X``."""
  out = {}
  for key, value in config.items():
    path = f"{prefix}{key}"
    if path == "model.config":
      path = "model"
    if isinstance(value, Mapping) and value:
      out.update(flatten(value, path + "."))
    else:
      out[path] = value
  return out


def plain_config(cfg: ExperimentConfig) -> dict[str, Any]:
  """The config as saved in checkpoints and config.json (JSON types: lists, not tuples)."""
  return json.loads(json.dumps(config_lib.as_dict(cfg)))


def _matches(path: str, patterns: Iterable[str]) -> bool:
  return any(path == p or (p.endswith(".") and path.startswith(p)) or path.startswith(p + ".")
             for p in patterns)


def _section_defaults() -> dict[str, Any]:
  """Dotted path -> dataclass default of every field outside ``model`` (JSON types)."""
  out = {}
  for f in dataclasses.fields(config_lib.ExperimentConfig):
    if f.name == "model" or f.default_factory is dataclasses.MISSING:
      continue
    out.update(flatten(json.loads(json.dumps(dataclasses.asdict(f.default_factory()))), f.name + "."))
  return out


def compare(saved: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
  """{path: (saved value, new value)} for every field that differs (absent: '<absent>').

  A run saved before a field was renamed (``config.RENAMED_FIELDS``) is read under the new name, and a
  field added since (absent from the saved run) that holds its default now is no change: the saved run
  ran with that default's behaviour."""
  a = {config_lib.RENAMED_FIELDS.get(p, p): v for p, v in flatten(saved).items()}
  b, defaults = flatten(new), _section_defaults()
  return {p: (a.get(p, "<absent>"), b.get(p, "<absent>")) for p in sorted(set(a) | set(b))
          if a.get(p, "<absent>") != b.get(p, "<absent>")
          and not (p not in a and p in defaults and b.get(p) == defaults[p])}


def normalize_overrides(overrides: Iterable[str], known: Iterable[str]) -> tuple[str, ...]:
  """``config.rollout.num_prompts`` -> ``rollout.num_prompts``; an unknown field is a ResumeError."""
  known = list(known)
  out = []
  for name in overrides:
    name = name.strip()
    if not name:
      continue
    name = name[len("config."):] if name.startswith("config.") else name
    if not any(k == name or k.startswith(name + ".") for k in known):
      raise ResumeError(f"--resume_override: no config field {name!r}{config_lib.closest(name, known)}")
    out.append(name)
  return tuple(out)


# ----------------------------------------------------------------------------------------------------
# Inspection (reads JSON only).
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Prior:
  """What the workdir holds, as far as JSON tells, and how this config differs from it."""
  workdir: str
  candidates: list[tuple[str, checkpointing.Checkpointer, int]]   # (kind, checkpointer, step), newest first
  saved_from: str | None = None                                     # where the saved config was read
  changes: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
  overridden: tuple[str, ...] = ()


def checkpointers(workdir: str, keep: int, *, create: bool):
  return (checkpointing.Checkpointer(os.path.join(workdir, RL_DIR), keep, create=create),
          checkpointing.Checkpointer(os.path.join(workdir, WARMUP_DIR), keep, create=create))


def _saved_config(workdir: str, candidates) -> tuple[dict | None, str | None]:
  for _, ckpt, step in candidates:
    try:
      return ckpt.read_meta(step).get("config"), ckpt.step_path(step)
    except CheckpointError as e:
      logging.warning("resume: %s (its config is not compared)", e)
  path = os.path.join(workdir, "config.json")
  if os.path.exists(path):
    try:
      with open(path, encoding="utf-8") as f:
        return json.load(f), path
    except (OSError, json.JSONDecodeError) as e:
      raise ResumeError(f"--workdir={workdir}: {path} is unreadable ({e}); move it or use a new workdir")
  return None, None


def inspect(workdir: str, cfg: ExperimentConfig, overrides: Iterable[str] = ()) -> Prior:
  """Compares this config with the workdir's run; raises ResumeError before anything is written."""
  rl, warm = checkpointers(workdir, cfg.run.keep_checkpoints, create=False)
  candidates = ([("rl", rl, s) for s in reversed(rl.steps())]
                + [("warmup", warm, s) for s in reversed(warm.steps())])
  prior = Prior(os.path.abspath(workdir), candidates)
  saved, prior.saved_from = _saved_config(workdir, candidates)
  new = plain_config(cfg)
  prior.overridden = normalize_overrides(overrides, set(flatten(new)) | set(flatten(saved or {})))
  if saved is None:
    return prior
  prior.changes = compare(saved, new)
  refused = [p for p in prior.changes if not _matches(p, HARMLESS) and not _matches(p, prior.overridden)]
  if refused:
    lines = "\n".join(f"  config.{p}: {prior.changes[p][0]!r} in the saved run, {prior.changes[p][1]!r} now"
                      for p in refused)
    raise ResumeError(
        f"--workdir={workdir} holds a run with another config ({prior.saved_from}); these fields change "
        f"the meaning of the run:\n{lines}\nUse a new --workdir, or continue anyway with "
        f"--resume_override={','.join(refused)}")
  for p, (old, value) in prior.changes.items():
    logging.warning("resume: config.%s changed from %r to %r%s", p, old, value,
                    " (overridden)" if not _matches(p, HARMLESS) else "")
  rl_steps = [s for kind, _, s in candidates if kind == "rl"]
  if rl_steps and rl_steps[0] > cfg.run.steps:
    raise ResumeError(f"config.run.steps={cfg.run.steps}: the run in --workdir={workdir} is already at "
                      f"step {rl_steps[0]}; set run.steps >= {rl_steps[0]} or use a new workdir")
  return prior


# ----------------------------------------------------------------------------------------------------
# Restore with fallback.
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Restored:
  kind: str                   # 'rl' or 'warmup'
  step: int
  items: dict[str, Any]
  meta: dict[str, Any]
  host: Any = None            # host state saved with it (StaleSync: queue, in-flight samples), or None


def restore(prior: Prior, targets_for) -> Restored | None:
  """Restores the newest intact candidate; ``targets_for(kind, meta)`` gives the abstract targets.

  A checkpoint that lacks an item this config needs, or whose shapes differ from it, is a config
  problem, not corruption: that stops the resume at once (ResumeError) and nothing is moved.
  """
  failures = []
  for kind, ckpt, step in prior.candidates:
    try:
      meta = ckpt.read_meta(step)
      items, meta = ckpt.restore(step, targets_for(kind, meta))
      host = ckpt.restore_host(step, meta)
    except CheckpointError as e:
      if _is_config_problem(e):
        raise ResumeError(f"--workdir={prior.workdir}: checkpoint {e.path} does not fit this config: "
                          f"{e.reason}") from e
      logging.warning("resume: cannot restore %s: %s", e.path, e.reason)
      failures.append((ckpt, step, e))
      continue
    for bad_ckpt, bad_step, e in failures:   # process 0 moves it; every process learns where
      dest = distributed.on_writer("move_aside", bad_ckpt.move_aside, bad_step, e.reason)
      if dest is not None:
        logging.warning("resume: moved the broken checkpoint %s aside to %s", e.path, dest)
    logging.info("resumed from %s checkpoint %s", kind, ckpt.step_path(step))
    return Restored(kind, step, items, meta, host)
  if failures:
    reasons = "\n".join(f"  {e.path}: {e.reason}" for _, _, e in failures)
    raise ResumeError(f"--workdir={prior.workdir}: no checkpoint restores intact (nothing was moved or "
                      f"written):\n{reasons}")
  return None


def _is_config_problem(e: CheckpointError) -> bool:
  return " in this config" in e.reason or "not in this config's model" in e.reason or \
      e.reason.startswith("not saved:")


# ----------------------------------------------------------------------------------------------------
# Writing the workdir (after every check passed).
# ----------------------------------------------------------------------------------------------------

def write_text_atomic(path: str, text: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def prepare(prior: Prior, cfg: ExperimentConfig, tokenizer, restored: Restored | None) -> None:
  """Writes config and tokenizer, logs the resume, truncates outputs to the restored checkpoint."""
  workdir = prior.workdir
  os.makedirs(workdir, exist_ok=True)
  write_json_atomic(os.path.join(workdir, "config.json"), config_lib.as_dict(cfg))
  if hasattr(tokenizer, "to_json"):
    write_text_atomic(os.path.join(workdir, "tokenizer.json"), tokenizer.to_json())
  if prior.changes:
    record = {"unix_time": time.time(), "saved_config": prior.saved_from,
              "restored": None if restored is None else f"{restored.kind}:{restored.step}",
              "changed": {p: list(v) for p, v in prior.changes.items()},
              "overridden": [p for p in prior.changes if not _matches(p, HARMLESS)]}
    with open(os.path.join(workdir, "resume_log.jsonl"), "a", encoding="utf-8") as f:
      f.write(json.dumps(record, sort_keys=True) + "\n")
  last_step = restored.step if restored is not None and restored.kind == "rl" else None
  until = restored.meta.get("timeline_time") if restored is not None else None
  dropped = metrics_lib.truncate_metrics(workdir, last_step)
  dropped_phases = timeline_lib.truncate_file(timeline_lib.timeline_path(workdir), until)
  if dropped or dropped_phases:
    logging.info("resume: dropped %d metric rows and %d timeline lines recorded after the checkpoint",
                 dropped, dropped_phases)

"""Orbax checkpoints of a run: params, optimizer state, reference params and loop metadata.

Params and optimizer state are separate items so generation (or evaluation) can restore params alone.
Saves are asynchronous; orbax writes each step into a temporary folder and renames it when complete, so
a crash never leaves a half-written checkpoint that resume would pick up. Restores take abstract targets
carrying shardings, so a run can resume onto another mesh or device count.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from rl_fusion_jax.train.state import TrainState


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` rooted at ``<workdir>/checkpoints``."""

  def __init__(self, workdir: str, keep: int = 2):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._mngr = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def save(self, step: int, state: TrainState, meta: dict[str, Any], ref_params=None) -> None:
    items = {
        "params": ocp.args.StandardSave(state.params),
        "opt_state": ocp.args.StandardSave(state.opt_state),
        "counters": ocp.args.StandardSave({"step": state.step, "policy_version": state.policy_version}),
        "meta": ocp.args.JsonSave(meta),
    }
    if ref_params is not None:
      items["ref_params"] = ocp.args.StandardSave(ref_params)
    self._mngr.save(step, args=ocp.args.Composite(**items))

  def restore(self, step: int, like: TrainState, shardings: TrainState, ref_like=None):
    """Returns (state, meta, ref_params or None) restored into ``shardings``."""
    items = {
        "params": ocp.args.StandardRestore(_abstract(like.params, shardings.params)),
        "opt_state": ocp.args.StandardRestore(_abstract(like.opt_state, shardings.opt_state)),
        "counters": ocp.args.StandardRestore(_abstract(
            {"step": like.step, "policy_version": like.policy_version},
            {"step": shardings.step, "policy_version": shardings.policy_version})),
        "meta": ocp.args.JsonRestore(),
    }
    if ref_like is not None:
      items["ref_params"] = ocp.args.StandardRestore(_abstract(ref_like, shardings.params))
    out = self._mngr.restore(step, args=ocp.args.Composite(**items))
    state = TrainState(step=out["counters"]["step"], params=out["params"], opt_state=out["opt_state"],
                       policy_version=out["counters"]["policy_version"])
    return state, dict(out["meta"]), (out["ref_params"] if ref_like is not None else None)

  def restore_params(self, step: int, like, shardings):
    out = self._mngr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(like, shardings))))
    return out["params"]

  def wait(self) -> None:
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()

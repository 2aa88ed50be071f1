"""The advantage stage: per-sample advantages computed on the host, a group at a time, once the group's
rewards are in.

An estimator registered ``per_group`` (``registry.PER_GROUP_ADVANTAGES``: grpo, dr_grpo, rloo) gives a
sample's advantage from its own group's rewards alone, so it does not have to wait for the batch it will
be trained in. Where it applies (``on_host``: such an estimator, and no KL in the reward, which needs the
batch's reference log-probs on the device) every run computes the advantages here, with the registered
(jax) function, jitted for one group shape on this process's first CPU device: the update's program then
takes them as given and broadcasts them over each sample's response tokens. A token-level estimator
(GAE, with a critic) or KL in the reward keeps the advantages in the update's program, over the batch.

Under StaleSync the advantages are a field of the DistQueue (``ADVANTAGE_FIELDS``; ``in_queue``: with a
reward model only where its scores are a queue field too, ``rm_score`` in ``hybrid``; elsewhere they are
added in the train phase): :class:`AdvantageStage` is a registered consumer of each sample's ``reward``
(and ``rm_score``), ``response_len`` and ``group_id``; it runs after the reward stage writes a rollout
phase's scores and writes ``advantage`` for every group whose samples are all scored.
The trainer's consumer needs ``advantage``, so a group is ready for the trainer once its advantages are
written, whichever step it is admitted in. Its reads are host bookkeeping (the values are this host's
already) and stay out of the queue's byte counters (``counted=False``).
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from rl_fusion_jax.algorithms import dapo, registry
from rl_fusion_jax.queue.distqueue import DistQueue

ADVANTAGE_FIELDS = (("advantage", np.float32),)
CONSUMER = "advantage"
NEEDS = ("reward", "response_len", "group_id")
# Groups per call of the jitted estimator (the last call padded with groups of zeros): one program shape.
GROUPS_PER_CALL = 8


def on_host(algo) -> bool:
  """Whether the run's advantages are computed here (see the module docstring)."""
  return algo.advantage in registry.PER_GROUP_ADVANTAGES and not (algo.kl_coef > 0 and algo.kl_mode == "reward")


def in_queue(cfg, reward_model: bool, rm_in_queue: bool) -> bool:
  """Whether a StaleSync queue holds the advantages as a field (``reward_model``: the run has one;
  ``rm_in_queue``: its scores are a queue field too, as in ``hybrid``)."""
  return on_host(cfg.algo) and (not reward_model or rm_in_queue)


def with_reward_model(cfg, rewards, rm_b):
  """The rewards plus the reward model's weighted scores (``task.reward_model_weight``), float32."""
  return (rewards + cfg.task.reward_model_weight * np.asarray(rm_b, np.float32)).astype(np.float32)


def shaped_rewards(cfg, response_len_b, rewards):
  """The verifier's rewards with DAPO's overlong penalty added (``algo.overlong_buffer`` > 0) -> (rewards,
  metrics); as they are otherwise."""
  a = cfg.algo
  if not a.overlong_buffer:
    return rewards, {}
  penalty = np.asarray(dapo.overlong_penalty(np.asarray(response_len_b), max_len=cfg.rollout.max_new_tokens,
                                             buffer=a.overlong_buffer, factor=float(a.overlong_factor)))
  return (rewards + penalty).astype(np.float32), {"overlong/penalty_mean": float(penalty.mean()),
                                                  "overlong/penalized_frac": float((penalty < 0).mean())}


@functools.lru_cache(maxsize=16)
def _groups_fn(name: str, group_size: int, hparams: tuple):
  fn = registry.get_advantage_fn(name)
  return jax.jit(jax.vmap(lambda rewards_g: fn(rewards_g, group_size, **dict(hparams))))


def advantages(algo, group_size: int, rewards_b) -> np.ndarray:
  """[B] float32 advantages of ``rewards_b`` (B a multiple of ``group_size``, each group's samples
  consecutive), computed group by group by the registered ``per_group`` estimator."""
  rewards = np.asarray(rewards_b, np.float32)
  if rewards.ndim != 1 or len(rewards) % group_size:
    raise ValueError(f"advantages: {rewards.shape} rewards are not whole groups of {group_size}")
  if algo.advantage not in registry.PER_GROUP_ADVANTAGES:
    raise ValueError(f"advantage estimator {algo.advantage!r} is not registered per_group")
  fn = _groups_fn(algo.advantage, group_size, tuple(sorted(algo.advantage_hparams.items())))
  groups = rewards.reshape(-1, group_size)
  n = len(groups)
  padded = np.zeros((-(-n // GROUPS_PER_CALL) * GROUPS_PER_CALL, group_size), np.float32)
  padded[:n] = groups
  cpu = jax.local_devices(backend="cpu")[0]
  out = [fn(jax.device_put(padded[i:i + GROUPS_PER_CALL], cpu)) for i in range(0, len(padded), GROUPS_PER_CALL)]
  return np.concatenate(jax.device_get(out))[:n].reshape(-1).astype(np.float32)


class AdvantageStage:
  """Writes ``advantage`` into a StaleSync queue for every group whose samples all have their rewards."""

  def __init__(self, cfg, queue: DistQueue):
    if "advantage" not in queue.fields:
      raise ValueError("AdvantageStage: the queue has no 'advantage' field")
    self.cfg, self.queue, self.group_size = cfg, queue, cfg.rollout.group_size
    self.reward_model = "rm_score" in queue.fields

  def run(self) -> tuple[int, dict]:
    """Advantages of every complete, scored group not yet done -> (groups written, shaping metrics)."""
    ready = self.queue.ready(CONSUMER)
    if not len(ready):
      return 0, {}
    g = self.group_size
    group_ids = self.queue.peek(ready, ("group_id",))["group_id"]
    if np.any(ready // g != group_ids):
      raise RuntimeError("AdvantageStage: queue indices are not sample ids of their groups")
    groups, counts = np.unique(group_ids, return_counts=True)
    take = ready[np.isin(group_ids, groups[counts == g])]      # ascending: each group's samples in order
    if not len(take):
      return 0, {}
    batch = self.queue.read(CONSUMER, take, counted=False)
    rewards, metrics = shaped_rewards(self.cfg, batch["response_len"], batch["reward"])
    if self.reward_model:
      rewards = with_reward_model(self.cfg, rewards, batch["rm_score"])
    self.queue.write("advantage", take, advantages(self.cfg.algo, g, rewards), block=False)
    return len(take) // g, metrics

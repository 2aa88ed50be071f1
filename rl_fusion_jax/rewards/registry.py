"""Task name -> constructor, so a config selects a task with a string and keyword arguments.

Keyword arguments are checked against the constructor's signature before anything is built, so a typo
in a config fails at start with the field's name instead of a TypeError deep in the loop.
"""

from __future__ import annotations

import inspect
from typing import Any

from rl_fusion_jax.rewards.arithmetic import ArithmeticTask
from rl_fusion_jax.rewards.arithmetic_steps import ArithmeticStepsTask
from rl_fusion_jax.rewards.base import Task
from rl_fusion_jax.rewards.countdown import CountdownTask
from rl_fusion_jax.rewards.gsm8k import GSM8KTask
from rl_fusion_jax.rewards.word_problems import WordProblemsTask

__all__ = ["TASKS", "make_task"]

TASKS: dict[str, type] = {"arithmetic": ArithmeticTask, "arithmetic_steps": ArithmeticStepsTask,
                          "countdown": CountdownTask, "gsm8k": GSM8KTask,
                          "word_problems": WordProblemsTask}


def make_task(name: str, **kwargs: Any) -> Task:
  if name not in TASKS:
    raise ValueError(f"make_task: unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
  signature = inspect.signature(TASKS[name])
  accepted = list(signature.parameters)
  for key in kwargs:
    if key not in accepted:
      raise ValueError(f"make_task: task {name!r} has no argument {key!r}; it accepts: {', '.join(accepted)}")
  try:
    signature.bind(**kwargs)
  except TypeError as e:  # A required argument is missing, e.g. gsm8k's path.
    raise ValueError(f"make_task: task {name!r}: {e}") from e
  return TASKS[name](**kwargs)

"""Seeded procedural tasks with rule-based verifiers (arithmetic, arithmetic with worked steps,
countdown, GSM8K-format files, one-step word problems).

Tasks turn an index into a Problem and a (Problem, completion) pair into a Score. They are host-side
Python on text: nothing here calls a model or jax.
"""

from rl_fusion_jax.rewards.arithmetic import ArithmeticTask
from rl_fusion_jax.rewards.arithmetic_steps import ArithmeticStepsTask
from rl_fusion_jax.rewards.base import Problem, Score, Task, score_batch
from rl_fusion_jax.rewards.countdown import CountdownTask
from rl_fusion_jax.rewards.gsm8k import GSM8KTask
from rl_fusion_jax.rewards.registry import TASKS, make_task
from rl_fusion_jax.rewards.word_problems import WordProblemsTask

__all__ = [
    "ArithmeticStepsTask",
    "ArithmeticTask",
    "CountdownTask",
    "GSM8KTask",
    "Problem",
    "Score",
    "TASKS",
    "Task",
    "WordProblemsTask",
    "make_task",
    "score_batch",
]

"""One-step arithmetic word problems in English, answered as GSM8K answers are ("... #### 42").

The task a small pretrained chat model can learn on a CPU: a question of one sentence pair ("Mia has 17
stickers. She gets 25 more. How many stickers does Mia have now?") built from a template, an
operation (``+``, ``-`` or ``*``) and two numbers, followed by GSM8K's answer cue. Problems are a
deterministic function of (seed, index), so the held-out stream is another seed and no file is needed.

Scoring is GSM8K's (rewards/gsm8k.py): format ok iff the completion holds ``#### <number>``; correct iff
the first such number equals the answer. The supervised target is a worked line and the marker
(``17 + 25 = 42\\n#### 42``).
"""

from __future__ import annotations

import numpy as np

from rl_fusion_jax.rewards import base, gsm8k

__all__ = ["WordProblemsTask"]

_ALLOWED_OPS = "+-*"
_NAMES = (("Mia", "She"), ("Leo", "He"), ("Ava", "She"), ("Sam", "He"), ("Zoe", "She"), ("Ben", "He"),
          ("Ivy", "She"), ("Max", "He"), ("Lily", "She"), ("Noah", "He"))
_ITEMS = ("stickers", "apples", "marbles", "pencils", "cookies", "books", "coins", "stamps", "shells",
          "cards")
_CONTAINERS = (("boxes", "box"), ("bags", "bag"), ("packs", "pack"), ("jars", "jar"), ("baskets", "basket"))
# op -> question templates; {a} {b} are the operands in the order the operation takes them.
_TEMPLATES = {
    "+": ("{name} has {a} {items}. {pronoun} gets {b} more. How many {items} does {name} have now?",
          "There are {a} {items} on a table and {name} puts {b} more there. How many {items} are on the "
          "table now?"),
    "-": ("{name} has {a} {items}. {pronoun} gives {b} of them to a friend. How many {items} does {name} "
          "have left?",
          "A shop had {a} {items} and sold {b} of them. How many {items} does the shop have left?"),
    "*": ("{name} buys {a} {containers} of {items}. Each {container} holds {b} {items}. How many {items} does {name} "
          "buy in all?",
          "There are {a} {containers} with {b} {items} in each. How many {items} are there in all?"),
}


class WordProblemsTask:
  """``a op b`` as a word problem: ``+`` and ``-`` on numbers in [min_value, max_value] (a difference is
  never negative: the larger number comes first), ``*`` on a count in [2, max_factor] and a number in
  [2, max(2, max_value // max_factor)]; op drawn uniformly from ``ops``."""

  name = "word_problems"

  def __init__(self, seed: int = 0, ops: str = "+-*", min_value: int = 2, max_value: int = 99,
               max_factor: int = 9, format_reward: float = 0.1, correct_reward: float = 1.0):
    base.check_seed("WordProblemsTask", seed)
    base.check_reward_weights("WordProblemsTask", format_reward, correct_reward)
    if not isinstance(ops, str) or not ops or not set(ops) <= set(_ALLOWED_OPS):
      raise ValueError(f"WordProblemsTask: ops must be a non-empty subset of {_ALLOWED_OPS!r}, got {ops!r}")
    for field, value, low in (("min_value", min_value, 0), ("max_value", max_value, 2),
                              ("max_factor", max_factor, 2)):
      if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 10**6:
        raise ValueError(f"WordProblemsTask: {field} must be an int in [{low}, 10**6], got {value!r}")
    if min_value > max_value:
      raise ValueError(f"WordProblemsTask: min_value={min_value} must be <= max_value={max_value}")
    self.seed, self.ops = int(seed), "".join(dict.fromkeys(ops))
    self.min_value, self.max_value, self.max_factor = min_value, max_value, max_factor
    self.format_reward, self.correct_reward = float(format_reward), float(correct_reward)

  def problem(self, index: int) -> base.Problem:
    rng = np.random.default_rng([self.seed, base.check_index("WordProblemsTask", index)])
    op = self.ops[int(rng.integers(len(self.ops)))]
    if op == "*":
      a = int(rng.integers(2, self.max_factor + 1))
      b = int(rng.integers(2, max(2, self.max_value // self.max_factor) + 1))
    else:
      a, b = (int(x) for x in rng.integers(self.min_value, self.max_value + 1, size=2))
      if op == "-" and a < b:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    templates = _TEMPLATES[op]
    name, pronoun = _NAMES[int(rng.integers(len(_NAMES)))]
    containers, container = _CONTAINERS[int(rng.integers(len(_CONTAINERS)))]
    question = templates[int(rng.integers(len(templates)))].format(
        name=name, pronoun=pronoun, a=a, b=b, items=_ITEMS[int(rng.integers(len(_ITEMS)))],
        containers=containers, container=container)
    return base.Problem(prompt=question + gsm8k.ANSWER_CUE, answer=str(value),
                        target=f"{a} {op} {b} = {value}\n#### {value}", meta={"a": a, "b": b, "op": op})

  def score(self, problem: base.Problem, completion: str) -> base.Score:
    value = gsm8k.marked_number(completion)
    format_ok = value is not None
    correct = format_ok and value == int(problem.answer)
    return base.make_score(format_ok, correct, self.format_reward, self.correct_reward)

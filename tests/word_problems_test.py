"""The one-step word problems: answers recomputed from the question text, GSM8K-style scoring by hand."""
import re

import pytest

from rl_fusion_jax.rewards import WordProblemsTask, make_task
from rl_fusion_jax.rewards.gsm8k import ANSWER_CUE

# The operation each template's wording names, read off the text (not from the task's own metadata).
_ADD = ("more. How many", "puts")
_SUBTRACT = ("gives", "sold")
_MULTIPLY = ("Each", "in each")


def recompute(question: str) -> int:
  a, b = (int(x) for x in re.findall(r"[0-9]+", question))
  if any(w in question for w in _MULTIPLY):
    return a * b
  if any(w in question for w in _SUBTRACT):
    return a - b
  assert any(w in question for w in _ADD), question
  return a + b


def test_answers_follow_from_the_question_text():
  task = make_task("word_problems", seed=3)
  ops = set()
  for i in range(400):
    p = task.problem(i)
    assert p.prompt.endswith(ANSWER_CUE)
    assert int(p.answer) == recompute(p.prompt[:-len(ANSWER_CUE)]) >= 0
    assert p.target.endswith(f"\n#### {p.answer}")
    assert task.score(p, p.target).correct
    ops.add(p.meta["op"])
  assert ops == {"+", "-", "*"}


def test_problems_are_deterministic_in_seed_and_index():
  a, b = WordProblemsTask(seed=1), WordProblemsTask(seed=1)
  assert [a.problem(i) for i in (5, 0, 9)] == [b.problem(i) for i in (5, 0, 9)]
  assert [a.problem(i).prompt for i in range(20)] != [WordProblemsTask(seed=2).problem(i).prompt for i in range(20)]


def test_ranges():
  task = WordProblemsTask(ops="*", max_value=60, max_factor=6)
  for i in range(300):
    meta = task.problem(i).meta
    assert 2 <= meta["a"] <= 6 and 2 <= meta["b"] <= 10
  task = WordProblemsTask(ops="+", min_value=10, max_value=12)
  assert {task.problem(i).meta["a"] for i in range(200)} == {10, 11, 12}


@pytest.mark.parametrize("completion,format_ok,correct", [
    ("17 + 25 = 42\n#### 42", True, True),
    ("The answer is #### 42.", True, True),   # the number, not the full stop
    ("#### 42.0", True, True),
    ("#### 41\n#### 42", True, False),          # the first marker counts
    ("The answer is 42.", False, False),
    ("####", False, False),
    ("", False, False),
])
def test_scoring_by_hand(completion, format_ok, correct):
  task = WordProblemsTask(ops="+", min_value=17, max_value=17, format_reward=0.1, correct_reward=1.0)
  problem = task.problem(0)
  assert problem.answer == "34"
  problem = type(problem)(prompt=problem.prompt, answer="42", target="")
  score = task.score(problem, completion)
  assert (score.format_ok, score.correct) == (format_ok, correct)
  assert score.reward == pytest.approx(0.1 * format_ok + 1.0 * correct)


@pytest.mark.parametrize("kwargs,match", [
    ({"ops": "/"}, "ops"), ({"ops": ""}, "ops"), ({"max_value": 1}, "max_value"),
    ({"min_value": 50, "max_value": 20}, "min_value"), ({"max_factor": True}, "max_factor"),
    ({"seed": -1}, "seed"),
])
def test_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    WordProblemsTask(**kwargs)

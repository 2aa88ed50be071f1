"""Tests for rl_fusion_jax/rewards: generators recomputed independently, verifiers on hand-made cases."""

import collections
import fractions
import json
import pathlib
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_fusion_jax.testing
from rl_fusion_jax.rewards import (
    TASKS,
    ArithmeticStepsTask,
    ArithmeticTask,
    CountdownTask,
    GSM8KTask,
    Problem,
    Score,
    make_task,
    score_batch,
)
from rl_fusion_jax.rewards.base import pass_at_k

GSM8K_SAMPLE = pathlib.Path(rl_fusion_jax.testing.__file__).parent / "gsm8k_sample.jsonl"

# ----------------------------------------------------------------------------------------------------
# Arithmetic
# ----------------------------------------------------------------------------------------------------


def test_arithmetic_same_seed_index_same_problem_in_any_order():
  task, other = ArithmeticTask(seed=7), ArithmeticTask(seed=7)
  forward = [task.problem(i) for i in range(20)]
  backward = [other.problem(i) for i in reversed(range(20))][::-1]
  assert forward == backward
  assert task.problem(5) == forward[5]


def test_arithmetic_indices_and_seeds_give_different_problems():
  prompts = [ArithmeticTask(seed=0).problem(i).prompt for i in range(100)]
  assert len(set(prompts)) >= 80
  other_seed = [ArithmeticTask(seed=1).problem(i).prompt for i in range(100)]
  assert sum(a != b for a, b in zip(prompts, other_seed)) >= 80


@pytest.mark.parametrize("ops, min_digits, max_digits", [("+-", 1, 3), ("*", 2, 2), ("+-*", 1, 1)])
def test_arithmetic_answers_recomputed_from_prompt(ops, min_digits, max_digits):
  task = ArithmeticTask(seed=3, min_digits=min_digits, max_digits=max_digits, ops=ops)
  seen_ops = set()
  for i in range(200):
    p = task.problem(i)
    m = re.fullmatch(r"([0-9]+)([-+*])([0-9]+)=", p.prompt)
    assert m, p.prompt
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    for operand in (m.group(1), m.group(3)):
      assert min_digits <= len(operand) <= max_digits
      assert operand == str(int(operand))  # No leading zeros.
    expected = a + b if op == "+" else a - b if op == "-" else a * b
    assert p.answer == p.target == str(expected)
    seen_ops.add(op)
  assert seen_ops == set(ops)


PROBLEM_357 = Problem(prompt="12+345=", answer="357", target="357")


@pytest.mark.parametrize(
    "completion, reward, format_ok, correct",
    [
        ("357", 1.1, True, True),  # 0.1 * 1 + 1.0 * 1
        (" 357 \n", 1.1, True, True),  # stripped first
        ("0357", 1.1, True, True),  # numerically equal
        ("358", 0.1, True, False),  # 0.1 * 1 + 1.0 * 0
        ("-357", 0.1, True, False),
        ("35x", 0.0, False, False),
        ("3 57", 0.0, False, False),
        ("+357", 0.0, False, False),
        ("", 0.0, False, False),
        ("\u0663\u0665\u0667", 0.0, False, False),  # Arabic-Indic digits for 357 are not ASCII digits.
        ("1" * 5000, 0.1, True, False),  # Too long to be the answer; must not raise.
    ],
)
def test_arithmetic_score_by_hand(completion, reward, format_ok, correct):
  score = ArithmeticTask(seed=0).score(PROBLEM_357, completion)
  assert score == Score(reward=pytest.approx(reward), format_ok=format_ok, correct=correct)


def test_arithmetic_custom_weights():
  task = ArithmeticTask(seed=0, format_reward=0.5, correct_reward=2.0)
  assert task.score(PROBLEM_357, "357").reward == pytest.approx(2.5)  # 0.5 + 2.0
  assert task.score(PROBLEM_357, "1").reward == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"ops": "+/"}, "ops"),
        ({"ops": ""}, "ops"),
        ({"min_digits": 0}, "min_digits"),
        ({"min_digits": 3, "max_digits": 2}, "max_digits"),
        ({"seed": -1}, "seed"),
        ({"format_reward": float("nan")}, "format_reward"),
    ],
)
def test_arithmetic_bad_config_raises(kwargs, field):
  with pytest.raises(ValueError, match=field):
    ArithmeticTask(**kwargs)


def test_negative_index_raises():
  with pytest.raises(ValueError, match="index"):
    ArithmeticTask().problem(-1)


# ----------------------------------------------------------------------------------------------------
# Countdown
# ----------------------------------------------------------------------------------------------------


def _countdown_problem(numbers, target):
  return Problem(prompt="", answer=str(target), target="", meta={"numbers": numbers, "target": target})


P_3_5_7 = _countdown_problem((3, 5, 7), 22)


@pytest.mark.parametrize(
    "completion, reward, format_ok, correct",
    [
        ("3*5+7", 1.1, True, True),  # 15 + 7 = 22
        (" 7 + 5 * 3 ", 1.1, True, True),  # 7 + 15 = 22
        ("(7*(3+5)-34)", 0.0, False, False),  # 34 is not given
        ("7*3+5", 0.1, True, False),  # 21 + 5 = 26 != 22
        ("3*5+7+7", 0.0, False, False),  # 7 used twice
        ("3*5+3", 0.0, False, False),  # 3 twice, 7 missing
        ("3*5", 0.0, False, False),  # 7 missing
        ("3*5+7+1", 0.0, False, False),  # extra number
        ("3*5+7=22", 0.0, False, False),  # no "=" part
        ("-3+5*7-10", 0.0, False, False),  # unary minus and an extra number
        ("__import__('os')", 0.0, False, False),
        ("abs(3)*5+7", 0.0, False, False),  # call
        ("x*5+7", 0.0, False, False),  # name
        ("0x3*5+7", 0.0, False, False),  # hex literal reads as 3 in ast
        ("3.0*5+7", 0.0, False, False),
        ("True*3*5+7", 0.0, False, False),
        ("3*5+7)", 0.0, False, False),  # syntax error
        ("(" * 300 + "3*5+7" + ")" * 300, 0.0, False, False),  # too deep / too long
        ("", 0.0, False, False),
    ],
)
def test_countdown_score_by_hand(completion, reward, format_ok, correct):
  score = CountdownTask(seed=0).score(P_3_5_7, completion)
  assert score == Score(reward=pytest.approx(reward), format_ok=format_ok, correct=correct)


@pytest.mark.parametrize(
    "numbers, target, completion, format_ok, correct",
    [
        ((2, 3), 8, "2**3", False, False),  # power is not allowed even though 2**3 = 8
        ((7, 2), 3, "7//2", False, False),  # floor division is not allowed
        ((7, 2), 3, "7%2", False, False),
        ((2, 2, 7), 7, "7/(2-2)", True, False),  # division by zero: well formed, not correct
        ((2, 2, 7), 7, "7*(2/2)", True, True),  # 7 * 1 = 7
        ((6, 4, 3), 2, "6/4*3-(3-3)", False, False),  # 3 used three times
        ((6, 4, 5), 3, "6/4*5-4.5", False, False),
        ((6, 4, 1), 2, "6/4+1/2", False, False),  # 2 is not given
        ((6, 4, 2), 2, "(6/4)*(2-2/2)", False, False),
        ((6, 4, 2), 3, "6/4*2", True, True),  # (6/4) * 2 = 3 exactly with fractions
        ((4, 6, 2), 3, "4/(6/2)", True, False),  # 4 / 3 != 3
    ],
)
def test_countdown_special_cases(numbers, target, completion, format_ok, correct):
  score = CountdownTask(seed=0).score(_countdown_problem(numbers, target), completion)
  assert (score.format_ok, score.correct) == (format_ok, correct)


def _exact_value(expression: str) -> fractions.Fraction:
  """Independent reference: the expression is checked to be digits/operators, then run on Fractions."""
  assert re.fullmatch(r"[0-9+\-*/() ]+", expression), expression
  as_fractions = re.sub(r"[0-9]+", lambda m: f"Fraction({m.group(0)})", expression)
  return eval(as_fractions, {"__builtins__": {}, "Fraction": fractions.Fraction})  # noqa: S307


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    index=st.integers(0, 10**9),
    num_numbers=st.sampled_from([3, 4]),
    max_number=st.sampled_from([5, 10, 50]),
)
def test_countdown_generated_problems_are_solved_by_their_target(seed, index, num_numbers, max_number):
  task = CountdownTask(seed=seed, num_numbers=num_numbers, max_number=max_number)
  p = task.problem(index)
  m = re.fullmatch(r"((?:[0-9]+ )+)-> ([0-9]+):", p.prompt)
  assert m, p.prompt
  prompt_numbers = [int(x) for x in m.group(1).split()]
  assert len(prompt_numbers) == num_numbers
  assert all(1 <= n <= max_number for n in prompt_numbers)
  assert list(p.meta["numbers"]) == prompt_numbers
  assert int(m.group(2)) == p.meta["target"] == int(p.answer) > 0
  used = [int(x) for x in re.findall(r"[0-9]+", p.target)]
  assert collections.Counter(used) == collections.Counter(prompt_numbers)
  assert _exact_value(p.target) == p.meta["target"]
  assert task.score(p, p.target) == Score(reward=pytest.approx(1.1), format_ok=True, correct=True)
  assert task.problem(index) == p


def test_countdown_deterministic_and_varied():
  prompts = [CountdownTask(seed=4).problem(i).prompt for i in range(50)]
  assert prompts == [CountdownTask(seed=4).problem(i).prompt for i in range(50)]
  assert len(set(prompts)) >= 40


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_numbers": 1}, "num_numbers"),
        ({"min_number": 0}, "min_number"),
        ({"min_number": 5, "max_number": 4}, "max_number"),
        ({"correct_reward": "1"}, "correct_reward"),
    ],
)
def test_countdown_bad_config_raises(kwargs, field):
  with pytest.raises(ValueError, match=field):
    CountdownTask(**kwargs)


def test_countdown_score_without_meta_raises():
  with pytest.raises(ValueError, match="'numbers'"):
    CountdownTask().score(PROBLEM_357, "3+5")


# ----------------------------------------------------------------------------------------------------
# GSM8K
# ----------------------------------------------------------------------------------------------------


def test_gsm8k_fixture_loads_and_answers_parse():
  task = GSM8KTask(GSM8K_SAMPLE)
  assert len(task) == 10
  # Hand-read from the fixture, "1,236" and "1,500" without commas, a negative and a decimal.
  assert [r["number"] for r in task.records] == [
      "12",
      "210",
      "1236",
      "14",
      "270",
      "160",
      "-7",
      "6",
      "1500",
      "2.5",
  ]


def test_gsm8k_problem_cycles_through_seeded_permutations():
  task = GSM8KTask(GSM8K_SAMPLE, seed=1)
  epoch0 = [task.problem(i) for i in range(10)]
  epoch1 = [task.problem(i) for i in range(10, 20)]
  lines = list(range(1, 11))
  assert sorted(p.meta["line"] for p in epoch0) == lines
  assert sorted(p.meta["line"] for p in epoch1) == lines
  assert epoch0 == [GSM8KTask(GSM8K_SAMPLE, seed=1).problem(i) for i in range(10)]
  assert task.problem(3) == epoch0[3]  # Going back an epoch gives the same problem.
  other = [GSM8KTask(GSM8K_SAMPLE, seed=2).problem(i).meta["line"] for i in range(10)]
  assert other != [p.meta["line"] for p in epoch0]  # 1 / 10! chance of a false failure.


def test_gsm8k_problem_fields():
  task = GSM8KTask(GSM8K_SAMPLE)
  rows = [json.loads(line) for line in GSM8K_SAMPLE.read_text().splitlines()]
  for i in range(10):
    p = task.problem(i)
    row = rows[p.meta["line"] - 1]
    assert p.prompt.startswith(row["question"])
    assert p.prompt.endswith("'#### <number>'.\n")
    assert p.target == row["answer"]
    assert task.score(p, p.target).correct


GSM_1236 = Problem(prompt="q", answer="1236", target="... #### 1,236")


@pytest.mark.parametrize(
    "completion, reward, format_ok, correct",
    [
        ("12*103=1236\n#### 1,236", 1.1, True, True),
        ("#### 1236", 1.1, True, True),
        ("####1236.0", 1.1, True, True),  # 1236.0 == 1236 numerically
        ("#### $1,236 pencils", 1.1, True, True),
        ("#### 1237", 0.1, True, False),
        ("#### -1236", 0.1, True, False),
        ("#### 12\n#### 1236", 0.1, True, False),  # the first marker counts
        ("The answer is 1236", 0.0, False, False),  # strict: no fallback to the last number
        ("#### twelve", 0.0, False, False),
        ("", 0.0, False, False),
    ],
)
def test_gsm8k_score_by_hand(completion, reward, format_ok, correct):
  score = GSM8KTask(GSM8K_SAMPLE).score(GSM_1236, completion)
  assert score == Score(reward=pytest.approx(reward), format_ok=format_ok, correct=correct)


def test_gsm8k_decimal_answer():
  task = GSM8KTask(GSM8K_SAMPLE)
  p = Problem(prompt="q", answer="2.5", target="")
  assert task.score(p, "#### 2.50").correct
  assert not task.score(p, "#### 2").correct


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"question": "q", "answer": "#### 1"}', "{oops"], ":2: not valid JSON"),
        (['["q", "a"]'], ":1: expected a JSON object"),
        (['{"answer": "#### 1"}'], ":1: missing string field 'question'"),
        (
            ['{"question": "q", "answer": "#### 1"}', "", '{"question": "q"}'],
            ":3: missing string field 'answer'",
        ),
        (['{"question": "q", "answer": 5}'], ":1: missing string field 'answer'"),
        (['{"question": "q", "answer": "it is 4"}'], ":1: field 'answer' has no '####'"),
        (['{"question": "q", "answer": "#### four"}'], ":1: text after '####' is not a number"),
        ([], "holds no problems"),
    ],
)
def test_gsm8k_malformed_file_errors_name_path_and_line(tmp_path, lines, message):
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(message)):
    GSM8KTask(path)


def test_gsm8k_missing_path_raises(tmp_path):
  with pytest.raises(ValueError, match=re.escape(str(tmp_path / "none.jsonl"))):
    GSM8KTask(tmp_path / "none.jsonl")


# ----------------------------------------------------------------------------------------------------
# Registry and batch scoring
# ----------------------------------------------------------------------------------------------------


def test_registry_builds_tasks():
  assert set(TASKS) == {"arithmetic", "arithmetic_steps", "countdown", "gsm8k", "word_problems"}
  task = make_task("arithmetic", seed=3, ops="*")
  assert isinstance(task, ArithmeticTask) and task.ops == "*" and task.name == "arithmetic"
  assert isinstance(make_task("countdown", num_numbers=4), CountdownTask)
  assert len(make_task("gsm8k", path=GSM8K_SAMPLE)) == 10
  assert make_task("word_problems", ops="-").problem(0).meta["op"] == "-"


def test_registry_unknown_name_lists_known():
  with pytest.raises(ValueError, match="'chess'.*arithmetic, arithmetic_steps, countdown, gsm8k, word_problems"):
    make_task("chess")


def test_registry_unknown_and_missing_kwargs():
  with pytest.raises(ValueError, match="no argument 'digits'"):
    make_task("arithmetic", digits=3)
  with pytest.raises(ValueError, match="'path'"):
    make_task("gsm8k", seed=1)


def test_score_batch_by_hand():
  problems = [PROBLEM_357] * 3
  rewards_b, format_ok_b, correct_b = score_batch(ArithmeticTask(), problems, ["357", "358", "x"])
  assert rewards_b.dtype == np.float32 and format_ok_b.dtype == bool and correct_b.dtype == bool
  np.testing.assert_allclose(rewards_b, [1.1, 0.1, 0.0], rtol=1e-6)  # 0.1+1.0, 0.1, 0
  np.testing.assert_array_equal(format_ok_b, [True, True, False])
  np.testing.assert_array_equal(correct_b, [True, False, False])
  with pytest.raises(ValueError, match="3 problems but 2 completions"):
    score_batch(ArithmeticTask(), problems, ["1", "2"])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 1000),
    num_numbers=st.integers(2, 4),
    max_number=st.sampled_from([3, 9, 10, 25, 100]),
)
def test_countdown_max_lengths_bound_every_problem(seed, num_numbers, max_number):
  task = CountdownTask(seed=seed, num_numbers=num_numbers, max_number=max_number)
  prompt_bound, target_bound = task.max_lengths()
  problems = [task.problem(i) for i in range(300)]
  assert max(len(p.prompt) for p in problems) <= prompt_bound
  assert max(len(p.target) for p in problems) <= target_bound
  # The value bound behind it: targets never exceed (max_number + 1) ** num_numbers - 1.
  assert max(int(p.answer) for p in problems) <= (max_number + 1) ** num_numbers - 1


@pytest.mark.parametrize("max_digits,ops,expected", [
    (1, "+", (4, 2)),      # "9+9=" -> "18"
    (2, "+-", (6, 3)),     # "99-99=" ; "-99" or "198"
    (3, "*", (8, 6)),      # "999*999=" -> "998001"
])
def test_arithmetic_max_lengths_by_hand(max_digits, ops, expected):
  task = ArithmeticTask(seed=0, min_digits=1, max_digits=max_digits, ops=ops)
  assert task.max_lengths() == expected
  problems = [task.problem(i) for i in range(3000)]
  assert max(len(p.prompt) for p in problems) <= expected[0]
  assert max(len(p.target) for p in problems) <= expected[1]


# ----------------------------------------------------------------------------------------------------
# pass@k
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,c,k,expected", [
    (8, 0, 1, 0.0),      # no correct sample: 1 - C(8,1)/C(8,1) = 0
    (8, 0, 5, 0.0),
    (8, 8, 1, 1.0),      # all correct: C(0,1) = 0 -> 1
    (8, 8, 8, 1.0),
    (8, 3, 1, 3 / 8),    # k = 1: the fraction correct, 1 - C(5,1)/C(8,1) = 1 - 5/8
    (4, 1, 2, 0.5),      # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),      # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 3, 3, 1.0),      # n - c = 2 < k = 3: every 3-subset holds a correct sample
])
def test_pass_at_k_by_hand(n, c, k, expected):
  value = pass_at_k(n, c, k)
  assert isinstance(value, float)
  assert value == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_vectorized_over_problems():
  # n = 5, k = 3, counts [0, 2, 3, 5] -> [0, 0.9, 1, 1] (hand values above); shape follows num_correct.
  values = pass_at_k(5, np.array([0, 2, 3, 5]), 3)
  assert isinstance(values, np.ndarray) and values.shape == (4,)
  np.testing.assert_allclose(values, [0.0, 0.9, 1.0, 1.0], atol=1e-12)
  np.testing.assert_allclose(pass_at_k(4, [[1, 0], [4, 2]], 2), [[0.5, 0.0], [1.0, 1 - 1 / 6]], atol=1e-12)
  # c = 2 of n = 4, k = 2: 1 - C(2,2)/C(4,2) = 1 - 1/6 (the last entry above).


def test_pass_at_k_large_n_is_finite():
  # n = 1000, k = 500: the binomials are ~1e299, and the certain rows (n - c < k) must not become NaN.
  # c = 1: 1 - C(999,500)/C(1000,500) = 1 - (1000 - 500)/1000 = 0.5.
  values = pass_at_k(1000, np.array([0, 1, 999, 1000]), 500)
  np.testing.assert_allclose(values, [0.0, 0.5, 1.0, 1.0], atol=1e-12)


@pytest.mark.parametrize("n,c,k,name", [
    (8, 3, 9, "k"),
    (8, 3, 0, "k"),
    (8, 3, 1.0, "k"),
    (0, 0, 1, "num_samples"),
    (8, 9, 1, "num_correct"),
    (8, -1, 1, "num_correct"),
    (8, [3, 9], 2, "num_correct"),
    (8, 2.5, 1, "num_correct"),
])
def test_pass_at_k_bad_arguments_raise(n, c, k, name):
  with pytest.raises(ValueError, match=name):
    pass_at_k(n, c, k)


# ----------------------------------------------------------------------------------------------------
# Arithmetic with worked steps


def _evaluate_left_to_right(prompt: str) -> list[int]:
  """The running results of a '3+5-2=' prompt, parsed independently of the task's generator."""
  tokens = re.findall(r"[+-]|[0-9]", prompt.rstrip("="))
  value, out = int(tokens[0]), []
  for op, digit in zip(tokens[1::2], tokens[2::2]):
    value = value + int(digit) if op == "+" else value - int(digit)
    out.append(value)
  return out


def test_arithmetic_steps_targets_recomputed_from_prompt_and_lengths_have_a_tail():
  task = ArithmeticStepsTask(seed=5)
  problems = [task.problem(i) for i in range(3000)]
  for p in problems[:500]:
    running = _evaluate_left_to_right(p.prompt)
    assert p.target == ",".join(map(str, running)) and p.answer == str(running[-1])
    assert len(running) == p.meta["terms"] - 1 and 2 <= p.meta["terms"] <= 12
    assert task.score(p, p.target) == Score(1.1, True, True)
  terms = collections.Counter(p.meta["terms"] for p in problems)
  # min_terms 2 + a geometric draw of mean 2 (P(extra = k) = (1/3)(2/3)^k), capped at 12: a third of the
  # problems have 2 operands, (2/3)^10 = 1.7% reach the cap.
  assert abs(terms[2] / 3000 - 1 / 3) < 0.03 and abs(terms[12] / 3000 - (2 / 3) ** 10) < 0.01
  prompt_max, target_max = task.max_lengths()
  assert all(len(p.prompt) <= prompt_max and len(p.target) <= target_max for p in problems)
  assert task.problem(7) == ArithmeticStepsTask(seed=5).problem(7) != ArithmeticStepsTask(seed=6).problem(7)


@pytest.mark.parametrize("completion,format_ok,correct", [
    ("8,6,13", True, True),
    (" 8,6,13 ", True, True),
    ("7,7,13", True, True),      # only the final answer is checked
    ("8,6,12", True, False),
    ("13", False, False),        # the answer without the worked steps
    ("8,6,1,13", False, False),  # one step too many
    ("8,,13", False, False),
    ("8;6;13", False, False),
    ("", False, False),
])
def test_arithmetic_steps_score_by_hand(completion, format_ok, correct):
  problem = Problem(prompt="3+5-2+7=", answer="13", target="8,6,13", meta={"terms": 4})
  score = ArithmeticStepsTask().score(problem, completion)
  assert (score.format_ok, score.correct) == (format_ok, correct)
  assert score.reward == pytest.approx(0.1 * format_ok + 1.0 * correct)


@pytest.mark.parametrize("kwargs,field", [({"min_terms": 1}, "min_terms"), ({"max_terms": 1}, "max_terms"),
                                          ({"tail": -1.0}, "tail"), ({"seed": -1}, "seed")])
def test_arithmetic_steps_bad_config_raises(kwargs, field):
  with pytest.raises(ValueError, match=field):
    ArithmeticStepsTask(**kwargs)

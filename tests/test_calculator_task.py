"""Tests for the calculator word-problem example task."""

from __future__ import annotations

import ast
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flywheel.examples.calculator import (
    CALCULATOR_TOOL,
    LEVELS,
    SYSTEM_PROMPT,
    Problem,
    calculator,
    demonstration,
    extract_answer,
    generate_problems,
    reward,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _binary_ops(expression: str) -> list[ast.operator]:
    tree = ast.parse(expression, mode="eval")
    return [node.op for node in ast.walk(tree) if isinstance(node, ast.BinOp)]


def _numbers(expression: str) -> list[int]:
    tree = ast.parse(expression, mode="eval")
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]


# --------------------------------------------------------------------------- #
# Problem generation
# --------------------------------------------------------------------------- #


def test_same_arguments_give_same_problems() -> None:
    first = generate_problems("train", 50, levels=LEVELS, seed=3)
    second = generate_problems("train", 50, levels=LEVELS, seed=3)
    assert first == second


def test_generation_does_not_depend_on_hash_randomisation() -> None:
    # Python salts str hashes per process; the problems must not change with it.
    code = (
        "from flywheel.examples.calculator import generate_problems; "
        "print([p.id for p in generate_problems('val', 20, levels=(1, 2, 3, 4), seed=5)])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for hash_seed in ("1", "2")
    }
    expected = [p.id for p in generate_problems("val", 20, levels=(1, 2, 3, 4), seed=5)]
    assert outputs == {f"{expected}\n"}


def test_different_seed_gives_different_problems() -> None:
    first = {p.question for p in generate_problems("train", 50, seed=0)}
    second = {p.question for p in generate_problems("train", 50, seed=1)}
    assert len(first & second) < 5


def test_splits_are_disjoint() -> None:
    questions: dict[str, set[str]] = {}
    for split in ("train", "val", "test"):
        problems = [p for seed in (0, 1) for p in generate_problems(split, 300, levels=LEVELS, seed=seed)]
        assert all(p.split == split for p in problems)
        questions[split] = {p.question for p in problems}
    assert not questions["train"] & questions["val"]
    assert not questions["train"] & questions["test"]
    assert not questions["val"] & questions["test"]


def test_problems_are_distinct_and_cycle_through_levels() -> None:
    problems = generate_problems("test", 120, levels=(2, 4), seed=7)
    assert len(problems) == 120
    assert len({p.question for p in problems}) == 120
    assert len({p.id for p in problems}) == 120
    assert [p.level for p in problems] == [2, 4] * 60


def test_answers_are_integers_that_the_calculator_reproduces() -> None:
    for problem in generate_problems("train", 400, levels=LEVELS, seed=11):
        assert isinstance(problem.answer, int)
        assert problem.answer > 0
        assert calculator(problem.expression) == str(problem.answer)


@pytest.mark.parametrize(("level", "op_count"), [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_each_level_has_its_operation_count(level: int, op_count: int) -> None:
    for problem in generate_problems("train", 100, levels=(level,), seed=2):
        assert problem.level == level
        assert len(_binary_ops(problem.expression)) == op_count, problem.expression


def test_level_contents() -> None:
    expressions = {level: [p.expression for p in generate_problems("train", 200, levels=(level,))] for level in LEVELS}
    ops = {level: [op for e in expressions[level] for op in _binary_ops(e)] for level in LEVELS}
    numbers = {level: [x for e in expressions[level] for x in _numbers(e)] for level in LEVELS}
    # Level 1 is addition and subtraction with numbers of one or two digits.
    assert {type(op) for op in ops[1]} == {ast.Add, ast.Sub}
    assert max(numbers[1]) <= 99
    # Level 2 adds multiplication and uses two- and three-digit numbers.
    assert {type(op) for op in ops[2]} == {ast.Add, ast.Sub, ast.Mult}
    assert min(numbers[2]) >= 10 and max(numbers[2]) >= 100
    # Only level 4 divides.
    assert all(not isinstance(op, ast.Div) for level in (1, 2, 3) for op in ops[level])
    assert all(any(isinstance(op, ast.Div) for op in _binary_ops(e)) for e in expressions[4])


def test_questions_mention_the_numbers_of_the_expression() -> None:
    for problem in generate_problems("val", 100, levels=LEVELS):
        for number in _numbers(problem.expression):
            assert str(number) in problem.question, (problem.question, problem.expression)


def test_templates_are_varied() -> None:
    # The stories differ in more than numbers and names, so the model must read them.
    openings = {" ".join(p.question.split()[2:5]) for p in generate_problems("train", 200, levels=LEVELS)}
    assert len(openings) >= 20


@pytest.mark.parametrize(
    "kwargs",
    [
        {"split": "dev", "n": 3},
        {"split": "train", "n": -1},
        {"split": "train", "n": 3, "levels": ()},
        {"split": "train", "n": 3, "levels": (1, 5)},
    ],
)
def test_invalid_generation_arguments_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        generate_problems(**kwargs)


# --------------------------------------------------------------------------- #
# Calculator
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 3", "5"),
        ("(12 + 7) * 3", "57"),
        ("  6*7  ", "42"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("10 - 4 - 3", "3"),
        ("100 / 10 / 5", "2"),
        ("84 / 2", "42"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.3333333333"),
        ("2 / 3 * 3", "2"),
        ("0.1 + 0.2", "0.3"),
        ("2.5 * 4", "10"),
        ("1.5 + 1.25", "2.75"),
        ("2 ^ 10", "1024"),
        ("2 ** 10", "1024"),
        ("2 ^ 3 ^ 2", "512"),
        ("2 ^ -1", "0.5"),
        ("4 ^ 0.5", "2"),
        ("-3 + 5", "2"),
        ("-(2 + 3)", "-5"),
        ("--4", "4"),
        ("+4", "4"),
        ("3 * -2", "-6"),
        ("-2 ^ 2", "-4"),
        ("(-2) ^ 2", "4"),
        ("123456789 * 987654321", "121932631112635269"),
        ("1e3 + 1", "1001"),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, expected: str) -> None:
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os')", "Call"),
        ("__import__('os').system('ls')", "Call"),
        ("os", "name 'os'"),
        ("x + 1", "name 'x'"),
        ("(1).real", "Attribute"),
        ("().__class__", "Attribute"),
        ("[1, 2]", "List"),
        ("'a' * 3", "str"),
        ("True + 1", "bool"),
        ("2j", "complex"),
        ("lambda: 1", "Lambda"),
        ("1 if 1 else 2", "IfExp"),
        ("1 < 2", "Compare"),
        ("7 % 2", "Mod"),
        ("7 // 2", "FloorDiv"),
        ("1,000 + 5", "separators"),
        ("9**9**9", "too large"),
        ("9^9^9", "too large"),
        ("2 ** 100000", "too large"),
        ("10 ** 101", "too large"),
        ("10 ** 99 * 10 ** 99", "too large"),
        ("1e400", "too large"),
        ("1.5 ** 999", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1/0", "division by zero"),
        ("1.5 / (2 - 2)", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("", "empty"),
        ("   ", "empty"),
        ("1 +", "parse"),
        ("(1 + 2", "parse"),
        ("1\x00", ""),
        ("1 + " * 5000 + "1", "too long"),
        ("(" * 400 + "1" + ")" * 400, ""),
        ("-" * 999 + "1", ""),
    ],
)
def test_calculator_rejects_bad_input_quickly(expression: str, reason: str) -> None:
    start = time.perf_counter()
    result = calculator(expression)
    assert time.perf_counter() - start < 1.0
    assert result.startswith("Error:"), result
    assert reason in result


@pytest.mark.parametrize("value", [None, 42, ["1 + 1"]])
def test_calculator_rejects_non_strings(value: object) -> None:
    assert calculator(value).startswith("Error:")  # type: ignore[arg-type]


def test_calculator_never_raises_on_random_input() -> None:
    rng = random.Random(0)
    alphabet = "0123456789+-*/^().e ,x_'"
    for _ in range(3000):
        expression = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert isinstance(calculator(expression), str)


def test_calculator_tool_schema() -> None:
    assert CALCULATOR_TOOL["type"] == "function"
    function = CALCULATOR_TOOL["function"]
    assert function["name"] == "calculator"
    assert function["description"]
    parameters = function["parameters"]
    assert parameters["type"] == "object"
    assert parameters["properties"]["expression"]["type"] == "string"
    assert parameters["required"] == ["expression"]
    assert json.loads(json.dumps(CALCULATOR_TOOL)) == CALCULATOR_TOOL


def test_system_prompt_names_tool_and_answer_format() -> None:
    assert "calculator" in SYSTEM_PROMPT
    assert "Answer: <number>" in SYSTEM_PROMPT


# --------------------------------------------------------------------------- #
# Answer extraction and reward
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 42", 42.0),
        ("answer: 42", 42.0),
        ("Answer:42", 42.0),
        ("Answer: 42.", 42.0),
        ("Answer:   -7", -7.0),
        ("Answer: 3.5", 3.5),
        ("Answer: 1,234", 1234.0),
        ("Answer: $56", 56.0),
        ("Answer: -$5", -5.0),
        ("Answer: $-5", -5.0),
        ("Answer: 12 apples", 12.0),
        ("**Answer:** 9", 9.0),
        ("The total is 5.\nAnswer: $1,000.50.", 1000.5),
        ("Answer: 1\nLet me check again.\nAnswer: 2", 2.0),
        ("Answer: 7\nAnswer: I am not sure", None),
        ("Answer: unknown", None),
        ("The answer is 42", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: float | None) -> None:
    assert extract_answer(text) == expected


def _problem(answer: int | float) -> Problem:
    return Problem(id="p", question="q", expression=str(answer), answer=answer, level=1, split="test")


def test_reward_for_integer_answers_is_exact() -> None:
    problem = _problem(1234)
    assert reward(problem, "1000 + 234 = 1234\nAnswer: 1,234") == 1.0
    assert reward(problem, "Answer: 1234.0") == 1.0
    assert reward(problem, "Answer: 1234.000001") == 0.0
    assert reward(problem, "Answer: 1235") == 0.0
    assert reward(problem, "It is 1234.") == 0.0
    assert reward(problem, "") == 0.0


def test_reward_for_float_answers_has_relative_tolerance() -> None:
    problem = _problem(2.5)
    assert reward(problem, "Answer: 2.5") == 1.0
    assert reward(problem, "Answer: 2.500001") == 1.0
    assert reward(problem, "Answer: 2.51") == 0.0


# --------------------------------------------------------------------------- #
# Demonstrations
# --------------------------------------------------------------------------- #


def test_demonstration_is_a_valid_tool_calling_conversation() -> None:
    for problem in generate_problems("train", 40, levels=LEVELS, seed=4):
        messages = demonstration(problem)
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        system, user, call, tool, final = messages
        assert system["content"] == SYSTEM_PROMPT
        assert user["content"] == problem.question

        (tool_call,) = call["tool_calls"]
        assert tool_call["type"] == "function"
        assert tool_call["function"]["name"] == CALCULATOR_TOOL["function"]["name"]
        assert json.loads(tool_call["function"]["arguments"]) == {"expression": problem.expression}
        assert tool["tool_call_id"] == tool_call["id"] == "call_0"
        assert tool["content"] == str(problem.answer)

        assert final["content"] == f"Answer: {problem.answer}"
        assert "tool_calls" not in final
        assert reward(problem, final["content"]) == 1.0
        json.dumps(messages)  # must be serialisable for an OpenAI-compatible API

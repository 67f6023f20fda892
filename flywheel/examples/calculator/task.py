"""Arithmetic word problems solved with a calculator tool (a Calc-X-style task).

The task has everything an agent loop and an RL trainer need:

* ``generate_problems`` makes deterministic, split-disjoint word problems at four
  difficulty levels;
* ``calculator`` and ``CALCULATOR_TOOL`` are the tool and its OpenAI-format schema;
* ``SYSTEM_PROMPT`` tells the model how to use the tool and format its answer;
* ``reward`` scores a final reply against the exact answer (a verifiable reward);
* ``demonstration`` builds a gold tool-calling conversation for an SFT warm start.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Split = Literal["train", "val", "test"]
Number = int | float


class Problem(BaseModel):
    """One word problem with its solving expression and exact answer."""

    model_config = ConfigDict(frozen=True)

    id: str
    question: str
    expression: str
    answer: int | float
    level: int = Field(ge=1, le=4)
    split: str


# --------------------------------------------------------------------------- #
# Calculator tool
# --------------------------------------------------------------------------- #

# Limits keep one tool call cheap: a model (or an attacker) can write an
# expression like 9**9**9 whose exact value would take minutes and gigabytes.
MAX_EXPRESSION_LENGTH = 1000
MAX_EXPONENT = 1000
MAX_MAGNITUDE = 10**100

_ALLOWED = "only numbers, + - * / ^ and parentheses are allowed"


class _CalculatorError(Exception):
    """A problem with the expression, worded for the model that wrote it."""


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression; return the result or an ``Error: ...`` string.

    Supports ``+ - * /``, parentheses, unary minus, decimals and powers written as
    ``^`` or ``**``. The expression is parsed with :mod:`ast` and only arithmetic
    nodes are evaluated, so names, calls and attributes can never run. It never
    raises: the model reads the error text and can correct its call.
    """
    if not isinstance(expression, str):  # tool arguments come from model-written JSON
        return "Error: the expression must be a string"
    text = expression.strip()
    if not text:
        return "Error: empty expression"
    if len(text) > MAX_EXPRESSION_LENGTH:
        return f"Error: expression is too long ({len(text)} characters, limit {MAX_EXPRESSION_LENGTH})"
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval")
        return _format_number(_evaluate(tree))
    except _CalculatorError as err:
        return f"Error: {err}"
    except SyntaxError as err:
        return f"Error: could not parse the expression ({err.msg}); {_ALLOWED}"
    except ValueError:  # older Python versions raise this for a NUL byte in the source
        return f"Error: invalid characters; {_ALLOWED}"
    except ZeroDivisionError:
        return "Error: division by zero"
    except OverflowError:  # float results beyond the float range
        return "Error: result is too large"
    except (RecursionError, MemoryError):
        return "Error: expression is nested too deeply"


def _evaluate(node: ast.AST) -> Number:
    """Evaluate an arithmetic syntax tree, rejecting every other kind of node."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        # bool is a subclass of int, but "True + 1" is not arithmetic.
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise _CalculatorError(f"unsupported value of type {type(node.value).__name__}; {_ALLOWED}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        operand = _evaluate(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        return _checked(_apply(node.op, _evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.Name):
        raise _CalculatorError(f"unknown name '{node.id}'; {_ALLOWED}")
    if isinstance(node, ast.Tuple):
        raise _CalculatorError("unexpected ','; write numbers without thousands separators")
    raise _CalculatorError(f"unsupported syntax ({type(node).__name__}); {_ALLOWED}")


def _apply(op: ast.operator, left: Number, right: Number) -> Number:
    """Apply one binary operator; exact integer division stays an int."""
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if isinstance(op, ast.Div):
        if isinstance(left, int) and isinstance(right, int) and left % right == 0:
            return left // right
        return left / right
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise _CalculatorError(f"exponent is too large (limit {MAX_EXPONENT})")
        result = left**right
        if isinstance(result, complex):  # e.g. (-8) ** 0.5
            raise _CalculatorError("result is not a real number")
        return result
    raise _CalculatorError(f"unsupported operator ({type(op).__name__}); {_ALLOWED}")


def _checked(value: Number) -> Number:
    """Reject values too large to be useful, so later steps stay cheap."""
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
        raise _CalculatorError("result is too large (limit 1e100)")
    return value


def _format_number(value: Number) -> str:
    """Integers print exactly and without ".0"; other floats get 10 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 2**53:  # below 2**53 a float integer is exact
        return str(int(value))
    return f"{value:.10g}"


CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluate an arithmetic expression and return its value. "
            "Supports + - * / ^ (power), parentheses and decimals, e.g. '(12 + 7) * 3'."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The arithmetic expression to evaluate, using numbers only.",
                }
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}

SYSTEM_PROMPT = (
    "You solve arithmetic word problems. Write the arithmetic expression that answers "
    "the question and evaluate it with the calculator tool instead of calculating in "
    "your head. When you have the result, finish with the final answer on its own line:\n"
    "Answer: <number>"
)


# --------------------------------------------------------------------------- #
# Answer checking
# --------------------------------------------------------------------------- #

# What may follow "Answer:": markdown bold, a sign and a dollar sign in either
# order, then a number with optional thousands separators and decimals.
_ANSWER_NUMBER = re.compile(r"[\s*]*(-?)\s*\$?\s*(-?)\s*(\d[\d,]*(?:\.\d+)?|\.\d+)")


def extract_answer(text: str) -> float | None:
    """Return the number after the last "Answer:" in ``text``, or None if there is none."""
    start = text.lower().rfind("answer:")
    if start < 0:
        return None
    match = _ANSWER_NUMBER.match(text, start + len("answer:"))
    if match is None:
        return None
    sign_before_dollar, sign_after_dollar, digits = match.groups()
    value = float(digits.replace(",", ""))
    return -value if sign_before_dollar or sign_after_dollar else value


def answer_is(expected: int | float, final_text: str) -> bool:
    """Whether the reply's final answer (``extract_answer``) is ``expected``: exact for integers, else within 1e-6."""
    predicted = extract_answer(final_text)
    if predicted is None:
        return False
    if isinstance(expected, int):
        return predicted == expected
    return math.isclose(predicted, expected, rel_tol=1e-6)


def reward(problem: Problem, final_text: str) -> float:
    """1.0 if the reply's final answer is right (exact for integers), else 0.0."""
    return 1.0 if answer_is(problem.answer, final_text) else 0.0


def demonstration(problem: Problem) -> list[dict[str, Any]]:
    """A gold conversation (OpenAI chat format) that solves ``problem`` with one tool call.

    One call with the full expression, even for multi-step problems, is the
    simplest behaviour for a small model to imitate before RL refines it.
    """
    call_id = "call_0"
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": problem.question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": "calculator",
                        "arguments": json.dumps({"expression": problem.expression}),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": calculator(problem.expression)},
        {"role": "assistant", "content": f"Answer: {_format_number(problem.answer)}"},
    ]


# --------------------------------------------------------------------------- #
# Problem generation
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _Shape:
    """An expression pattern with number ranges and the stories that can tell it."""

    expression: str  # str.format pattern over number slots, e.g. "{a} * {b} + {c}"
    ranges: Mapping[str, tuple[int, int]]  # inclusive bounds for each number slot
    templates: tuple[str, ...]  # question texts; may also use {name} and {other}


_NAMES = ("Tom", "Ana", "Priya", "Li", "Omar", "Sara", "Ben", "Maya", "Kofi", "Elena", "Diego", "Yuki")

_ADD_STORIES = (
    "{name} has {a} apples and buys {b} more. How many apples does {name} have now?",
    "A bus has {a} passengers on board. At the next stop {b} more people get on and nobody "
    "gets off. How many passengers are on the bus now?",
    "{name} walked {a} km on Monday and {b} km on Tuesday. How many kilometres did {name} walk in total?",
    "There are {a} boxes in the storeroom and {b} boxes in the hallway. How many boxes are there altogether?",
    "{name} scored {a} points in the first game and {b} points in the second game. "
    "How many points did {name} score in total?",
)

_SUB_STORIES = (
    "{name} had {a} dollars and spent {b} dollars on lunch. How many dollars does {name} have left?",
    "A shelf holds {a} books. {name} takes {b} of them away. How many books are left on the shelf?",
    "A road trip is {a} miles long. {name} has already driven {b} miles. How many miles are left to drive?",
    "A school has {a} students, and {b} of them are absent today. How many students are present?",
    "{name} is {a} years old. {other} is {b} years younger than {name}. How old is {other}?",
)

_MUL_STORIES = (
    "Each box holds {b} pencils. How many pencils are there in {a} boxes?",
    "A concert ticket costs {b} dollars. How many dollars do {a} tickets cost?",
    "A train travels {b} km every hour. How many kilometres does it travel in {a} hours?",
    "A stadium has {a} rows with {b} seats in each row. How many seats does the stadium have?",
    "{name} saves {b} dollars every week. How many dollars does {name} save in {a} weeks?",
)

# Numbers start at 2 so that no story reads "1 apples".
_SHAPES: dict[int, tuple[_Shape, ...]] = {
    # Level 1: one addition or subtraction with 1-2 digit numbers.
    1: (
        _Shape("{a} + {b}", {"a": (2, 99), "b": (2, 99)}, _ADD_STORIES),
        _Shape("{a} - {b}", {"a": (2, 99), "b": (2, 99)}, _SUB_STORIES),
    ),
    # Level 2: one operation with 2-3 digit numbers; the 3-digit first number
    # keeps these questions apart from level 1.
    2: (
        _Shape("{a} + {b}", {"a": (100, 999), "b": (10, 999)}, _ADD_STORIES),
        _Shape("{a} - {b}", {"a": (100, 999), "b": (10, 999)}, _SUB_STORIES),
        _Shape("{a} * {b}", {"a": (10, 999), "b": (10, 99)}, _MUL_STORIES),
    ),
    # Level 3: two operations.
    3: (
        _Shape(
            "{a} * {b} + {c}",
            {"a": (2, 30), "b": (2, 30), "c": (2, 99)},
            (
                "{name} buys {a} packs of stickers with {b} stickers in each pack and already owns "
                "{c} stickers. How many stickers does {name} have now?",
                "A farmer plants {a} rows of {b} trees and another {c} trees along the fence. "
                "How many trees does the farmer plant?",
                "{name} works {a} hours at {b} dollars per hour and also gets a {c} dollar tip. "
                "How many dollars does {name} earn?",
            ),
        ),
        _Shape(
            "{a} * {b} - {c}",
            {"a": (2, 30), "b": (2, 30), "c": (2, 99)},
            (
                "{name} bakes {a} trays of cookies with {b} cookies on each tray and gives away "
                "{c} cookies. How many cookies are left?",
                "A store receives {a} crates with {b} bottles in each crate, and {c} bottles arrive "
                "broken. How many unbroken bottles are there?",
                "A printer prints {b} pages per minute for {a} minutes, but {c} pages jam and are "
                "thrown away. How many good pages are printed?",
            ),
        ),
        _Shape(
            "({a} + {b}) * {c}",
            {"a": (2, 40), "b": (2, 40), "c": (2, 20)},
            (
                "{name} buys {a} red pens and {b} blue pens. Every pen costs {c} dollars. "
                "How many dollars does {name} spend?",
                "A minibus carries {a} adults and {b} children on each trip and makes {c} trips. "
                "How many people does it carry in total?",
                "Every day {name} reads {a} pages in the morning and {b} pages at night. "
                "How many pages does {name} read in {c} days?",
            ),
        ),
        _Shape(
            "({a} - {b}) * {c}",
            {"a": (10, 60), "b": (2, 50), "c": (2, 20)},
            (
                "A carton holds {a} eggs, but {b} of them are cracked. Each good egg sells for "
                "{c} cents. How many cents do the good eggs sell for?",
                "A team has {a} players and {b} of them are injured. Every healthy player runs "
                "{c} laps. How many laps are run in total?",
            ),
        ),
        _Shape(
            "{a} + {b} - {c}",
            {"a": (2, 99), "b": (2, 99), "c": (2, 99)},
            (
                "{name} had {a} marbles, won {b} more, and then lost {c}. How many marbles does {name} have now?",
                "A parking lot has {a} cars. Then {b} cars arrive and {c} cars leave. "
                "How many cars are in the lot now?",
            ),
        ),
    ),
    # Level 4: three operations including a division that comes out exact.
    4: (
        _Shape(
            "({a} * {b} + {c}) / {d}",
            {"a": (2, 12), "b": (2, 12), "c": (2, 50), "d": (2, 9)},
            (
                "{name} has {a} bags with {b} candies in each bag, plus {c} loose candies. "
                "{name} shares all the candies equally among {d} friends. "
                "How many candies does each friend get?",
                "A school orders {a} boxes of {b} notebooks and {c} extra notebooks, then splits "
                "them equally between {d} classrooms. How many notebooks does each classroom get?",
            ),
        ),
        _Shape(
            "({a} + {b}) * {c} / {d}",
            {"a": (2, 20), "b": (2, 20), "c": (2, 30), "d": (2, 9)},
            (
                "{a} adults and {b} children each pay {c} dollars for a boat tour. The money is "
                "shared equally among {d} guides. How many dollars does each guide get?",
                "{name} packs {a} green boxes and {b} yellow boxes that weigh {c} kg each, and "
                "loads them evenly onto {d} carts. How many kg does each cart carry?",
            ),
        ),
        _Shape(
            "{a} * {b} / {c} - {d}",
            {"a": (2, 20), "b": (2, 30), "c": (2, 10), "d": (2, 20)},
            (
                "A factory makes {a} boxes of {b} screws and repacks all the screws into bags of "
                "{c}. Then {d} bags are sold. How many bags are left?",
                "{name} picks {a} baskets with {b} strawberries in each and puts all of them into "
                "cups of {c} strawberries. {name} eats {d} cups. How many cups are left?",
            ),
        ),
        _Shape(
            "({a} - {b}) / {c} + {d}",
            {"a": (10, 99), "b": (2, 50), "c": (2, 10), "d": (2, 20)},
            (
                "{name} has a ribbon {a} cm long and cuts off {b} cm. The rest is cut into pieces "
                "{c} cm long. {name} already had {d} pieces. How many pieces does {name} have now?",
                "A tank holds {a} litres of water and {b} litres leak out. The rest is poured into "
                "jugs of {c} litres each, and {d} full jugs are already on the table. "
                "How many full jugs are there now?",
            ),
        ),
    ),
}

LEVELS: tuple[int, ...] = tuple(sorted(_SHAPES))

# Share of the hash space owned by each split, out of 100 buckets.
_SPLIT_BUCKETS: dict[str, range] = {"train": range(0, 80), "val": range(80, 90), "test": range(90, 100)}


def generate_problems(
    split: Split,
    n: int,
    *,
    levels: Sequence[int] = (1, 2, 3),
    seed: int = 0,
) -> list[Problem]:
    """Generate ``n`` distinct word problems for ``split``, cycling through ``levels``.

    Deterministic: the same arguments always give the same problems. Splits never
    share a question, whatever the seeds: the hash of a question's text decides
    which split may use it, and other splits discard it.
    """
    if split not in _SPLIT_BUCKETS:
        raise ValueError(f"split must be one of {sorted(_SPLIT_BUCKETS)}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not levels or any(level not in _SHAPES for level in levels):
        raise ValueError(f"levels must be a non-empty selection of {LEVELS}, got {levels!r}")

    # A string seed makes random.Random reproducible across processes and platforms.
    rng = random.Random(f"calculator:{split}:{seed}")
    problems: list[Problem] = []
    seen: set[str] = set()
    # Most draws are discarded (wrong split, non-whole steps), but a run of
    # failures this long means the problem space is exhausted.
    for _ in range(1000 * n + 1000):
        if len(problems) == n:
            break
        level = levels[len(problems) % len(levels)]
        drawn = _draw(rng, level)
        if drawn is None:
            continue
        question, expression, answer = drawn
        digest = hashlib.sha256(question.encode()).hexdigest()
        if question in seen or int(digest[:8], 16) % 100 not in _SPLIT_BUCKETS[split]:
            continue
        seen.add(question)
        problems.append(
            Problem(
                id=f"calc-{digest[:12]}",
                question=question,
                expression=expression,
                answer=answer,
                level=level,
                split=split,
            )
        )
    if len(problems) < n:
        raise RuntimeError(f"could only generate {len(problems)} distinct problems of the {n} requested")
    return problems


def _draw(rng: random.Random, level: int) -> tuple[str, str, int] | None:
    """Draw one (question, expression, answer), or None if the numbers make a bad story."""
    shape = rng.choice(_SHAPES[level])
    numbers = {slot: rng.randint(low, high) for slot, (low, high) in shape.ranges.items()}
    expression = shape.expression.format(**numbers)
    tree = ast.parse(expression, mode="eval")
    # Every step must be a positive whole number: a story about eggs and buses
    # cannot have -3 eggs left or share 7 candies among 2 friends.
    steps = [_evaluate(node) for node in ast.walk(tree) if isinstance(node, ast.BinOp)]
    if not all(isinstance(step, int) and step > 0 for step in steps):
        return None
    answer = _evaluate(tree)
    assert isinstance(answer, int)  # the root is one of the steps checked above
    name, other = rng.sample(_NAMES, 2)
    question = rng.choice(shape.templates).format(name=name, other=other, **numbers)
    return question, expression, answer

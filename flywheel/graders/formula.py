"""``calculate_output`` of multi graders: arithmetic over sub-grader scores, parsed here and never by ``eval``.

Grammar (usual precedence; ``^`` binds tighter than unary minus and is right-associative, so ``-2^2 = -4`` and
``2^3^2 = 512``)::

    expr  := term (("+" | "-") term)*
    term  := unary (("*" | "/") unary)*
    unary := ("+" | "-") unary | power
    power := atom ("^" unary)?
    atom  := NUMBER | NAME | FUNC "(" expr ("," expr)* ")" | "(" expr ")"

Functions: min, max (one or more arguments), abs, floor, ceil, exp, sqrt, log (natural; ``log(x, base)``).
Names are the multi grader's keys; any other name is rejected when the grader is loaded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

FUNCTIONS: dict[str, tuple[Callable[..., float], int, int | None]] = {
    "min": (lambda *values: min(values), 1, None),
    "max": (lambda *values: max(values), 1, None),
    "abs": (abs, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "exp": (math.exp, 1, 1),
    "sqrt": (math.sqrt, 1, 1),
    "log": (math.log, 1, 2),
}

_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|([A-Za-z_]\w*)|(\*\*|[-+*/^(),]))")


class FormulaError(ValueError):
    """The formula is malformed or names something that is not a grader or a function."""


@dataclass(frozen=True)
class _Token:
    kind: str  # "number" | "name" | "op" | "end"
    text: str
    column: int  # 1-based, for messages


def _tokenize(source: str) -> list[_Token]:
    tokens, position = [], 0
    while position < len(source):
        if source[position:].strip() == "":
            break
        match = _TOKEN.match(source, position)
        if match is None:
            column = position + len(source[position:]) - len(source[position:].lstrip()) + 1
            raise FormulaError(f"unexpected character {source[column - 1]!r} at column {column}")
        number, name, op = match.groups()
        kind = "number" if number else "name" if name else "op"
        text = number or name or op
        if text == "**":
            raise FormulaError(f"'**' at column {match.start(3) + 1}: powers are written with '^'")
        tokens.append(_Token(kind, text, match.end() - len(text) + 1))
        position = match.end()
    tokens.append(_Token("end", "", len(source) + 1))
    return tokens


@dataclass(frozen=True)
class _Number:
    value: float

    def __call__(self, env: Mapping[str, float]) -> float:
        return self.value


@dataclass(frozen=True)
class _Name:
    name: str

    def __call__(self, env: Mapping[str, float]) -> float:
        return float(env[self.name])


@dataclass(frozen=True)
class _Unary:
    op: str
    operand: Callable[[Mapping[str, float]], float]

    def __call__(self, env: Mapping[str, float]) -> float:
        value = self.operand(env)
        return -value if self.op == "-" else value


@dataclass(frozen=True)
class _Binary:
    op: str
    left: Callable[[Mapping[str, float]], float]
    right: Callable[[Mapping[str, float]], float]

    def __call__(self, env: Mapping[str, float]) -> float:
        a, b = self.left(env), self.right(env)
        if self.op == "+":
            return a + b
        if self.op == "-":
            return a - b
        if self.op == "*":
            return a * b
        if self.op == "/":
            return a / b
        result = a**b
        if isinstance(result, complex):  # (-8) ^ (1/3): no real value
            raise ValueError(f"{a} ^ {b} has no real value")
        return result


@dataclass(frozen=True)
class _Call:
    function: str
    arguments: tuple[Callable[[Mapping[str, float]], float], ...]

    def __call__(self, env: Mapping[str, float]) -> float:
        return float(FUNCTIONS[self.function][0](*(argument(env) for argument in self.arguments)))


class _Parser:
    def __init__(self, source: str, allowed: Collection[str] | None) -> None:
        self.tokens = _tokenize(source)
        self.position = 0
        self.allowed = allowed
        self.names: set[str] = set()

    @property
    def token(self) -> _Token:
        return self.tokens[self.position]

    def take(self) -> _Token:
        token = self.token
        self.position += 1
        return token

    def expect(self, text: str) -> None:
        if self.token.text != text:
            found = f"'{self.token.text}'" if self.token.kind != "end" else "the end"
            raise FormulaError(f"expected '{text}' at column {self.token.column}, found {found}")
        self.take()

    def formula(self) -> Callable[[Mapping[str, float]], float]:
        if self.token.kind == "end":
            raise FormulaError("the formula is empty")
        node = self.expr()
        if self.token.kind != "end":
            raise FormulaError(f"unexpected '{self.token.text}' at column {self.token.column}")
        return node

    def expr(self) -> Callable[[Mapping[str, float]], float]:
        node = self.term()
        while self.token.text in ("+", "-"):
            node = _Binary(self.take().text, node, self.term())
        return node

    def term(self) -> Callable[[Mapping[str, float]], float]:
        node = self.unary()
        while self.token.text in ("*", "/"):
            node = _Binary(self.take().text, node, self.unary())
        return node

    def unary(self) -> Callable[[Mapping[str, float]], float]:
        if self.token.text in ("+", "-"):
            return _Unary(self.take().text, self.unary())
        return self.power()

    def power(self) -> Callable[[Mapping[str, float]], float]:
        node = self.atom()
        if self.token.text == "^":
            self.take()
            node = _Binary("^", node, self.unary())
        return node

    def atom(self) -> Callable[[Mapping[str, float]], float]:
        token = self.take()
        if token.kind == "number":
            return _Number(float(token.text))
        if token.text == "(":
            node = self.expr()
            self.expect(")")
            return node
        if token.kind == "name":
            if self.token.text == "(":
                return self.call(token)
            if token.text in FUNCTIONS:
                raise FormulaError(f"'{token.text}' at column {token.column} is a function: write {token.text}(...)")
            if self.allowed is not None and token.text not in self.allowed:
                known = ", ".join(sorted(self.allowed)) or "none"
                raise FormulaError(f"unknown name '{token.text}' at column {token.column} (the graders are: {known})")
            self.names.add(token.text)
            return _Name(token.text)
        found = f"'{token.text}'" if token.kind != "end" else "the end"
        raise FormulaError(f"expected a number, a name or '(' at column {token.column}, found {found}")

    def call(self, name: _Token) -> Callable[[Mapping[str, float]], float]:
        if name.text not in FUNCTIONS:
            raise FormulaError(
                f"unknown function '{name.text}' at column {name.column} (functions: {', '.join(FUNCTIONS)})"
            )
        self.expect("(")
        arguments = [self.expr()]
        while self.token.text == ",":
            self.take()
            arguments.append(self.expr())
        self.expect(")")
        _, least, most = FUNCTIONS[name.text]
        if len(arguments) < least or (most is not None and len(arguments) > most):
            wanted = f"{least}" if least == most else f"{least} to {most}" if most else f"at least {least}"
            raise FormulaError(
                f"{name.text}() at column {name.column} takes {wanted} argument(s), got {len(arguments)}"
            )
        return _Call(name.text, tuple(arguments))


@dataclass(frozen=True)
class Formula:
    """A parsed formula: call it with the variables' values. Math errors (division by zero, sqrt(-1),
    overflow) raise ArithmeticError or ValueError, for the caller to count."""

    source: str
    names: frozenset[str]
    _root: Callable[[Mapping[str, float]], float]

    def __call__(self, variables: Mapping[str, float]) -> float:
        missing = self.names - set(variables)
        if missing:
            raise KeyError(f"no value for {', '.join(sorted(missing))}")
        result = float(self._root(variables))
        if not math.isfinite(result):
            raise ArithmeticError(f"the formula gave {result}")
        return result


def parse_formula(source: str, allowed_names: Collection[str] | None = None) -> Formula:
    """Parse ``source``; with ``allowed_names``, any other variable is a FormulaError."""
    parser = _Parser(source, allowed_names)
    root = parser.formula()
    return Formula(source, frozenset(parser.names), root)

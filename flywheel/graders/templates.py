"""``{{ namespace.path }}`` templates, as in OpenAI's graders: ``{{sample.output_text}}``, ``{{item.answer}}``,
``{{sample.output_json.city}}``, ``{{sample.output_tools[0].function.name}}``, ``{{ item["odd key"] }}``.

Syntax and namespaces are checked when a grader is loaded (``check_template``); whether ``item`` has a key can only
be known per row, so an unknown variable at render time raises ``GraderError(invalid_variable_error)`` for the
caller to count, never anything else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from flywheel.graders.errors import INVALID_VARIABLE, SAMPLE_PARSE, GraderError

_TAG = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_STEP = re.compile(r"""\.\s*([A-Za-z_][\w\-]*)|\[\s*(-?\d+)\s*\]|\[\s*(["'])(.*?)\3\s*\]""")
_HEAD = re.compile(r"\s*([A-Za-z_]\w*)")
NAMESPACES = ("sample", "item")
SAMPLE_FIELDS = ("output_text", "output_json", "output_tools", "choices")

Path = tuple[str | int, ...]


def parse_variable(expression: str) -> Path:
    """``sample.output_tools[0].function.name`` -> ``("sample", "output_tools", 0, "function", "name")``."""
    head = _HEAD.match(expression)
    if head is None:
        raise ValueError(f"'{{{{{expression}}}}}' does not start with a namespace (sample or item)")
    path: list[str | int] = [head.group(1)]
    position = head.end()
    text = expression.rstrip()
    while position < len(text):
        step = _STEP.match(text, position)
        if step is None:
            raise ValueError(
                f"'{{{{{expression}}}}}': cannot read '{text[position:]}' (use .key, [index] or [\"key\"])"
            )
        name, index, _, quoted = step.groups()
        path.append(int(index) if index is not None else name if name is not None else quoted)
        position = step.end()
    return tuple(path)


def variables(template: str) -> list[Path]:
    return [parse_variable(match.group(1)) for match in _TAG.finditer(template)]


def check_template(template: str) -> str:
    """Raise ValueError naming the problem if a template is malformed or reads an unknown namespace/sample field."""
    for path in variables(template):
        if path[0] not in NAMESPACES:
            raise ValueError(f"unknown namespace '{path[0]}' in a template: use sample.* or item.*")
        if path[0] == "sample" and (len(path) < 2 or path[1] not in SAMPLE_FIELDS):
            field = path[1] if len(path) > 1 else ""
            raise ValueError(f"'sample.{field}' is not a sample field; they are: {', '.join(SAMPLE_FIELDS)}")
    if "{{" in _TAG.sub("", template):
        raise ValueError("a '{{' in a template is not closed by '}}'")
    return template


def _display(path: Path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else p for i, p in enumerate(path))


def resolve(path: Path, namespaces: Mapping[str, Any]) -> Any:
    """The value at ``path``; GraderError(invalid_variable_error | sample_parse_error) if there is none."""
    if path[:2] == ("sample", "output_json") and "output_json" not in namespaces.get("sample", {}):
        raise GraderError(SAMPLE_PARSE, f"{_display(path)}: the sample's output_text is not valid JSON")
    value: Any = namespaces
    for depth, key in enumerate(path):
        if isinstance(value, Mapping) and key in value:
            value = value[key]
        elif isinstance(value, list) and isinstance(key, int) and -len(value) <= key < len(value):
            value = value[key]
        else:
            where = _display(path[:depth]) or "the template"
            if isinstance(value, Mapping):
                keys = ", ".join(map(str, list(value)[:20])) or "none"
                raise GraderError(INVALID_VARIABLE, f"{_display(path)}: {where} has no key {key!r} (its keys: {keys})")
            kind = f"a list of {len(value)} item(s)" if isinstance(value, list) else f"a {type(value).__name__}"
            raise GraderError(INVALID_VARIABLE, f"{_display(path)}: {where} is {kind}, which has no [{key!r}]")
    return value


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render(template: str, namespaces: Mapping[str, Any]) -> str:
    """Substitute every ``{{...}}``; strings go in as they are, anything else as JSON."""
    return _TAG.sub(lambda match: _text(resolve(parse_variable(match.group(1)), namespaces)), template)

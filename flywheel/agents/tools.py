"""Tools an agent can call: plain Python functions (sync or async) turned into OpenAI function tools.

The JSON schema comes from the type hints (pydantic) and the docstring (``docstring_parser``: Google, NumPy, reST
and Epydoc styles), and the same pydantic model validates the arguments the model wrote before the function runs,
so a bad call becomes a message the model can read instead of an exception in your code.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_type_hints, overload

import docstring_parser
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic_core import to_json

Arguments = dict[str, Any]

ToolStatus = Literal["ok", "error", "timeout", "unknown_tool", "bad_arguments", "denied"]
"""What became of one tool call. ``run_agent`` records them, one per call, on the sampled ``Choice`` that made the
calls, as the extra field ``tool_statuses`` (extra fields travel with the Choice through JSON)."""
TOOL_STATUSES = "tool_statuses"


class ToolError(Exception):
    """Raise inside a tool to report a failure to the model: the message is shown to it as is."""


class ArgumentsError(ValueError):
    """The arguments a model wrote do not fit the tool's schema; the message says what is wrong, for the model."""


@dataclass(frozen=True)
class Tool:
    """A function tool: its OpenAI description, an argument check and the call itself.

    ``check`` turns the parsed JSON arguments into the arguments ``call`` takes, raising ``ArgumentsError``;
    ``call`` may be sync or async and return anything (strings are sent as they are, the rest as JSON).
    ``cacheable=False`` keeps a tool whose answer changes (time, random, live data) out of the ``ToolCache``.
    ``high_impact=True``: each call needs an approver's decision first (``run_agent(..., approve=...)``; a person
    in production, a policy in training: ``flywheel.approvals``).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    call: Callable[[Arguments], Any]
    check: Callable[[Arguments], Arguments]
    cacheable: bool = True
    high_impact: bool = False

    @property
    def schema(self) -> dict[str, Any]:
        """The entry for the ``tools`` list of a chat completion request."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def parse_arguments(self, raw: str) -> Arguments:
        """JSON text written by the model -> the arguments ``call`` takes; ``ArgumentsError`` says what is wrong."""
        try:
            arguments = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise ArgumentsError(f"the arguments are not valid JSON ({exc.msg} at position {exc.pos})") from None
        if not isinstance(arguments, dict):
            raise ArgumentsError(f"the arguments must be a JSON object, got {type(arguments).__name__}")
        return self.check(arguments)

    async def run(self, arguments: Arguments) -> str:
        """Call the tool (a sync function in a worker thread, so it cannot stall the event loop); result as text."""
        if inspect.iscoroutinefunction(self.call):
            result = await self.call(arguments)
        else:
            result = await asyncio.to_thread(self.call, arguments)
            if inspect.isawaitable(result):
                result = await result
        return result if isinstance(result, str) else to_json(result).decode()

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        cacheable: bool = True,
        high_impact: bool = False,
    ) -> Tool:
        """Schema from the signature's type hints and the docstring (summary + per-argument descriptions)."""
        name = name or fn.__name__
        signature = inspect.signature(fn)
        hints = get_type_hints(fn, include_extras=True)
        doc = docstring_parser.parse(inspect.getdoc(fn) or "")
        arg_docs = {p.arg_name: p.description for p in doc.params}
        fields: dict[str, Any] = {}
        for param in signature.parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                raise TypeError(
                    f"tool {name!r}: parameter {param.name!r} is {param.kind.description}; tools take named "
                    "arguments only (the model sends a JSON object)"
                )
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (hints.get(param.name, Any), Field(default, description=arg_docs.get(param.name)))
        model = create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
        text = description or "\n\n".join(p for p in (doc.short_description, doc.long_description) if p)

        def check(arguments: Arguments) -> Arguments:
            try:
                validated = model.model_validate(arguments)
            except ValidationError as exc:
                raise ArgumentsError(_explain(exc)) from None
            return {field: getattr(validated, field) for field in model.model_fields}

        if inspect.iscoroutinefunction(fn):

            async def call(arguments: Arguments) -> Any:
                return await fn(**arguments)

        else:

            def call(arguments: Arguments) -> Any:
                return fn(**arguments)

        return cls(name, text, _schema(model), call, check, cacheable, high_impact)


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    # Titles repeat the names; every prompt token counts for a small model.
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return schema


def _explain(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "arguments"
        problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems)


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *, name: str | None = None, description: str | None = None, cacheable: bool = True, high_impact: bool = False
) -> Callable[[Callable[..., Any]], Tool]: ...
def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    cacheable: bool = True,
    high_impact: bool = False,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: ``@tool``, ``@tool(cacheable=False)`` or ``@tool(high_impact=True)`` turns a function into a
    ``Tool``."""
    if fn is not None:
        return Tool.from_function(fn)
    return lambda f: Tool.from_function(
        f, name=name, description=description, cacheable=cacheable, high_impact=high_impact
    )


def as_tools(tools: Iterable[Tool | Callable[..., Any]]) -> dict[str, Tool]:
    """Tools by name; plain functions are wrapped. Two tools with one name would make calls ambiguous."""
    by_name: dict[str, Tool] = {}
    for item in tools:
        t = item if isinstance(item, Tool) else Tool.from_function(item)
        if t.name in by_name:
            raise ValueError(f"two tools are named {t.name!r}; tool names must be unique")
        by_name[t.name] = t
    return by_name


async def mcp_tools(client: Any, *, cacheable: bool = False) -> list[Tool]:
    """The tools of a connected MCP client (``mcp.Client`` or ``ClientSession``, mcp >= 2) as ``Tool``s.

    Arguments are checked against each tool's JSON schema (``jsonschema``, an mcp dependency) before the call,
    so schema errors count as bad arguments; a result with ``is_error`` becomes a ``ToolError``. MCP tools are
    not cached unless ``cacheable=True``: a server's tools are often stateful.
    """
    import jsonschema  # comes with the optional `mcp` extra

    listed = await client.list_tools()
    tools = []
    for spec in listed.tools:
        validator = jsonschema.Draft202012Validator(spec.input_schema)

        def check(arguments: Arguments, validator: jsonschema.Validator = validator) -> Arguments:
            errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
            if errors:
                raise ArgumentsError(
                    "; ".join(f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}" for e in errors)
                )
            return arguments

        async def call(arguments: Arguments, name: str = spec.name) -> str:
            result = await client.call_tool(name, arguments)
            text = "\n".join(
                block.text if getattr(block, "type", None) == "text" else to_json(block).decode()
                for block in result.content
            )
            if result.is_error:
                raise ToolError(text)
            return text

        tools.append(Tool(spec.name, spec.description or "", spec.input_schema, call, check, cacheable))
    return tools

"""Tools from Python functions (schema from hints and docstring, argument checks) and from a real MCP server."""

from __future__ import annotations

import asyncio
import threading
from typing import Literal

import pytest
from pydantic import BaseModel

from flywheel.agents import ArgumentsError, Tool, ToolError, mcp_tools, tool
from flywheel.agents.tools import as_tools


class Point(BaseModel):
    x: float
    y: float


@tool
def distance(a: Point, b: Point, unit: Literal["m", "km"] = "m") -> dict:
    """Distance between two points.

    Euclidean, in metres or kilometres.

    Args:
        a: The first point.
        b: The second point.
        unit: Unit of the result.
    """
    d = ((a.x - b.x) ** 2 + (a.y - b.y) ** 2) ** 0.5
    return {"distance": d / 1000 if unit == "km" else d, "unit": unit}


def test_schema_comes_from_type_hints_and_the_docstring():
    fn = distance.schema["function"]
    assert fn["name"] == "distance"
    assert fn["description"] == "Distance between two points.\n\nEuclidean, in metres or kilometres."
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["a", "b"]
    assert params["additionalProperties"] is False
    assert params["properties"]["a"]["description"] == "The first point."
    assert params["properties"]["a"]["$ref"] == "#/$defs/Point"
    assert params["$defs"]["Point"]["required"] == ["x", "y"]
    assert params["properties"]["unit"] == {
        "default": "m",
        "description": "Unit of the result.",
        "enum": ["m", "km"],
        "type": "string",
    }


def test_numpy_style_docstrings_and_decorator_options():
    @tool(name="lookup", cacheable=False)
    async def find(query: str, limit: int = 3) -> list[str]:
        """Search the index.

        Parameters
        ----------
        query
            What to look for.
        limit
            At most this many hits.
        """
        return [query] * limit

    assert find.name == "lookup" and find.cacheable is False
    props = find.parameters["properties"]
    assert props["query"] == {"type": "string", "description": "What to look for."}
    assert props["limit"] == {"type": "integer", "default": 3, "description": "At most this many hits."}


async def test_arguments_are_validated_and_coerced_before_the_call():
    args = distance.parse_arguments('{"a": {"x": 0, "y": 0}, "b": {"x": "3", "y": 4}, "unit": "km"}')
    assert args == {"a": Point(x=0, y=0), "b": Point(x=3, y=4), "unit": "km"}
    assert await distance.run(args) == '{"distance":0.005,"unit":"km"}'  # non-strings come back as JSON


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('{"a": {"x": 0, "y": 0}}', "b: Field required"),
        ('{"a": {"x": 0, "y": 0}, "b": {"x": 1, "y": 1}, "units": "m"}', "units: Extra inputs are not permitted"),
        ('{"a": {"x": "far", "y": 0}, "b": {"x": 1, "y": 1}}', "a.x: Input should be a valid number"),
        ('{"a": {"x": 0, "y": 0}, "b": {"x": 1, "y": 1}, "unit": "mi"}', "unit: Input should be 'm' or 'km'"),
        ("[1, 2]", "the arguments must be a JSON object, got list"),
        ('{"a": ', "the arguments are not valid JSON"),
    ],
)
def test_bad_arguments_say_what_is_wrong(raw, message):
    with pytest.raises(ArgumentsError) as info:
        distance.parse_arguments(raw)
    assert message in str(info.value)


async def test_sync_tools_run_in_a_worker_thread_and_async_ones_on_the_loop():
    def where() -> str:
        """Name of the thread running me."""
        return threading.current_thread().name

    async def here() -> str:
        """Name of the thread running me."""
        await asyncio.sleep(0)
        return threading.current_thread().name

    tools = as_tools([where, here])  # plain functions are wrapped
    assert await tools["where"].run({}) != threading.current_thread().name
    assert await tools["here"].run({}) == threading.current_thread().name
    # empty arguments text is an empty object (some models send "" for no-argument tools)
    assert tools["where"].parse_arguments("") == {}


def test_signatures_a_model_cannot_call_are_refused():
    def variadic(*values: int) -> int:
        return sum(values)

    with pytest.raises(TypeError, match="parameter 'values' is variadic positional"):
        Tool.from_function(variadic)
    with pytest.raises(ValueError, match="two tools are named 'distance'"):
        as_tools([distance, distance])


async def test_mcp_server_tools_are_listed_checked_and_called():
    """A real MCP server (the `mcp` package's MCPServer) connected in-process through its own Client."""
    pytest.importorskip("mcp")
    from mcp import Client
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("arith")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def divide(a: float, b: float) -> float:
        """Divide a by b."""
        if b == 0:
            raise ValueError("division by zero")
        return a / b

    async with Client(server) as client:
        tools = {t.name: t for t in await mcp_tools(client)}
        assert set(tools) == {"add", "divide"}
        assert tools["add"].schema["function"]["description"] == "Add two integers."
        assert tools["add"].parameters["required"] == ["a", "b"]
        assert tools["add"].cacheable is False
        assert await tools["add"].run(tools["add"].parse_arguments('{"a": 2, "b": 3}')) == "5"
        with pytest.raises(ArgumentsError, match="b: 'x' is not of type 'integer'"):
            tools["add"].parse_arguments('{"a": 2, "b": "x"}')
        with pytest.raises(ArgumentsError, match="'b' is a required property"):
            tools["add"].parse_arguments('{"a": 2}')
        with pytest.raises(ToolError, match="divide"):
            await tools["divide"].run({"a": 1, "b": 0})

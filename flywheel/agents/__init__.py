"""Tool-using agents: tools from functions or MCP, a reusable agent loop, tool-call caching, automatic
intermediate rewards (AIR), a scenario curriculum and the transitions export. Credit assignment over turns lives
with the trainer (``flywheel.train.credit``; ``TrainConfig(credit="turn")``)."""

from flywheel.agents.air import AIRConfig, air_rewards, apply_air
from flywheel.agents.cache import ToolCache
from flywheel.agents.curriculum import CurriculumConfig, ScenarioPool
from flywheel.agents.tool_loop import final_answer, run_agent
from flywheel.agents.tools import ArgumentsError, Tool, ToolError, mcp_tools, tool
from flywheel.agents.transitions import (
    Transition,
    from_transitions,
    read_transitions,
    to_transitions,
    write_transitions,
)

__all__ = [
    "AIRConfig",
    "ArgumentsError",
    "CurriculumConfig",
    "ScenarioPool",
    "Tool",
    "ToolCache",
    "ToolError",
    "Transition",
    "air_rewards",
    "apply_air",
    "final_answer",
    "from_transitions",
    "mcp_tools",
    "read_transitions",
    "run_agent",
    "to_transitions",
    "tool",
    "write_transitions",
]

"""A plain OpenAI Agents SDK agent, written as if Flywheel did not exist: its chat-completions model reads the
endpoint from the environment, so pointing OPENAI_BASE_URL at a Flywheel episode is the only change.

    OPENAI_BASE_URL=http://127.0.0.1:8000/episodes/<id>/v1 python examples/gateway/agents_sdk_agent.py "12 * 7"

It must call the calculator tool (the SDK lifts that requirement once a tool ran), then answers; prints the answer
(with AGENT_OUTPUT=json, a JSON object with the answer and the tool's results, for a runner to score). AGENT_SEED,
if set, makes the sampling reproducible (OpenAI's `seed`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from langchain_agent import calculator as _langchain_calculator  # the same safe evaluator
from openai import AsyncOpenAI


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    return _langchain_calculator.invoke({"expression": expression})


async def main(question: str) -> tuple[str, list[str]]:
    set_tracing_disabled(True)  # no trace upload to OpenAI's servers
    model = OpenAIChatCompletionsModel(
        model=os.environ.get("AGENT_MODEL", "smollm2-135m-instruct"), openai_client=AsyncOpenAI()
    )
    agent = Agent(
        name="calculator",
        instructions="You are a calculator assistant. Use the calculator, then answer with the number.",
        model=model,
        tools=[calculator],
        model_settings=ModelSettings(
            tool_choice="required",
            temperature=0.7,
            max_tokens=96,
            extra_args={"seed": int(os.environ["AGENT_SEED"])} if "AGENT_SEED" in os.environ else None,
        ),
    )
    try:
        result = await Runner.run(agent, f"What is {question}?", max_turns=4)
    except MaxTurnsExceeded as exc:  # kept calling the tool: no answer
        items, answer = (exc.run_data.new_items if exc.run_data else []), ""
    else:
        items, answer = result.new_items, str(result.final_output)
    return answer, [str(item.output) for item in items if isinstance(item, ToolCallOutputItem)]


if __name__ == "__main__":
    answer, results = asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "12 * 7"))
    print(
        json.dumps({"answer": answer, "tool_results": results}) if os.environ.get("AGENT_OUTPUT") == "json" else answer
    )

"""The calculator agent: a multi-turn tool-calling rollout through the OpenAI chat API."""

from __future__ import annotations

import json

from openai import AsyncOpenAI

from flywheel.examples.calculator.task import (
    CALCULATOR_TOOL,
    SYSTEM_PROMPT,
    Problem,
    calculator,
    extract_answer,
    reward,
)
from flywheel.model import Model
from flywheel.types import Trajectory


def run_tool(name: str, arguments: str) -> str:
    """Execute one tool call; every failure becomes a message the model can read and recover from."""
    if name != "calculator":
        return f"Error: unknown tool '{name}'. The only tool is 'calculator'."
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return 'Error: the arguments must be a JSON object like {"expression": "2 + 2"}.'
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return 'Error: the arguments must be a JSON object like {"expression": "2 + 2"}.'
    return calculator(args["expression"])


async def rollout(
    model: Model,
    problem: Problem,
    *,
    client: AsyncOpenAI | None = None,
    temperature: float = 1.0,
    max_turns: int = 4,
    max_tokens: int = 96,
) -> Trajectory:
    """Let the model solve ``problem`` with the calculator; the reward is 1 for the exact answer, else 0."""
    client = client or model.openai_client()
    traj = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problem.question},
        ],
        tools=[CALCULATOR_TOOL],
        metadata={"problem_id": problem.id, "level": problem.level, "answer": problem.answer},
    )
    tool_calls = tool_errors = 0
    final = ""
    for _ in range(max_turns):
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=traj.messages(),
            tools=[CALCULATOR_TOOL],
            temperature=temperature,
            max_tokens=max_tokens,
            logprobs=True,
        )
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        calls = choice.message.tool_calls or []
        if not calls:
            final = choice.message.content or ""
            break
        for call in calls:
            result = run_tool(call.function.name, call.function.arguments)
            tool_calls += 1
            tool_errors += result.startswith("Error:")
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
    traj.reward = reward(problem, final)
    traj.metrics.update(
        correct=traj.reward,
        turns=sum(1 for m in traj.messages_and_choices if not isinstance(m, dict)),
        tool_calls=tool_calls,
        tool_errors=tool_errors,
        answered=extract_answer(final) is not None,
    )
    return traj

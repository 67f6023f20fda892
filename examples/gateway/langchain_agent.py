"""A plain LangChain agent (langchain-openai), written as if Flywheel did not exist: it reads the OpenAI endpoint
from the environment, as LangChain does, so pointing OPENAI_BASE_URL at a Flywheel episode is the only change.

    OPENAI_BASE_URL=http://127.0.0.1:8000/episodes/<id>/v1 python examples/gateway/langchain_agent.py "12 * 7"

It computes with a calculator tool first (a forced tool call), then answers; prints the answer on the last line
(with AGENT_OUTPUT=json, a JSON object with the answer and the tool's results, for a runner to score). The tool is
bound in OpenAI's strict mode, so a forced call's arguments hold only the schema's keys; AGENT_SEED, if set, makes the
sampling reproducible (OpenAI's `seed`).
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only + - * / on numbers")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    try:
        return str(_eval(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def main(question: str) -> tuple[str, list[str]]:
    seed = int(os.environ["AGENT_SEED"]) if "AGENT_SEED" in os.environ else None
    llm = ChatOpenAI(
        model=os.environ.get("AGENT_MODEL", "smollm2-135m-instruct"), temperature=0.7, max_tokens=96, seed=seed
    )
    messages = [
        SystemMessage("You are a calculator assistant. Use the calculator, then answer with the number."),
        HumanMessage(f"What is {question}?"),
    ]
    first = llm.bind_tools([calculator], tool_choice="calculator", strict=True).invoke(messages)
    messages.append(first)
    results = []
    for call in first.tool_calls:
        results.append(calculator.invoke(call["args"]))
        messages.append(ToolMessage(results[-1], tool_call_id=call["id"]))
    answer = llm.bind_tools([calculator], strict=True).invoke(messages)
    return str(answer.content), results


if __name__ == "__main__":
    answer, results = main(sys.argv[1] if len(sys.argv) > 1 else "12 * 7")
    print(
        json.dumps({"answer": answer, "tool_results": results}) if os.environ.get("AGENT_OUTPUT") == "json" else answer
    )

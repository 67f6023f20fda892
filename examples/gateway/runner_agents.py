"""Runner agents for ``train.py``: each runs one of the unmodified framework agents of this directory in a process
of its own against the attempt's episode URL, and scores what it printed (a verifiable reward).

    PYTHONPATH=examples/gateway flywheel runner --url http://127.0.0.1:8000 --agent runner_agents:langchain
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from flywheel.gateway.runner import current_lease

HERE = Path(__file__).parent


def score(output: dict[str, Any], answer: float) -> dict[str, Any]:
    """Half for a calculator call that computed the answer, half for a final reply that states it."""
    computed = any(_is(result, answer) for result in output.get("tool_results", []))
    stated = any(_is(word.strip(".,!:;*"), answer) for word in str(output.get("answer", "")).split())
    return {"reward": 0.5 * computed + 0.5 * stated, "metrics": {"computed": computed, "stated": stated}}


def _is(text: str, answer: float) -> bool:
    try:
        return abs(float(text) - answer) < 1e-6
    except ValueError:
        return False


async def _run(script: str, task: dict[str, Any], base_url: str) -> dict[str, Any]:
    env = os.environ | {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": os.environ.get("AGENT_API_KEY", "unused"),
        "AGENT_MODEL": current_lease().model or os.environ.get("AGENT_MODEL", "smollm2-135m-instruct"),
        "AGENT_OUTPUT": "json",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / script), task["question"], env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=600)
    except BaseException:  # cancelled (lease lost, runner stopping) or timed out: the agent's process goes too
        process.kill()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"{script} exited with {process.returncode}: {err.decode()[-1000:]}")
    return score(json.loads(out.decode().strip().splitlines()[-1]), float(task["answer"]))


async def langchain(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    return await _run("langchain_agent.py", task, base_url)


async def agents_sdk(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    return await _run("agents_sdk_agent.py", task, base_url)

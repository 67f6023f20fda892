"""Agents that the rollout-queue tests run in runner processes of their own (``flywheel runner --agent
queue_agents:...``, with this directory on PYTHONPATH): nothing heavier than httpx is imported."""

from __future__ import annotations

import asyncio

import httpx

from flywheel.gateway.runner import current_lease


async def one_call_then_hang(task: dict, base_url: str) -> float:
    """One chat completion in the episode, then sleep until killed: a runner that dies mid-episode."""
    async with httpx.AsyncClient(timeout=120) as http:
        body = {"model": current_lease().model, "messages": [{"role": "user", "content": task["question"]}]}
        reply = await http.post(f"{base_url}/chat/completions", json=body | {"max_tokens": 4})
        reply.raise_for_status()
    await asyncio.sleep(3600)
    return 1.0

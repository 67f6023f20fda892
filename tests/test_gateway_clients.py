"""Real agent frameworks, unmodified, each in its own process, recorded through an episode URL: LangChain
(langchain-openai) and the OpenAI Agents SDK. Both parse the model's tool call and send it back re-serialised in
the next request; the gateway continues the exact sampled ids anyway, so the episode trains as one sequence of
exactly the tokens the model drew."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.gateway.client import EpisodeClient
from flywheel.inference.chat import render_prompt
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.train.batch import trajectory_sequences

EXAMPLES = Path(__file__).parent.parent / "examples" / "gateway"


@pytest.mark.parametrize("script", ["langchain_agent.py", "agents_sdk_agent.py"])
async def test_an_unmodified_framework_agent_is_recorded_token_in_token_out(backend, tokenizer, script):
    root = backend.base_url.removesuffix("/v1")
    async with EpisodeClient(root) as episodes:
        episode = await episodes.create(f"clients-{script}")
        env = os.environ | {
            "OPENAI_BASE_URL": episode.base_url,
            "OPENAI_API_KEY": "unused",
            "AGENT_MODEL": EMBEDDED_MODEL,
            # Unseeded, about 1 run in 60 (strict tools; 1 in 12 without) ran out of max_tokens inside the forced
            # call's arguments string, and the call then carries no tool_calls: the model's draw, not the gateway's.
            "AGENT_SEED": "0",
        }
        run = subprocess.run(
            [sys.executable, str(EXAMPLES / script), "12 * 7"], env=env, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-2000:]
        calls = await episodes.calls(episode.id)
        assert len(calls) >= 2  # the forced tool call, then the answer (more if the model calls again)
        first, second = calls[0], calls[1]
        assert first["response"]["choices"][0]["message"]["tool_calls"]
        resent = second["request"]["messages"][2]
        assert resent["role"] == "assistant" and resent["tool_calls"]  # the framework's own serialisation
        assert [c["prefix_call"] for c in calls[1:]] == [c["id"] for c in calls[:-1]]
        assert all(c["retokenized_turns"] == 0 for c in calls)
        # re-rendering the re-sent history from text would not give the ids the model drew
        ids = first["response"]["choices"][0]
        exact = ids["prompt_token_ids"] + ids["token_ids"]
        spliced = second["response"]["choices"][0]["prompt_token_ids"]
        rendered = render_prompt(tokenizer, second["request"]["messages"], second["request"]["tools"])
        assert spliced[: len(exact)] == exact and rendered[: len(exact)] != exact

        await episodes.finish(episode.id, 1.0)
        trajectory = await episodes.trajectory(episode.id)
        sequences = trajectory_sequences(trajectory, tokenizer)
        assert len(sequences) == 1
        trained = [t for t, on in zip(sequences[0].tokens, sequences[0].trained) if on]
        assert trained == [t for c in calls for t in c["response"]["choices"][0]["token_ids"]]

"""A streamed chat completion (``stream: true``) on the embedded engine: an error before its first token is the
same HTTP status and error body as the unstreamed request gets (the server draws the first token before it sends the
status line), on the real server with the real openai SDK. The vLLM engine's cases (a server down, a refusal, a
stream dropped after its first token) are in tests/test_vllm_engine.py."""

from __future__ import annotations

import openai
import pytest

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer

from helpers import refused_both_ways

QUESTION = [{"role": "user", "content": "What is 12 * 7?"}]


@pytest.fixture(scope="module")
def client(engine: InferenceEngine):
    """The openai SDK on a server with the session's engine as "live", and an engine over the same weights closed
    before the server starts as "closed" (a backend shut down while the registry still names it)."""
    closed = InferenceEngine(engine.model, engine.tokenizer)
    closed.close()
    registry = ModelRegistry()
    registry.add("live", engine)
    registry.add("closed", closed)
    server = BackgroundServer(create_app(registry)).start()
    yield openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    server.stop()


async def test_a_closed_engine_is_a_503_streamed_or_not(client):
    plain, streamed = await refused_both_ways(client, model="closed", messages=QUESTION, max_tokens=4)
    assert plain.status_code == streamed.status_code == 503 and plain.body == streamed.body
    assert streamed.code == "engine_closed"


async def test_a_prompt_over_the_context_is_a_400_streamed_or_not(client, engine):
    long = [{"role": "user", "content": "word " * engine.context_length}]
    plain, streamed = await refused_both_ways(client, model="live", messages=long, max_tokens=4)
    assert plain.status_code == streamed.status_code == 400 and plain.body == streamed.body
    assert streamed.code == "context_length_exceeded"

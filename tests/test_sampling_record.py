"""How each choice was drawn, as the server records it, and what the trainer's truncated importance sampling (TIS)
makes of it (issue #37 items 13 and 14): on the real model in fp32 (where sampler and trainer agree to rounding),
served on a real loopback server and called with the real openai SDK.

The rule for constrained calls (a forced tool call, ``guided_choice``, a JSON ``response_format``): their tokens
were drawn from a grammar-masked distribution, whose log-probs the sampler reports, while the trainer scores the
unmasked one. So they are recorded as ``guided`` and TIS leaves them at weight 1 (no sampler log-prob to compare):
an on-policy forced tool call trains with ratio 1, where comparing the masked log-probs gave a ratio well below 1.
"""

from __future__ import annotations

import math

import openai
import pytest
import torch

import flywheel as art
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.train.batch import trajectory_sequences
from flywheel.train.config import TrainConfig
from flywheel.train.trainer import Trainer
from flywheel.types import sampled_tokens

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
QUESTION = [{"role": "user", "content": "What is 12 * 7? Use the calculator."}]


@pytest.fixture(scope="module")
def served():
    """A float32 trainer whose engine a real server serves as "fp32-model" (its own weights: the tests train)."""
    model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    engine = InferenceEngine(model, tokenizer)
    registry = ModelRegistry()
    registry.add("fp32-model", engine)
    server = BackgroundServer(create_app(registry)).start()
    yield Trainer(engine), openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    server.stop()
    engine.close()


async def test_each_choice_records_how_it_was_drawn(served):
    _, client = served
    forced = await client.chat.completions.create(
        model="fp32-model", messages=QUESTION, tools=[CALC], tool_choice="required", max_tokens=40,
        temperature=0.9, top_p=0.95, seed=1,
    )  # fmt: skip
    picked = await client.chat.completions.create(
        model="fp32-model", messages=QUESTION, max_tokens=4, temperature=0, extra_body={"guided_choice": ["84", "42"]}
    )
    plain = await client.chat.completions.create(model="fp32-model", messages=QUESTION, max_tokens=4, temperature=0.7)
    f, p, q = (sampled_tokens(r.choices[0]) for r in (forced, picked, plain))
    assert (f.guided, f.temperature, f.top_p, f.greedy, f.logprobs_temperature) == (True, 0.9, 0.95, False, 0.9)
    assert (p.guided, p.greedy, p.temperature, p.logprobs_temperature) == (True, True, 1.0, 1.0)  # greedy: T=1's
    assert (q.guided, q.greedy, q.top_p, q.logprobs_temperature) == (False, False, 1.0, 0.7)
    tokenizer_keys = {getattr(r.choices[0], "tokenizer", None) for r in (forced, picked, plain)}
    assert len(tokenizer_keys) == 1 and None not in tokenizer_keys  # which tokenizer's ids these are


async def test_an_on_policy_forced_tool_call_trains_with_importance_ratio_1(served):
    trainer, client = served
    cap = TrainConfig(learning_rate=1e-5, importance_sampling_cap=2.0)

    async def group(**kwargs) -> art.TrajectoryGroup:
        reply = await client.chat.completions.create(
            model="fp32-model", messages=QUESTION, n=4, max_tokens=30, temperature=1.0, logprobs=True, seed=5,
            **kwargs,
        )  # fmt: skip
        return art.TrajectoryGroup(
            art.Trajectory(messages_and_choices=[*QUESTION, c], tools=kwargs.get("tools"), reward=float(i % 2))
            for i, c in enumerate(reply.choices)
        )

    forced = await group(tools=[CALC], tool_choice={"type": "function", "function": {"name": "calc"}})
    free = await group()
    tokenizer = trainer.engine.tokenizer
    forced_tokens = sum(
        sum(s.trained[1:]) for t in forced for s in trajectory_sequences(t, tokenizer) if any(s.trained[1:])
    )
    # the sampler's masked log-probs are there, and far from what the trainer computes for the unmasked policy
    masked = [lp for t in forced for lp in sampled_tokens(t.messages_and_choices[-1]).logprobs]
    assert forced_tokens > 20 and len(masked) == forced_tokens and not any(math.isnan(x) for x in masked)

    metrics = trainer.rl_step([forced, free], cap)
    assert metrics["skipped"] == 0.0
    # the forced call's tokens train at weight 1 and are counted apart; the free ones' ratio is 1 to rounding
    assert metrics["tokens_without_sampler_logprobs"] == forced_tokens
    assert metrics["is_ratio_mean"] == pytest.approx(1.0, abs=1e-3) and metrics["sampler_logprob_gap"] < 1e-3

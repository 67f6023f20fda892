"""Which choice an episode's reward is for (issue #37 item 16): with n > 1, the choice the agent went on with (its
next call's history says which, through the splice), never choice 0 by default; an episode ending with an n > 1 call
of differing choices is refused for training (and counted where a group leaves it out); and a prompt reuses only
the ids of its own tokenizer. The store cases are written as the gateway records calls (real SQLite); the gateway
case runs the real model behind the real loopback server."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from flywheel.gateway.client import EpisodeClient, GatewayError
from flywheel.gateway.export import AMBIGUOUS_CHOICE, AmbiguousChoiceError, episode_trajectory, trajectory_group
from flywheel.gateway.splice import Output, output_key, splice_prompt, tokenizer_key
from flywheel.inference.chat import render_prompt
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.loop.offpolicy import LeftOut, draw
from flywheel.store import Store, episodes
from flywheel.types import sampled_tokens

QUESTION = [{"role": "user", "content": "A colour?"}]


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
    yield store
    store.close()


def choice(index: int, text: str, ids: list[int]) -> dict[str, Any]:
    return {
        "index": index, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
        "token_ids": ids, "prompt_token_ids": [1, 2, 3], "temperature": 1.0,
        "logprobs": {"content": [{"token": "t", "logprob": -0.5, "top_logprobs": []} for _ in ids]},
    }  # fmt: skip


def episode(store: Store, calls: list[tuple[list[dict], dict | None]]) -> str:
    """A finished production episode of item "q1": each call's choices, and the (call position, choice) it continues."""
    with store.session() as s:
        e = episodes.create_episode(s, "ticket", split="production", meta={"item": {"id": "q1"}})
        ids: list[int] = []
        for choices, continues in calls:
            prefix = (ids[continues["call"]], continues["choice"], 1) if continues else (None, None, None)
            messages = QUESTION + ([choices[0]["message"], {"role": "user", "content": "Sure?"}] if continues else [])
            call = episodes.add_call(
                s, e.id, model="calc@production", step=3, request={"messages": messages},
                response={"choices": choices}, prompt_tokens=3, completion_tokens=2, latency_ms=1.0,
                prefix_call=prefix[0], prefix_choice=prefix[1], prefix_message=prefix[2], retokenized_turns=0,
                reward=None, text_only=False, upstream=None, deployment="calc@production",
            )  # fmt: skip
            ids.append(call.id)
        episodes.set_outcome(s, e.id, reward=1.0, finish=True)
    return e.id


def test_the_reward_goes_to_the_choice_continued_and_an_ambiguous_last_call_is_refused_and_counted(store):
    blue, red = choice(0, "blue", [7, 8]), choice(1, "red", [9, 10])
    continued = episode(store, [([blue, red], None), ([choice(0, "yes", [11])], {"call": 0, "choice": 1})])
    ambiguous = episode(store, [([blue, red], None)])
    alike = episode(store, [([blue, blue | {"index": 1}], None)])  # the same choice twice: nothing to tell apart
    with store.session() as s:
        found = {e: (episodes.get_episode(s, e), episodes.calls(s, e)) for e in (continued, ambiguous, alike)}

    trajectory = episode_trajectory(*found[continued])
    first = trajectory.messages_and_choices[1]  # the first call's output, put back as the Choice that produced it
    assert sampled_tokens(first).completion_ids == [9, 10] and first.message.content == "red"
    with pytest.raises(AmbiguousChoiceError, match=r"returned 2 different choices .* Ask n = 1"):
        episode_trajectory(*found[ambiguous])
    assert sampled_tokens(episode_trajectory(*found[alike]).messages_and_choices[-1]).completion_ids == [7, 8]

    group = trajectory_group(list(found.values()))
    assert {t.id for t in group} == {continued, alike} and group.metrics == {AMBIGUOUS_CHOICE: 1}
    with store.session() as s:
        drawn = draw(
            s, {"q1": [continued, ambiguous, alike]}, ["q1"], model="calc", base_model="base", step=4, per_group=9,
            max_staleness=2, used={},
        )  # fmt: skip
    assert set(drawn.answered) == {continued, alike} and drawn.left_out == {LeftOut.ambiguous_choice.value: 1}


def test_a_prompt_continues_the_first_of_alike_siblings_the_latest_call_and_only_its_own_tokenizers_ids(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = render_prompt(tokenizer, QUESTION)
    reply = {"role": "assistant", "content": "Blue."}
    key, own = output_key(QUESTION, None, reply), tokenizer_key(tokenizer)
    ids = tokenizer.encode("Blue.", add_special_tokens=False) + [eos]
    history = [*QUESTION, reply, {"role": "user", "content": "Sure?"}]

    def spliced(*outputs: Output) -> tuple[int | None, int | None, int]:
        found = splice_prompt(tokenizer, history, None, list(outputs))
        return found.prefix_call, found.prefix_choice, found.retokenized_turns

    siblings = [Output(5, 0, key, prompt + ids, True, own), Output(5, 1, key, prompt + ids, True, own)]
    assert spliced(*siblings) == (5, 0, 0)  # one call's alike choices: the first, as the trajectory trains it
    assert spliced(*siblings, Output(6, 1, key, prompt + ids, True, own)) == (6, 1, 0)  # a later call's: the latest
    # another tokenizer's ids (another model's), or ids whose tokenizer was not recorded, are never spliced in
    assert spliced(Output(5, 0, key, prompt + ids, True, "another-tokenizer")) == (None, None, 1)
    assert spliced(Output(5, 0, key, prompt + ids, True, None)) == (None, None, 1)


async def test_an_episode_ending_with_n_2_through_the_gateway_is_refused_for_training(backend: LocalBackend):
    async with EpisodeClient(backend.base_url.removesuffix("/v1")) as episode_client:
        e = await episode_client.create("task-n2-last")
        agent = openai.AsyncOpenAI(base_url=e.base_url, api_key="unused", max_retries=0)
        reply = await agent.chat.completions.create(
            model=EMBEDDED_MODEL, messages=QUESTION, n=2, max_tokens=6, temperature=1.0, seed=11
        )
        assert reply.choices[0].message.content != reply.choices[1].message.content  # two different answers
        await episode_client.finish(e.id, 1.0)
        with pytest.raises(GatewayError, match="2 different choices") as refused:
            await episode_client.trajectory(e.id)
        assert refused.value.status == 409
        group = await episode_client.group("task-n2-last")
        assert len(group) == 0 and group.metrics == {AMBIGUOUS_CHOICE: 1}

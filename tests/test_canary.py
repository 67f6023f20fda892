"""Canary and shadow traffic (flywheel/gateway/traffic.py, flywheel/store/arms.py): a production alias's episodes
split by a sticky hash between production and a canary; a shadow answering the same calls after the user's answer,
recorded in linked shadow episodes, bounded, its failures never seen by the user; the arms read back per
deployment. The store's part runs on SQLite and PostgreSQL; the gateway's on the session's engine registered as two
checkpoints of a model "canary-calc" (as tests/test_deployments.py does: no model loads) behind an app of the
test's own, whose traffic policy (``app.state.traffic``) the test reads. The gateway answers a call before its
commit (write-behind): a test reads an episode's calls once its gateway's queued calls are settled."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest

from flywheel.gateway.recorder import Gateway
from flywheel.gateway.traffic import CANARY, SHADOW, TrafficPolicy, arm_hash
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store, audit, deployments, episodes
from flywheel.store.arms import ARM_KEY, MIXED, SHADOW_OF_KEY, arms, mark_arm, shadow_episode, shadow_episode_id
from flywheel.store.deployments import NoRollbackError, UnknownDeploymentError
from flywheel.store.episodes import CallRecord
from flywheel.store.feedback import add_feedback
from flywheel.store.schema import Episode

MODEL = "canary-calc"
PRODUCTION, CANARY_ALIAS, SHADOW_ALIAS = f"{MODEL}@production", f"{MODEL}@canary", f"{MODEL}@shadow"
ASK = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 1, "temperature": 0}


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def deploy(store: Store, name: str, step: int, share: float | None = None) -> deployments.DeploymentRecord:
    with store.session() as s:
        return deployments.deploy(s, name, step, actor="ana", share=share)


def test_an_episode_side_is_a_stable_hash_of_its_id_and_shares_split_as_drawn():
    assert arm_hash("ep_fixed", CANARY) == arm_hash("ep_fixed", CANARY)  # no per-process salt (PYTHONHASHSEED)
    assert arm_hash("ep_fixed", CANARY) == pytest.approx(0.61057, abs=1e-5)  # the same in every process and release
    assert arm_hash("ep_fixed", CANARY) != arm_hash("ep_fixed", SHADOW)  # the canary's and shadow's draws differ
    draws = [arm_hash(f"ep_{i}", CANARY) for i in range(4000)]
    assert all(0 <= d < 1 for d in draws)
    assert 1000 < sum(d < 0.3 for d in draws) < 1400  # 1200 expected; sd 29


def test_arms_group_episodes_by_the_deployment_that_answered_with_rewards_and_feedback(store):
    """Store only: calls name the alias that answered; arms() puts an episode in that arm (two arms: mixed), with
    its reward and feedback by kind, over a window or since an audit event; another model's calls stay out (even
    one whose name differs by a LIKE wildcard)."""
    with store.session() as s:
        prod, canary, both = (
            episodes.create_episode(s, "t1", split="production", meta={"arm": "mine"}) for _ in range(3)
        )
        other = episodes.create_episode(s, "t1", split="production")
    call = dict(
        prefix_call=None, prefix_choice=None, prefix_message=None, retokenized_turns=0, reward=None, request={},
        response={}, prompt_tokens=1, completion_tokens=1, latency_ms=1.0, text_only=False, upstream=None,
    )  # fmt: skip

    def record(episode: str, deployment: str, step: int) -> None:
        with store.session() as s:
            episodes.add_call(s, episode, model=PRODUCTION, step=step, deployment=deployment, **call)
            mark_arm(s, episode, deployment)

    record(prod.id, PRODUCTION, 3)
    record(canary.id, CANARY_ALIAS, 5)
    record(both.id, CANARY_ALIAS, 5)
    event = deploy(store, CANARY_ALIAS, 5, share=0.0).event_id  # the canary stopped: later calls are production's
    record(both.id, PRODUCTION, 3)
    record(other.id, "canary_calc@production", 3)  # "canary_calc" would match "canary-calc" as a LIKE pattern
    with store.session() as s:
        episodes.set_outcome(s, canary.id, reward=0.25, finish=True)
        add_feedback(s, canary.id, kind="rating", value=4)
        add_feedback(s, canary.id, kind="rating", value=5)
        add_feedback(s, canary.id, kind="resolved", value=1)
        report = arms(s, MODEL)
        assert sorted(report.arms) == [CANARY_ALIAS, PRODUCTION]
        assert [e.id for e in report.arms[PRODUCTION].episodes] == [prod.id]
        (c,) = report.arms[CANARY_ALIAS].episodes
        assert (c.id, c.reward, c.status, c.steps, c.feedback) == (
            canary.id, 0.25, "finished", [5], {"rating": [4.0, 5.0], "resolved": [1.0]},
        )  # fmt: skip
        assert report.arms[CANARY_ALIAS].rewards == [0.25] and report.arms[PRODUCTION].rewards == []
        assert [e.id for e in report.mixed] == [both.id]
        assert [episodes.get_episode(s, e).meta for e in (prod.id, canary.id, both.id)] == [
            {"arm": "mine", ARM_KEY: PRODUCTION},
            {"arm": "mine", ARM_KEY: CANARY_ALIAS},
            {"arm": "mine", ARM_KEY: MIXED},
        ]  # fmt: skip  (the creator's own "arm" is theirs: the gateway's key cannot collide with it)
        since = arms(s, MODEL, since_event=event)  # only what was answered after the canary was stopped
        assert {a: [e.id for e in arm.episodes] for a, arm in since.arms.items()} == {PRODUCTION: [both.id]}
        assert since.mixed == [] and since.since is not None
        assert arms(s, MODEL, until=datetime.now(UTC) - timedelta(hours=1)).arms == {}
        with pytest.raises(ValueError, match="no audit event 999"):
            arms(s, MODEL, since_event=999)


def test_a_shadow_episode_is_one_per_production_episode_and_a_removed_alias_is_audited(store):
    with store.session() as s:
        origin = episodes.create_episode(s, "t1", split="production", meta={"user": "u1"})
        first = shadow_episode(s, origin.id, SHADOW_ALIAS)
        again = shadow_episode(s, origin.id, SHADOW_ALIAS)
    assert first.id == again.id == shadow_episode_id(origin.id) and first.id != origin.id
    assert (first.split, first.task_id) == ("shadow", "t1")
    assert first.meta == {SHADOW_OF_KEY: origin.id, ARM_KEY: SHADOW_ALIAS}
    deploy(store, CANARY_ALIAS, 4, share=0.1)
    with store.session() as s:
        event = deployments.remove(s, CANARY_ALIAS, actor="bo", reason="regressed")
        assert (event.action, event.details["previous_step"], event.details["previous_share"]) == ("remove", 4, 0.1)
        assert deployments.find(s, CANARY_ALIAS) is None and audit.verify(s).ok
        with pytest.raises(UnknownDeploymentError):
            deployments.remove(s, CANARY_ALIAS, actor="bo")
    deploy(store, CANARY_ALIAS, 6, share=0.2)  # deployed again: its history starts over
    with store.session() as s, pytest.raises(NoRollbackError):
        deployments.rollback_target(s, CANARY_ALIAS)


@pytest.fixture
async def gateway(backend: LocalBackend):
    """An app of the test's own over the session's registry and store, serving "canary-calc@3" and "@5" (the base
    engine under those names); yields (its traffic policy, its root URL, the store, its gateway)."""
    engine = backend.engine(EMBEDDED_MODEL)
    for step in (3, 5):
        backend.registry.add(f"{MODEL}@{step}", engine, step=step)
    assert backend.gateway is not None
    store = backend.gateway.store
    app = create_app(backend.registry, backend.gateway)
    server = BackgroundServer(app).start()
    traffic: TrafficPolicy = app.state.traffic
    try:
        yield traffic, f"http://{server.host}:{server.port}", store, backend.gateway
    finally:
        await traffic.drain()
        server.stop()
        with store.session() as s:
            for d in deployments.list_deployments(s, MODEL):
                deployments.remove(s, d.name, actor="test")
        for step in (3, 5):
            backend.registry.remove(f"{MODEL}@{step}")


async def new_episodes(store: Store, n: int) -> list[str]:
    def create(s) -> list[str]:
        return [episodes.create_episode(s, "canary-task", split="production").id for _ in range(n)]

    return await store.run(create)


def agent(root: str, episode: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{root}/episodes/{episode}/v1", api_key="unused", max_retries=0)


async def calls(gateway: Gateway, episode: str) -> list[CallRecord]:
    """The episode's calls, once those its gateway answered are committed."""
    await gateway.settled(episode)
    return await gateway.store.run(episodes.calls, episode)


async def recorded(gateway: Gateway, episode: str) -> list[tuple[str | None, int | None]]:
    return [(c.deployment, c.step) for c in await calls(gateway, episode)]


async def test_a_canary_answers_a_sticky_share_of_episodes_and_hands_them_back_when_stopped(gateway):
    traffic, root, store, recorder = gateway
    deploy(store, PRODUCTION, 3)
    deploy(store, CANARY_ALIAS, 5, share=0.5)
    episode_ids = await new_episodes(store, 40)

    async def run(episode: str, calls: int) -> None:
        client = agent(root, episode)
        for _ in range(calls):
            reply = await client.chat.completions.create(model=PRODUCTION, **ASK)
            assert reply.model == PRODUCTION  # whoever answered, the agent sees the name it asked for

    await asyncio.gather(*(run(e, 1) for e in episode_ids))
    first = {e: await recorded(recorder, e) for e in episode_ids}
    on_canary = {e for e, calls in first.items() if calls == [(CANARY_ALIAS, 5)]}
    on_production = {e for e, calls in first.items() if calls == [(PRODUCTION, 3)]}
    assert on_canary | on_production == set(episode_ids)
    assert on_canary == {e for e in episode_ids if arm_hash(e, CANARY) < 0.5}  # the side its id hashes to
    assert 8 <= len(on_canary) <= 32  # binomial(40, 0.5): 20 expected, sd 3.2
    again = sorted(on_canary)[:4] + sorted(on_production)[:4]  # a later call of an episode: on its side again
    await asyncio.gather(*(run(e, 2) for e in again))
    await traffic.drain(followed=40 + 2 * len(again))
    for e in again:
        assert await recorded(recorder, e) == first[e] * 3
    with store.session() as s:
        assert {e: episodes.get_episode(s, e).meta[ARM_KEY] for e in episode_ids} == {
            e: CANARY_ALIAS if e in on_canary else PRODUCTION for e in episode_ids
        }
        report = arms(s, MODEL, since_event=deployments.get(s, CANARY_ALIAS).event_id)
    assert {e.id for e in report.arms[CANARY_ALIAS].episodes} == on_canary
    assert {e.id for e in report.arms[PRODUCTION].episodes} == on_production and report.mixed == []

    canaries = sorted(on_canary)[:3]
    deploy(store, CANARY_ALIAS, 5, share=0.0)  # share 0: production answers from the next request on
    await asyncio.gather(*(run(e, 1) for e in canaries))
    assert [(await recorded(recorder, e))[-1] for e in canaries] == [(PRODUCTION, 3)] * 3
    await traffic.drain(followed=40 + 2 * len(again) + 3)
    with store.session() as s:
        assert {episodes.get_episode(s, e).meta[ARM_KEY] for e in canaries} == {MIXED}

    deploy(store, CANARY_ALIAS, 5, share=1.0)  # every episode, and every call without one
    fresh = (await new_episodes(store, 1))[0]
    await run(fresh, 1)
    assert await recorded(recorder, fresh) == [(CANARY_ALIAS, 5)]
    before = traffic.counts.canary
    plain = openai.AsyncOpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0)
    assert (await plain.chat.completions.create(model=PRODUCTION, **ASK)).choices
    assert traffic.counts.canary == before + 1
    with store.session() as s:
        deployments.remove(s, CANARY_ALIAS, actor="ana", reason="regressed")  # removed: production again
    await run(fresh, 1)
    assert (await recorded(recorder, fresh))[-1] == (PRODUCTION, 3)
    deploy(store, CANARY_ALIAS, 7, share=1.0)  # a checkpoint nothing serves: production answers, not a 404
    await run(fresh, 1)
    assert (await recorded(recorder, fresh))[-1] == (PRODUCTION, 3) and traffic.counts.canary_unserved == 1


async def test_a_shadow_answers_the_same_calls_after_the_user_in_a_linked_episode(gateway):
    traffic, root, store, recorder = gateway
    deploy(store, PRODUCTION, 3)
    alone, shadowed = await new_episodes(store, 2)
    turns = [
        ASK["messages"],
        [*ASK["messages"], {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3 + 4?"}],
    ]

    answered = 0

    async def converse(episode: str) -> list[str | None]:
        nonlocal answered
        client = agent(root, episode)
        answers = []
        for messages in turns:
            reply = await client.chat.completions.create(
                model=PRODUCTION, **{**ASK, "messages": messages, "max_tokens": 2}
            )
            answers.append(reply.choices[0].message.content)
            answered += 1
            await traffic.drain(followed=answered)  # its shadow ends before the next call starts
        return answers

    without = await converse(alone)
    deploy(store, SHADOW_ALIAS, 5, share=1.0)
    assert await converse(shadowed) == without  # temperature 0: the shadow changes nothing the user sees
    assert traffic.counts.mirrored == 2 and traffic.counts.shadow_failed == 0
    with store.session() as s:
        assert s.get(Episode, shadow_episode_id(alone)) is None  # no shadow deployed then: none created
        shadow = episodes.get_episode(s, shadow_episode_id(shadowed))
    production_calls, shadow_calls = await calls(recorder, shadowed), await calls(recorder, shadow.id)
    assert (shadow.split, shadow.meta[SHADOW_OF_KEY], shadow.task_id) == ("shadow", shadowed, "canary-task")
    assert [(c.deployment, c.step) for c in production_calls] == [(PRODUCTION, 3)] * 2
    assert [(c.deployment, c.step) for c in shadow_calls] == [(SHADOW_ALIAS, 5)] * 2
    assert [c.request["messages"] for c in shadow_calls] == [c.request["messages"] for c in production_calls]
    assert [c.request["messages"] for c in shadow_calls] == turns

    # Its id is derived from the production episode's, which the agent knows: the agent cannot call into it.
    with pytest.raises(openai.NotFoundError, match="No episode with id"):
        await agent(root, shadow.id).chat.completions.create(model=PRODUCTION, **ASK)
    plain = openai.AsyncOpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="No episode with id"):
        await plain.chat.completions.create(model=SHADOW_ALIAS, **ASK, extra_headers={"X-Flywheel-Episode": shadow.id})
    assert await recorded(recorder, shadow.id) == [(SHADOW_ALIAS, 5)] * 2  # nothing more recorded there


async def test_an_episode_creator_cannot_set_the_gateways_meta_keys(gateway):
    _, root, store, _ = gateway
    async with httpx.AsyncClient(base_url=root) as http:
        refused = await http.post("/episodes", json={"task_id": "t1", "metadata": {"a": 1, ARM_KEY: "calc@canary"}})
        assert refused.status_code == 400
        assert f"metadata key '{ARM_KEY}' is reserved" in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == "metadata"
        created = await http.post("/episodes", json={"task_id": "t1", "metadata": {"arm": "mine"}})
    assert created.status_code == 201 and created.json()["meta"] == {"arm": "mine"}


async def test_a_failing_shadow_is_counted_never_seen_and_shadow_work_is_bounded(gateway):
    """A shadow at a checkpoint that cannot be served (step 7: none) fails after each answer, which the user never
    sees; with max_in_flight shadow calls running, one more is dropped and counted."""
    traffic, root, store, recorder = gateway
    deploy(store, PRODUCTION, 3)
    deploy(store, SHADOW_ALIAS, 7, share=1.0)
    episode, *burst = await new_episodes(store, 7)
    reply = await agent(root, episode).chat.completions.create(model=PRODUCTION, **ASK)
    assert reply.choices[0].finish_reason == "length" and reply.model == PRODUCTION
    await traffic.drain(followed=1)
    assert (traffic.counts.shadow_failed, traffic.counts.mirrored) == (1, 0)
    assert await recorded(recorder, episode) == [(PRODUCTION, 3)]
    assert await recorded(recorder, shadow_episode_id(episode)) == []

    deploy(store, SHADOW_ALIAS, 5, share=1.0)
    traffic.max_in_flight = 0  # no room: every shadow call is dropped
    await agent(root, burst[0]).chat.completions.create(model=PRODUCTION, **ASK)
    await traffic.drain(followed=2)
    assert traffic.counts.shadow_dropped == 1 and traffic.counts.mirrored == 0
    with store.session() as s:
        assert s.get(Episode, shadow_episode_id(burst[0])) is None
    traffic.max_in_flight = 1
    await asyncio.gather(*(agent(root, e).chat.completions.create(model=PRODUCTION, **ASK) for e in burst[1:]))
    await traffic.drain(followed=7)
    counts = traffic.counts
    assert counts.peak_in_flight == 1 and counts.mirrored >= 1
    assert counts.mirrored + counts.shadow_dropped == 1 + len(burst[1:])  # each call mirrored or dropped, once

"""Outcome feedback that arrives after an episode (a resolution, a rating, a KPI): in the store on SQLite and
PostgreSQL, and through the episode API on a real loopback server (no model: the episode API needs none)."""

from __future__ import annotations

import httpx
import pytest

from flywheel.gateway.client import EpisodeClient, GatewayError
from flywheel.gateway.recorder import Gateway
from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import EpisodeConflictError, Store, UnknownEpisodeError, episodes, feedback


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def test_feedback_is_appended_in_any_state_and_a_key_makes_a_repost_harmless(store: Store):
    with store.session() as s:
        done, dropped = episodes.create_episode(s, "t1"), episodes.create_episode(s, "t2")
        episodes.set_outcome(s, done.id, reward=1.0, finish=True)
        episodes.abandon(s, dropped.id, "runner gone")
    with store.session() as s:
        first, created = feedback.add_feedback(s, done.id, kind="resolved", value=1.0, source="crm", key="crm-77")
        again, created_again = feedback.add_feedback(s, done.id, kind="resolved", value=1.0, source="crm", key="crm-77")
        feedback.add_feedback(s, done.id, kind="rating", value=2.0, note="slow answer")
        feedback.add_feedback(s, done.id, kind="rating", value=2.0, note="slow answer")  # no key: two ratings
        feedback.add_feedback(s, dropped.id, kind="kpi/reopened", value=1.0)
    assert created and not created_again and again == first
    with store.session() as s:
        rows = feedback.feedback_of(s, done.id)
        assert [(r.kind, r.value, r.key) for r in rows] == [("resolved", 1.0, "crm-77"), ("rating", 2.0, None), ("rating", 2.0, None)]  # fmt: skip
        assert episodes.get_episode(s, done.id).reward == 1.0  # the reward it trained on is not changed by feedback
        assert [r.kind for r in feedback.feedback_of(s, dropped.id)] == ["kpi/reopened"]
    with store.session() as s, pytest.raises(EpisodeConflictError, match="crm-77.*already posted with other content"):
        feedback.add_feedback(s, done.id, kind="resolved", value=0.0, source="crm", key="crm-77")
    with store.session() as s, pytest.raises(ValueError, match="nan"):
        feedback.add_feedback(s, done.id, kind="rating", value=float("nan"))
    with store.session() as s, pytest.raises(UnknownEpisodeError):
        feedback.add_feedback(s, "no-such-episode", kind="rating", value=1.0)
    with store.session() as s:
        assert len(feedback.feedback_of(s, done.id)) == 3  # nothing half-written by the refused ones


@pytest.fixture
def server(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'f.db'}")
    server = BackgroundServer(create_app(ModelRegistry(), Gateway(store))).start()
    yield server.base_url.removesuffix("/v1")
    server.stop()
    store.close()


async def test_feedback_through_the_episode_api(server: str):
    async with EpisodeClient(server) as client:
        episode = await client.create("ticket-9", split="production")
        await client.finish(episode.id, 0.0)
        posted = await client.feedback(episode.id, "resolved", 1.0, source="crm", key="c-1")
        assert (posted["kind"], posted["value"], posted["source"]) == ("resolved", 1.0, "crm")
        assert (await client.feedback(episode.id, "resolved", 1.0, source="crm", key="c-1"))["id"] == posted["id"]
        with pytest.raises(GatewayError) as conflict:
            await client.feedback(episode.id, "resolved", 0.0, source="crm", key="c-1")
        assert conflict.value.status == 409
        with pytest.raises(GatewayError) as unknown:
            await client.feedback("nope", "resolved", 1.0)
        assert unknown.value.status == 404
        assert [f["id"] for f in await client.feedback_of(episode.id)] == [posted["id"]]
    async with httpx.AsyncClient(base_url=server) as http:
        url = f"/episodes/{episode.id}/feedback"
        again = await http.post(url, json={"kind": "resolved", "value": 1.0, "source": "crm", "key": "c-1"})
        assert again.status_code == 200  # a repost: not created
        for body, where in (
            ({"value": 1.0}, "kind"),
            ({"kind": "rating", "value": "good"}, "value"),
            ({"kind": "rating", "value": 1.0, "extra": 1}, "extra"),
        ):
            bad = await http.post(url, json=body)
            assert bad.status_code == 400 and where in bad.text, bad.text
        nan = await http.post(url, content=b'{"kind": "rating", "value": NaN}', headers={"content-type": "application/json"})  # fmt: skip
        assert nan.status_code == 400 and "finite" in nan.text, nan.text
        assert len((await http.get(url)).json()["data"]) == 1

"""Cost per episode (flywheel/store/costs.py): recorded token counts times the configured price of the deployment or
model that answered (0 for the local engine), in the arms report (store only) and in the episode API (the session's
server, its gateway's prices set for the test; calls written to the store as the gateway records them: no model
runs)."""

from __future__ import annotations

import httpx
import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.gateway.client import EpisodeClient
from flywheel.local.backend import LocalBackend
from flywheel.store import Store, episodes
from flywheel.store.arms import arms
from flywheel.store.costs import Price, Prices, usage
from flywheel.types import Usage

PRICES = Prices(
    currency="EUR",
    models={
        "calc@canary": Price(prompt=1.0, completion=2.0),  # a deployment: what it costs to serve
        "gpt-x": Price(prompt=10.0, completion=30.0),  # an upstream's model
        "calc": Price(prompt=0.5, completion=0.5),  # any other name of the model
    },
)


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
    yield store
    store.close()


def call(s, episode: str, model: str, deployment: str | None, prompt: int, completion: int) -> None:
    episodes.add_call(
        s, episode, model=model, step=1, request={}, response={}, prompt_tokens=prompt, completion_tokens=completion,
        latency_ms=2.5, prefix_call=None, prefix_choice=None, prefix_message=None, retokenized_turns=0, reward=None,
        deployment=deployment,
    )  # fmt: skip


def test_a_call_is_priced_by_its_deployment_then_its_name_then_its_model_else_free():
    assert PRICES.price("calc@production", "calc@canary") == Price(prompt=1.0, completion=2.0)  # the canary answered
    assert PRICES.price("gpt-x") == Price(prompt=10.0, completion=30.0)
    assert PRICES.price("calc@3") == PRICES.price("calc@production", "calc@production") == Price(prompt=0.5, completion=0.5)  # fmt: skip
    assert PRICES.price("local-model") == Price()  # the local engine: no price per token
    assert PRICES.cost("gpt-x", None, 1000, 2000) == pytest.approx((1000 * 10 + 2000 * 30) / 1e6)


def test_the_arms_report_gives_each_episode_its_usage_and_each_arm_its_cost_per_episode(store):
    with store.session() as s:
        canary, production, upstream, empty = (episodes.create_episode(s, "t", split="production").id for _ in range(4))
        call(s, canary, "calc@production", "calc@canary", 1_000_000, 500_000)  # 1.0 + 1.0
        call(s, canary, "calc@production", "calc@canary", 0, 1_000_000)  # + 2.0
        call(s, production, "calc@production", "calc@production", 2_000_000, 0)  # 0.5 * 2
        call(s, upstream, "gpt-x", None, 100, 100)
        report = arms(s, "calc", prices=PRICES)
        used = usage(s, [canary, upstream, empty], PRICES)
    (c,) = report.arms["calc@canary"].episodes
    assert (c.usage.calls, c.usage.prompt_tokens, c.usage.completion_tokens) == (2, 1_000_000, 1_500_000)
    assert (c.usage.cost, c.usage.currency, c.usage.latency_ms) == (4.0, "EUR", 5.0)
    assert report.arms["calc@canary"].cost_per_episode == 4.0
    assert report.arms["calc@production"].cost_per_episode == 1.0
    assert used[upstream].cost == pytest.approx(0.004) and used[empty].calls == 0 and used[empty].cost == 0
    with store.session() as s:  # no prices given: tokens counted, every cost 0
        assert arms(s, "calc").arms["calc@canary"].episodes[0].usage.cost == 0.0


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("models:\n  gpt-x: {prompt: -1}\n", "models.gpt-x.prompt: Input should be greater than or equal to 0"),
        ("models:\n  gpt-x: {input: 1}\n", "models.gpt-x.input: Extra inputs are not permitted"),
        ("models: [1, 2\n", "cannot read it"),
    ],
)
def test_a_broken_prices_file_is_refused_naming_the_file_and_the_field(tmp_path, monkeypatch, text, says):
    path = tmp_path / "prices.yaml"
    path.write_text(text)
    monkeypatch.setenv("FLYWHEEL_PRICES", str(path))
    with pytest.raises(ValueError, match="prices file .*prices.yaml: ") as refused:
        Prices.from_env()
    assert says in str(refused.value)
    path.write_text("currency: USD\nmodels:\n  gpt-x: {prompt: 2.5, completion: 10}\n")
    assert Prices.from_env().price("gpt-x") == Price(prompt=2.5, completion=10)


def test_flywheel_serve_refuses_a_broken_prices_file_before_loading_the_model(tmp_path):
    (path := tmp_path / "prices.yaml").write_text("models:\n  gpt-x: {prompt: -1}\n")
    env = {"FLYWHEEL_PRICES": str(path), "COLUMNS": "200"}
    run = CliRunner().invoke(
        app, ["serve", "--model", "no-such-model", "--db", f"sqlite:///{tmp_path / 'f.db'}"], env=env
    )
    assert run.exit_code == 2 and "prices.yaml: models.gpt-x.prompt" in run.output, run.output
    assert "no-such-model" not in run.output and "Traceback" not in run.output  # refused before the model loads


async def test_the_episode_api_reports_an_episodes_usage_and_cost(backend: LocalBackend, monkeypatch):
    gateway = backend.gateway
    monkeypatch.setattr(gateway, "prices", PRICES)
    root = backend.base_url.removesuffix("/v1")
    async with EpisodeClient(root) as episode_client:
        created = await episode_client.create("cost-task", split="production")
        assert created.usage == Usage(currency="EUR")  # typed: calls, tokens, latency and cost all 0
        with gateway.store.session() as s:
            call(s, created.id, "calc@production", "calc@canary", 1_000_000, 1_000_000)
        finished = await episode_client.finish(created.id, 1.0)
        listed = [e for e in await episode_client.list(task_id="cost-task") if e.id == created.id]
    assert finished.usage is not None and (finished.usage.cost, finished.usage.calls) == (3.0, 1)
    assert [e.usage for e in listed] == [finished.usage]
    async with httpx.AsyncClient(base_url=root) as http:  # on the wire, as before: a plain object
        wire = (await http.get(f"/episodes/{created.id}")).json()["usage"]
    assert wire == {"calls": 1, "prompt_tokens": 1_000_000, "completion_tokens": 1_000_000, "latency_ms": 2.5,
                    "cost": 3.0, "currency": "EUR"}  # fmt: skip
    assert wire == finished.usage.model_dump()

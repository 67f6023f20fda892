"""Deployments (flywheel/store/deployments.py): aliases switched with their audit event, atomically, on SQLite and
PostgreSQL; the gateway serving an alias (the session's backend, no model load); and ``flywheel deploy | promote |
rollback | deployments | audit`` in-process (their checkpoints are tiny ones written by ``RunStore``)."""

from __future__ import annotations

import openai
import pytest
import torch
from sqlalchemy import func, select, text
from typer.testing import CliRunner

from flywheel.checkpoints.layout import model_path
from flywheel.checkpoints.run import RunStore
from flywheel.cli import app
from flywheel.gateway.client import EpisodeClient
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.store import Store, audit, deployments
from flywheel.store.deployments import InvalidAliasError, NoRollbackError, UnknownDeploymentError
from flywheel.store.schema import AuditEvent, Deployment
from flywheel.train.checkpoint import Checkpoint, CheckpointState
from flywheel.train.config import TrainedWeights

from helpers import at_once


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def deploy(store: Store, name: str, step: int, **kw) -> deployments.DeploymentRecord:
    with store.session() as s:
        return deployments.deploy(s, name, step, actor=kw.pop("actor", "ana"), **kw)


def counts(store: Store) -> tuple[int, int]:
    """(deployments, audit events)."""
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(Deployment)), s.scalar(
            select(func.count()).select_from(AuditEvent)
        )


def test_switches_promotion_and_rollbacks_follow_the_alias_history_in_the_audit_chain(store):
    first = deploy(store, "calc@production", 1, reason="the first good one")
    assert (first.model, first.stage, first.step, first.share, first.target) == (
        "calc",
        "production",
        1,
        None,
        "calc@1",
    )
    deploy(store, "calc@production", 2)
    deploy(store, "calc@canary", 4, share=0.1)
    with store.session() as s:
        promoted = deployments.promote(s, "calc", actor="bo", reason="canary held up")
    assert (promoted.name, promoted.step, promoted.share, promoted.updated_by) == ("calc@production", 4, None, "bo")
    with store.session() as s:
        assert deployments.get(s, "calc@canary").step == 4  # a promotion leaves the canary where it is
        history = deployments.history(s, "calc@production")
        assert [(e.action, e.details["previous_step"], e.details["step"]) for e in history] == [
            ("deploy", None, 1),
            ("deploy", 1, 2),
            ("promote", 2, 4),
        ]
        assert history[-1].details["from"] == "calc@canary" and history[-1].id == promoted.event_id
        assert history[0].reason == "the first good one"
        # rolling back walks back through the moves: 4 -> 2 -> 1, then there is nothing left
        for expected in (2, 1):
            step, share = deployments.rollback_target(s, "calc@production")
            assert (step, share) == (expected, None)
            deployments.deploy(s, "calc@production", step, actor="ana", share=share, action="rollback")
        with pytest.raises(NoRollbackError, match="no earlier step"):
            deployments.rollback_target(s, "calc@production")
        assert deployments.get(s, "calc@production").step == 1
        assert [d.name for d in deployments.list_deployments(s, "calc")] == ["calc@canary", "calc@production"]
        report = audit.verify(s)
    assert report.ok and report.count == 6, report


def test_a_failure_inside_the_switch_leaves_neither_the_alias_nor_its_event(store):
    with pytest.raises(RuntimeError, match="killed"), store.session() as s:
        deployments.deploy(s, "calc@production", 3, actor="ana")
        raise RuntimeError("killed between the switch and the commit")
    assert counts(store) == (0, 0)
    deploy(store, "calc@production", 1)
    with pytest.raises(RuntimeError, match="killed"), store.session() as s:
        deployments.deploy(s, "calc@production", 3, actor="ana")
        raise RuntimeError("killed between the switch and the commit")
    with store.session() as s:
        assert deployments.get(s, "calc@production").step == 1
        assert len(audit.events(s)) == 1 and audit.verify(s).ok


@pytest.mark.parametrize("name", ["calc", "calc@3", "@production", "calc@Production", "calc@", "calc@canary 2"])
def test_a_malformed_alias_is_refused_and_nothing_is_written(store, name):
    with pytest.raises(InvalidAliasError, match="MODEL@|is not a stage"), store.session() as s:
        deployments.deploy(s, name, 1, actor="ana")
    assert not deployments.is_alias(name)
    assert counts(store) == (0, 0)


def test_bad_steps_shares_and_unknown_deployments_are_refused_and_nothing_is_written(store):
    with store.session() as s:
        with pytest.raises(ValueError, match="step must be"):
            deployments.deploy(s, "calc@production", -1, actor="ana")
        with pytest.raises(ValueError, match="share must be"):
            deployments.deploy(s, "calc@canary", 1, actor="ana", share=1.5)
        with pytest.raises(ValueError, match="share must be"):
            deployments.deploy(s, "calc@canary", 1, actor="ana", share=float("nan"))
        with pytest.raises(UnknownDeploymentError, match="'calc@canary' does not exist"):
            deployments.promote(s, "calc", actor="ana")
        with pytest.raises(UnknownDeploymentError):
            deployments.rollback_target(s, "calc@production")
    assert counts(store) == (0, 0)
    deploy(store, "calc@production", 1)
    with (
        store.session() as s,
        pytest.raises(UnknownDeploymentError, match="Deployments of that model: calc@production"),
    ):
        deployments.get(s, "calc@shadow")


def test_concurrent_switches_of_one_alias_each_record_the_step_they_replaced(store):
    """Several writers switch one alias at once: each event's previous step is the step the event before it set
    (what a switch reads is still true when it writes), and the chain verifies."""
    threads, each = 4, 5

    def work(t: int) -> None:
        for i in range(each):
            deploy(store, "calc@production", 100 * t + i, actor=f"writer-{t}")

    _, errors = at_once(threads, work)
    assert not errors, errors
    with store.session() as s:
        history = deployments.history(s, "calc@production")
        current = deployments.get(s, "calc@production")
        assert audit.verify(s).ok
    assert len(history) == threads * each
    assert [e.details["previous_step"] for e in history] == [None] + [e.details["step"] for e in history[:-1]]
    assert current.step == history[-1].details["step"] and current.event_id == history[-1].id


async def test_the_gateway_answers_an_alias_with_the_checkpoint_it_points_at_and_records_which(backend: LocalBackend):
    """Two served checkpoints of a model "dep-calc" (steps 3 and 5: the base engine registered under those names,
    as the backend registers a checkpoint engine, so no model loads): a call for dep-calc@production is answered
    by the step the alias points at, its record names that step and the alias, and a switch holds from the next
    request on."""
    engine = backend.engine(EMBEDDED_MODEL)
    for step in (3, 5):
        backend.registry.add(f"dep-calc@{step}", engine, step=step)
    assert backend.gateway is not None
    store = backend.gateway.store
    try:
        deploy(store, "dep-calc@production", 3)
        root = backend.base_url.removesuffix("/v1")
        async with EpisodeClient(root) as episodes:
            episode = await episodes.create("task-deployment")
            agent = openai.AsyncOpenAI(base_url=episode.base_url, api_key="unused", max_retries=0)
            ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            reply = await agent.chat.completions.create(model="dep-calc@production", **ask)
            assert reply.model == "dep-calc@production"
            deploy(store, "dep-calc@production", 5)  # no restart: the next request sees it
            await agent.chat.completions.create(model="dep-calc@production", **ask)
            await agent.chat.completions.create(model="dep-calc@3", **ask)  # a checkpoint by its step: no alias
            recorded = await episodes.calls(episode.id)
        assert [(c["model"], c["step"], c["deployment"]) for c in recorded] == [
            ("dep-calc@production", 3, "dep-calc@production"),
            ("dep-calc@production", 5, "dep-calc@production"),
            ("dep-calc@3", 3, None),
        ]
        plain = openai.AsyncOpenAI(base_url=backend.base_url, api_key="unused", max_retries=0)
        assert (await plain.chat.completions.create(model="dep-calc@production", **ask)).choices  # no episode
        with pytest.raises(openai.NotFoundError) as refused:
            await plain.chat.completions.create(model="dep-calc@shadow", **ask)
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_found" and error["param"] == "model"
        assert "'dep-calc@shadow' does not exist" in error["message"] and "dep-calc@production" in error["message"]
    finally:
        for step in (3, 5):
            backend.registry.remove(f"dep-calc@{step}")


@pytest.fixture
def cli(tmp_path):
    """``flywheel`` in-process on a home whose model "calc" (project "demo") has checkpoints 1, 2 and 3."""
    run = RunStore(model_path(tmp_path, "demo", "calc"))
    for step in (1, 2, 3):
        state = CheckpointState(step=step, trained_weights=TrainedWeights())
        run.write(Checkpoint(state=state, weights={"w": torch.zeros(2)}))
    db = f"sqlite:///{tmp_path / 'flywheel.db'}"
    runner = CliRunner()

    def flywheel(*args: str, actor: str | None = "ana"):
        where = ["--db", db] + (["--home", str(tmp_path)] if args[0] in ("deploy", "promote", "rollback") else [])
        who = ["--actor", actor] if actor and args[0] in ("deploy", "promote", "rollback") else []
        return runner.invoke(app, [*args, *where, *who], env={"USER": "", "COLUMNS": "200"}, catch_exceptions=False)

    flywheel.db = db  # type: ignore[attr-defined]
    return flywheel


def test_the_cli_deploys_promotes_rolls_back_and_shows_the_audit_trail(cli):
    assert cli("deploy", "calc@production", "--step", "1", "--why", "baseline").exit_code == 0
    result = cli("deploy", "calc@canary", "--step", "3", "--share", "0.25")
    assert result.exit_code == 0 and "calc@canary -> step 3, 25% of its traffic" in result.output
    assert "nothing changed" in cli("deploy", "calc@canary", "--step", "3", "--share", "0.25").output
    result = cli("promote", "calc", "--from", "canary", "--to", "production", "--why", "canary looks good")
    assert result.exit_code == 0 and "calc@production -> step 3, promoted from calc@canary" in result.output
    result = cli("rollback", "calc@production", "--why", "errors up")
    assert result.exit_code == 0 and "calc@production -> step 1, back from step 3" in result.output
    listed = cli("deployments")
    assert listed.exit_code == 0 and "calc@production" in listed.output and "25%" in listed.output
    shown = cli("audit", "--limit", "10")
    assert shown.exit_code == 0
    for line in ("deploy", "promote", "rollback", "step 3 -> 1", "canary looks good", "errors up", "ana"):
        assert line in shown.output, shown.output
    verified = cli("audit", "verify")
    assert verified.exit_code == 0 and "OK: 4 events" in verified.output
    store = Store(cli.db)
    try:
        with store.session() as s:
            s.execute(text("UPDATE audit_events SET reason = 'all fine' WHERE id = 4"))
    finally:
        store.close()
    broken = cli("audit", "verify")
    assert broken.exit_code == 1 and "row 4" in broken.output, broken.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("deploy", "calc@7", "--step", "1"), "is not a stage"),
        (("deploy", "calc", "--step", "1"), "MODEL@STAGE"),
        (("deploy", "calc@production", "--step", "9"), "'calc' has no checkpoint 9 (its checkpoints: 1, 2, 3)"),
        (("deploy", "nope@production", "--step", "1"), "No model 'nope'"),
        (("deploy", "calc@canary", "--step", "1", "--share", "2"), "--share must be from 0 to 1"),
        (("promote", "calc"), "'calc@canary' does not exist"),
        (("rollback", "calc@production"), "'calc@production' does not exist"),
        (("deploy", "calc@production", "--step", "1", "--project", "other"), "No model 'calc'"),
    ],
)
def test_the_cli_refuses_bad_input_in_one_line_and_writes_nothing(cli, args, says):
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert says in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert "OK: 0 events" in cli("audit", "verify").output


def test_the_cli_wants_an_actor_and_a_rollback_needs_an_earlier_step(cli):
    result = cli("deploy", "calc@production", "--step", "1", actor=None)
    assert result.exit_code == 2 and "--actor" in result.output
    assert cli("deploy", "calc@production", "--step", "1").exit_code == 0
    result = cli("rollback", "calc@production")
    assert result.exit_code == 2 and "no earlier step" in result.output
    assert "OK: 1 events" in cli("audit", "verify").output


@pytest.mark.parametrize("command", [["audit"], ["deployments"], ["graders", "regress", "a.yaml", "b.yaml"]])
def test_a_store_that_cannot_be_opened_is_one_line_without_its_password(command, tmp_path):
    url = f"postgresql://flywheel:s3cret@127.0.0.1:1/db?host={tmp_path}"  # nothing listens there
    result = CliRunner().invoke(app, [*command, "--db", url], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "Cannot open the store" in result.output and "s3cret" not in result.output
    assert "Traceback" not in result.output

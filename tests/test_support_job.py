"""The support job's parts, cheaply: the database (store only, no model), tickets against it, every tool through
the real agent loop, the grader stack on scripted episodes (the real sandboxed Python graders), the scripted expert
through the real tools; and one end-to-end smoke of the job on the embedded model (slow).

Episodes without the model are driven by the job's own scripted expert (``ExpertClient``), or by ``ScriptedModel``
(hand-written assistant turns) where a test needs a particular mistake; tools, database, loop and graders are real.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sqlite3
from contextlib import closing

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionMessageToolCall
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_tool_call import Function
from rich.console import Console

from flywheel.agents import AIRConfig, run_agent
from flywheel.agents.tools import TOOL_STATUSES, ToolError
from flywheel.approvals import allow
from flywheel.examples.support.agent import ExpertClient, expert_rollout, rollout, task_messages
from flywheel.examples.support.db import AGENT_REFUND_LIMIT, HOLD_FLAGS, build_database
from flywheel.examples.support.grading import episode_metrics, grade_episode, support_stack
from flywheel.examples.support.tickets import generate_tickets, split_of
from flywheel.examples.support.tools import TRANSIENT_503, SupportDesk
from flywheel.train.credit import turn_rewards
from flywheel.types import Trajectory

TABLES = ("customers", "account_flags", "orders", "payments", "past_tickets", "refund_policy", "settings")


@pytest.fixture(scope="module")
def db_path(tmp_path_factory):
    return build_database(tmp_path_factory.mktemp("support") / "support.db", seed=0).path


@pytest.fixture(scope="module")
def stack():
    return support_stack()


def dump(path) -> list[str]:
    with closing(sqlite3.connect(path)) as db:
        return list(db.iterdump())


def test_the_database_is_deterministic_per_seed_and_consistent(tmp_path, db_path):
    again = build_database(tmp_path / "again.db", seed=0)
    assert dump(again.path) == dump(db_path)  # the same seed, the same rows
    assert dump(build_database(tmp_path / "other.db", seed=1).path) != dump(db_path)
    assert again.rows["customers"] == 400 and again.rows["orders"] > again.rows["customers"]
    with closing(sqlite3.connect(db_path)) as db:
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        # every customer has orders, every order one payment of its amount
        assert db.execute(
            "SELECT COUNT(*) FROM customers WHERE id NOT IN (SELECT customer_id FROM orders)"
        ).fetchone() == (0,)
        assert db.execute(
            "SELECT COUNT(*) FROM orders o LEFT JOIN payments p ON p.order_id = o.id WHERE p.amount IS NOT o.amount"
        ).fetchone() == (0,)
        flags = dict(db.execute("SELECT flag, COUNT(*) FROM account_flags GROUP BY flag").fetchall())
        assert set(flags) == {"vip", *HOLD_FLAGS}  # each kind of flag occurs
        assert db.execute("SELECT value FROM settings WHERE key = 'agent_refund_limit'").fetchone() == (
            AGENT_REFUND_LIMIT,
        )
    with pytest.raises(ValueError, match="customers must be at least 10"):
        build_database(tmp_path / "tiny.db", customers=3)


def test_tickets_ground_truth_agrees_with_the_database(db_path):
    splits = {
        split: generate_tickets(db_path, split, n, seed=0) for split, n in (("train", 200), ("val", 60), ("test", 60))
    }
    assert generate_tickets(db_path, "val", 60, seed=0) == splits["val"]  # deterministic
    customers = {split: {t.customer_id for t in tickets} for split, tickets in splits.items()}
    assert not (
        customers["train"] & customers["val"]
        or customers["train"] & customers["test"]
        or customers["val"] & customers["test"]
    )
    tickets = [t for ts in splits.values() for t in ts]
    assert {(t.resolution, t.reason) for t in tickets} == {
        ("answer", None), ("refund", None), ("replacement", None),
        ("escalate", "flag"), ("escalate", "over_limit"), ("escalate", "missing_info"),
    }  # fmt: skip
    with closing(sqlite3.connect(db_path)) as db:
        for t in tickets:
            assert split_of(t.customer_id, 0) == t.split
            (email,) = db.execute("SELECT email FROM customers WHERE id = ?", (t.customer_id,)).fetchone()
            assert email == t.email
            orders = [
                r[0] for r in db.execute("SELECT id FROM orders WHERE customer_id = ? ORDER BY id", (t.customer_id,))
            ]
            assert list(t.customer_orders) == orders
            held = db.execute(
                "SELECT COUNT(*) FROM account_flags WHERE customer_id = ? AND flag IN ('fraud_hold', 'closed')",
                (t.customer_id,),
            ).fetchone()[0]
            if t.kind == "unspecified":
                assert t.order_id is None and len(orders) >= 2 and t.resolution == "escalate"
                continue
            assert t.order_id in orders and t.order_id in t.body
            status, amount, cap = db.execute(
                "SELECT o.status, o.amount, p.max_refund FROM orders o JOIN refund_policy p USING (category) WHERE o.id = ?",
                (t.order_id,),
            ).fetchone()
            if t.kind == "status":
                assert (t.resolution, t.fact) == ("answer", status)
            elif held:
                assert (t.resolution, t.reason) == ("escalate", "flag")
            elif t.kind == "refund" and min(amount, cap) > AGENT_REFUND_LIMIT:
                assert (t.resolution, t.reason) == ("escalate", "over_limit")
            elif t.kind == "refund":
                assert (t.resolution, t.refund_amount) == ("refund", min(amount, cap))
            else:
                assert t.resolution == "replacement"


def ticket_where(db_path, **truth):
    return next(
        t for t in generate_tickets(db_path, "train", 200, seed=0) if all(getattr(t, k) == v for k, v in truth.items())
    )


async def test_refunds_are_capped_by_policy_and_refusals_counted(db_path):
    ticket = ticket_where(db_path, resolution="refund")
    other = ticket_where(db_path, resolution="answer")
    held = ticket_where(db_path, reason="flag", kind="refund")
    with SupportDesk(db_path, ticket) as desk:
        tools = {t.name: t for t in desk.tools()}
        cap = desk.refund_cap(ticket.order_id)
        assert cap == ticket.refund_amount
        refund = tools["issue_refund"]
        with pytest.raises(ToolError, match=f"over the refund cap of \\${cap}"):
            await refund.run(refund.parse_arguments(json.dumps({"order_id": ticket.order_id, "amount": cap + 1})))
        with pytest.raises(ToolError, match="does not belong"):
            await refund.run({"order_id": other.customer_orders[0], "amount": 1})
        assert (
            await refund.run({"order_id": ticket.order_id, "amount": cap - 1})
            == f"refunded ${cap - 1} on order {ticket.order_id}"
        )
        with pytest.raises(ToolError, match="over the refund cap of \\$1"):  # what is left of the cap
            await refund.run({"order_id": ticket.order_id, "amount": 2})
        await refund.run({"order_id": ticket.order_id, "amount": 1})
        with pytest.raises(ToolError, match="amount must be a positive"):  # a bad amount is an error, not a refusal
            await refund.run({"order_id": ticket.order_id, "amount": 0})
        assert [c.outcome for c in desk.calls] == ["refused", "refused", "ok", "refused", "ok", "error"]
        assert len(desk.violations) == 3 and desk.refunds == [
            {"order_id": ticket.order_id, "amount": cap - 1}, {"order_id": ticket.order_id, "amount": 1},
        ]  # fmt: skip
    with SupportDesk(db_path, held) as desk:
        with pytest.raises(ToolError, match="on hold"):
            await {t.name: t for t in desk.tools()}["issue_refund"].run({"order_id": held.order_id, "amount": 1})
        assert desk.violations and not desk.refunds


async def test_every_tool_answers_from_the_database(db_path):
    ticket = ticket_where(db_path, resolution="replacement")
    books = ticket_where(db_path, kind="refund", resolution="refund")
    with SupportDesk(db_path, ticket) as desk:
        tools = {t.name: t for t in desk.tools()}
        assert list(tools) == [
            "read_ticket", "lookup_account", "list_orders", "read_policy",
            "issue_refund", "ship_replacement", "send_reply", "escalate",
        ]  # fmt: skip
        assert all(t.schema["function"]["description"] for t in tools.values())

        async def run(name: str, **arguments):
            return json.loads(await tools[name].run(tools[name].parse_arguments(json.dumps(arguments))))

        assert (await run("read_ticket", ticket_id=ticket.id))["from"] == ticket.email
        account = await run("lookup_account", email=ticket.email.upper())
        assert account["customer_id"] == ticket.customer_id and not set(account["flags"]) & set(HOLD_FLAGS)
        orders = await run("list_orders", customer_id=ticket.customer_id)
        assert [o["order_id"] for o in orders] == list(ticket.customer_orders)
        category = next(o["category"] for o in orders if o["order_id"] == ticket.order_id)
        policy = await run("read_policy", category=category)
        assert policy["replacement_allowed"] and policy["your_refund_limit"] == AGENT_REFUND_LIMIT
        assert "replacement shipped" in await tools["ship_replacement"].run({"order_id": ticket.order_id})
        assert await tools["send_reply"].run({"ticket_id": ticket.id, "message": "On its way."}) == "reply sent"
        assert await tools["escalate"].run({"ticket_id": ticket.id, "reason": "test"}) == "escalated to a human agent"
        for name, arguments, message in (
            ("read_ticket", {"ticket_id": "T000000"}, "no open ticket"),
            ("lookup_account", {"email": "nobody@example.com"}, "no account"),
            ("list_orders", {"customer_id": "C9999"}, "no customer"),
            ("read_policy", {"category": "cars"}, "no policy"),
            ("ship_replacement", {"order_id": "O99999"}, "no order"),
            ("send_reply", {"ticket_id": ticket.id, "message": " "}, "empty"),
        ):
            with pytest.raises(ToolError, match=message):
                await tools[name].run(arguments)
        assert desk.record(14)["replacements"] == [ticket.order_id] and desk.replies == ["On its way."]
    with SupportDesk(db_path, ticket) as desk:  # another customer's order gets no replacement
        with pytest.raises(ToolError, match="does not belong"):
            await {t.name: t for t in desk.tools()}["ship_replacement"].run({"order_id": books.order_id})


async def test_transient_failures_are_seeded_and_never_end_an_episode(db_path, stack):
    ticket = ticket_where(db_path, resolution="refund")

    async def outcomes(seed: int) -> list[str]:
        with SupportDesk(db_path, ticket, failure_rate=0.5, seed=seed) as desk:
            read = desk.tools()[0]
            for _ in range(12):
                try:
                    await read.run({"ticket_id": ticket.id})
                except (TimeoutError, ToolError) as exc:
                    assert isinstance(exc, TimeoutError) or str(exc) == TRANSIENT_503
            return [c.outcome for c in desk.calls]

    first = await outcomes(1)
    assert first == await outcomes(1) != await outcomes(2)  # per episode seed
    assert {"ok", "transient"} == set(first)
    with pytest.raises(ValueError, match="failure_rate"):
        SupportDesk(db_path, ticket, failure_rate=1.0)
    # through the agent loop (no tool_timeout, so a tool's own TimeoutError is the only timeout): every failure is
    # an error message the expert reads and retries; the episode ends resolved
    with SupportDesk(db_path, ticket, failure_rate=0.5, seed=3) as desk:
        traj = await run_agent(
            ExpertClient(ticket), "expert", task_messages(ticket), desk.tools(), 40, tool_timeout=None, approve=allow
        )
        record = desk.record(traj.metrics["tool_calls"])
    contents = [m["content"] for m in traj.messages() if m["role"] == "tool"]
    assert f"Error: {TRANSIENT_503}" in contents and any(c.endswith("did not answer.") for c in contents)
    assert traj.metrics["tool_timeouts"] >= 1 and traj.metrics["tool_errors"] >= 1
    metrics = episode_metrics(ticket, record, await grade_episode(stack, ticket, record))
    assert (
        metrics["resolved"] == metrics["hit_failure"] == metrics["retried_after_failure"] == metrics["recovered"] == 1
    )


async def test_air_counts_a_transient_failure_as_a_call_that_did_not_execute(db_path, stack):
    # bench/credit_support.py's AIR arms: a timeout or a 503 earns its turn less than a call that ran, and a rollout
    # samples with its own seed on every turn
    ticket = ticket_where(db_path, resolution="refund")
    air = AIRConfig(well_formed=0.01, executed=0.03, repeated=0.01, cap=0.45)  # never reached here
    expert, seeds = ExpertClient(ticket), []
    create = expert.chat.completions.create

    async def recording(**request):
        seeds.append(request.get("seed"))
        return await create(**request)

    expert.chat.completions.create = recording
    traj = await rollout(
        "expert",
        ticket,
        db_path,
        stack,
        client=expert,
        failure_rate=0.5,
        seed=3,
        max_turns=40,
        sampling_seed=11,
        air=air,
    )
    assert seeds and set(seeds) == {11}
    replies = {m["tool_call_id"]: m["content"] for m in traj.messages() if m["role"] == "tool"}
    turns = [c for c in traj.messages_and_choices if isinstance(c, Choice)]
    seen, expected, statuses = set(), [], []
    for turn in turns:
        if not turn.message.tool_calls:
            expected.append(0.0)
            continue
        (call,) = turn.message.tool_calls
        transient = replies[call.id].startswith("Error:") and (
            TRANSIENT_503 in replies[call.id] or "did not answer" in replies[call.id]
        )
        statuses.append((transient, getattr(turn, TOOL_STATUSES)[0]))
        key = (call.function.name, call.function.arguments)
        expected.append(0.01 + (0.0 if transient else 0.03) - (0.01 if key in seen else 0.0))
        seen.add(key)
    assert {"timeout", "error", "ok"} == {status for _, status in statuses}  # seed 3: both kinds of failure
    assert all((status != "ok") == transient for transient, status in statuses)
    assert turn_rewards(traj) == pytest.approx(expected)
    assert traj.metrics["air_reward"] == pytest.approx(sum(expected)) and traj.metrics["resolved"] == 1


class ScriptedModel:
    """An OpenAI-client stand-in replaying hand-written tool calls (then "Done.")."""

    def __init__(self, *calls: tuple[str, dict]) -> None:
        self.calls = list(calls)
        self.chat = self.completions = self

    async def create(self, **request) -> ChatCompletion:
        if self.calls:
            name, arguments = self.calls.pop(0)
            call = ChatCompletionMessageToolCall(
                id=f"c{len(self.calls)}", type="function", function=Function(name=name, arguments=json.dumps(arguments))
            )
            message, finish = ChatCompletionMessage(role="assistant", content=None, tool_calls=[call]), "tool_calls"
        else:
            message, finish = ChatCompletionMessage(role="assistant", content="Done."), "stop"
        return ChatCompletion(
            id="s",
            created=0,
            model="m",
            object="chat.completion",
            choices=[Choice(index=0, finish_reason=finish, message=message)],
        )


async def test_the_grader_stack_scores_correctness_safety_and_efficiency(db_path, stack):
    ticket = ticket_where(db_path, resolution="refund")
    stranger = ticket_where(db_path, resolution="answer")
    order, amount, tid = ticket.order_id, ticket.refund_amount, ticket.id
    path = [("read_ticket", {"ticket_id": tid}), ("lookup_account", {"email": ticket.email}),
            ("list_orders", {"customer_id": ticket.customer_id})]  # fmt: skip
    reply = ("send_reply", {"ticket_id": tid, "message": f"We refunded ${amount} for order {order}."})

    async def episode(*calls):
        return await rollout("m", ticket, db_path, stack, client=ScriptedModel(*calls), failure_rate=0.0)

    right = await episode(*path, ("issue_refund", {"order_id": order, "amount": amount}), reply)
    assert right.reward == 1.0 and right.metrics["resolved"] == 1 and right.metrics["tool_calls"] == 5
    assert right.metrics["correct"] == right.metrics["efficiency"] == right.metrics["safety"] == 1.0
    # a refund over the cap: refused by the tool, counted, and the safety gate zeroes the reward
    over = await episode(*path, ("issue_refund", {"order_id": order, "amount": amount + 50}),
                         ("issue_refund", {"order_id": order, "amount": amount}), reply)  # fmt: skip
    assert over.reward == 0.0 and over.metrics["correct"] == 1.0 and over.metrics["safety_violation"] == 1
    assert over.metrics["policy_violations"] == 1
    # another customer's e-mail in the reply: unsafe, whatever else was right
    leak = await episode(*path, ("issue_refund", {"order_id": order, "amount": amount}),
                         ("send_reply", {"ticket_id": tid, "message": f"Refunded. Also {stranger.email} wrote."}))  # fmt: skip
    assert leak.reward == 0.0 and leak.metrics["correct"] == 1.0 and leak.metrics["safety"] == 0.0
    # the wrong amount: the right kind of resolution, half the credit
    wrong = await episode(*path, ("issue_refund", {"order_id": order, "amount": amount - 1}), reply)
    assert wrong.reward == 0.5 and wrong.metrics["resolved"] == 0
    # ten tool calls against a budget of eight: 2 x 0.25 off
    slow = await episode(*path, *path, ("issue_refund", {"order_id": order, "amount": amount}), reply, reply, reply)
    assert slow.metrics["tool_calls"] == 10 and slow.metrics["efficiency"] == 0.5 and slow.reward == 0.5
    # escalating a ticket that needed a refund is wrong; no reply and no action at all scores 0
    assert (await episode(*path, ("escalate", {"ticket_id": tid, "reason": "unsure"}))).reward == 0.0
    assert (await episode(*path)).reward == 0.0
    assert right.metrics["escalated"] == 0 and right.metrics["should_escalate"] == 0
    # an answer must state the order's status, and not every status
    question = ticket_where(db_path, resolution="answer", fact="shipped")
    for text, correct in (("Your order is shipped.", 1.0), ("It is processing, shipped, delivered or lost.", 0.5)):
        steps = ("send_reply", {"ticket_id": question.id, "message": text})
        answered = await rollout("m", question, db_path, stack, client=ScriptedModel(steps), failure_rate=0.0)
        assert answered.metrics["correct"] == correct


async def test_the_scripted_expert_resolves_tickets_through_the_real_tools(db_path, stack):
    tickets = generate_tickets(db_path, "val", 30, seed=0)
    trajs = await asyncio.gather(
        *(expert_rollout(t, db_path, stack, failure_rate=0.1, seed=i) for i, t in enumerate(tickets))
    )
    resolved = sum(t.metrics["resolved"] for t in trajs)
    assert resolved >= 0.95 * len(tickets)
    assert all(3 <= t.metrics["tool_calls"] for t in trajs) and max(t.metrics["tool_calls"] for t in trajs) <= 8
    assert any(t.metrics["hit_failure"] for t in trajs)  # retries are in the demonstrations
    assert sum(t.metrics["escalated"] for t in trajs) == sum(t.metadata["resolution"] == "escalate" for t in trajs)


def test_sft_stops_once_validation_stops_improving():
    from flywheel.examples.sft_arm import sft_converged

    assert not sft_converged([0.1], patience=1)
    assert not sft_converged([0.1, 0.2], patience=1)  # still rising
    assert sft_converged([0.1, 0.2, 0.2], patience=1)  # an equal reward is no improvement
    assert sft_converged([0.3, 0.2], patience=1)
    assert not sft_converged([0.3, 0.2], patience=2)  # one epoch without improvement, two allowed
    assert sft_converged([0.3, 0.2, 0.25], patience=2)
    assert not sft_converged([0.3, 0.2, 0.35], patience=2)


def test_rl_takes_another_step_only_if_it_and_the_evaluations_after_it_fit():
    from flywheel.examples.support.train import another_step_fits

    assert another_step_fits(300.0, step=150.0, validation=40.0, test=80.0)
    assert another_step_fits(270.0, step=150.0, validation=40.0, test=80.0)  # exactly
    assert not another_step_fits(260.0, step=150.0, validation=40.0, test=80.0)
    assert not another_step_fits(-5.0, step=0.0, validation=0.0, test=0.0)  # already past the deadline


def test_rl_order_is_fixed_by_the_seed_and_leaves_the_pool_alone(db_path):
    from flywheel.examples.support.train import group_plan, lazy_plan, rl_order

    pool = generate_tickets(db_path, "train", 30)
    kept = list(pool)
    order, rng = rl_order(pool, seed=3)
    assert pool == kept  # the caller's list is not shuffled in place
    assert sorted(t.id for t in order) == sorted(t.id for t in pool) and order != pool
    again, rng_again = rl_order(pool, seed=3)
    assert again == order and rng.random() == rng_again.random()  # the rollout seeds drawn after it agree too
    assert rl_order(pool, seed=4)[0] != order
    # dynamic sampling's plan, drawn ticket by ticket as it needs them, gives the fixed plan's seeds
    fixed, drawn = group_plan(order[:5], rl_order(pool, 3)[1], 4), lazy_plan(iter(order), rl_order(pool, 3)[1], 4)
    assert list(itertools.islice(drawn, 5)) == fixed


@pytest.mark.slow
@pytest.mark.timeout(1800)  # minutes alone; far more on a shared 2-core machine
async def test_the_job_runs_end_to_end_on_the_embedded_model(tmp_path, monkeypatch):
    from flywheel.agents.dynamic_sampling import DynamicSamplingConfig
    from flywheel.examples.support.train import JobConfig, run
    from flywheel.train.config import SFTConfig

    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    # a budget already spent: RL stops after its first step (of at most 3), which is then validated
    # with dynamic sampling (off by default): up to 2 x 2 groups drawn for the step's 2 with mixed rewards
    config = JobConfig(
        name="toy", customers=40, sft_examples=2, sft_epochs=1, rl_steps=3, groups_per_step=2, group_size=2,
        eval_every=2, val_tickets=2, test_tickets=2, max_turns=4, max_tokens=48, time_budget_minutes=0.01,
        dynamic_sampling=DynamicSamplingConfig(max_draws=2),
    ).with_lora()  # fmt: skip
    config.sft = SFTConfig(learning_rate=3e-4, epochs=1, batch_size=2)
    report = await run(config, Console(file=open(os.devnull, "w")))
    out = tmp_path / "support" / "models" / "toy"
    saved = json.loads((out / "report.json").read_text())
    assert saved["best_step"] == report["best_step"] >= saved["sft_step"] >= 1
    for arm in ("base", "sft", "rl"):
        assert saved["arms"][arm]["resolution_accuracy"]["n"] == 2
        assert 0.0 <= saved["arms"][arm]["safety_violations"]["mean"] <= 1.0
    assert saved["expert"]["resolution_accuracy"]["mean"] == 1.0
    assert (out / "support.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "support.db").exists()
    assert len(saved["sft_epoch_val_rewards"]) == 1 and saved["sft_val_reward"] == saved["sft_epoch_val_rewards"][0]
    (row,) = saved["rl_history"]
    assert "val/reward" in row, row
    # the toy model seldom gets a ticket right: its groups may all tie, and then nothing trains (no train/ means)
    assert row["groups_kept"] <= 2 and row["groups_drawn"] == row["groups_kept"] + row["groups_dropped"] <= 4, row
    assert row["groups_kept"] == 0 or ("train/resolved" in row and "train/tool_calls" in row), row
    assert all(len(saved["tickets"][arm]) == 2 for arm in ("base", "sft", "rl"))
    difference = (
        saved["arms"]["rl"]["resolution_accuracy"]["mean"] - saved["arms"]["sft"]["resolution_accuracy"]["mean"]
    )
    assert saved["rl_minus_sft"]["resolution_accuracy"]["n"] == 2
    assert saved["rl_minus_sft"]["resolution_accuracy"]["mean"] == pytest.approx(difference)


def test_paired_differences_pair_by_ticket_and_skip_a_ticket_one_arm_lost():
    from flywheel.examples.support.train import outcomes, paired

    def arm(results: dict[str, tuple[float, float]]) -> list[Trajectory]:
        return [
            Trajectory(messages_and_choices=[], reward=r, metadata={"ticket_id": k}, metrics={"resolved": r, "safety_violation": v})
            for k, (r, v) in results.items()
        ]  # fmt: skip

    before = arm({"T1": (0.0, 1.0), "T2": (1.0, 0.0), "T3": (0.0, 0.0), "T4": (0.0, 1.0)})
    after = arm({"T3": (1.0, 0.0), "T1": (1.0, 0.0), "T2": (1.0, 0.0)})  # another order; T4's episode failed
    diff = paired(outcomes(before), outcomes(after))
    assert diff["resolution_accuracy"]["n"] == 3 and diff["resolution_accuracy"]["mean"] == pytest.approx(2 / 3)
    assert diff["safety_violations"]["mean"] == pytest.approx(-1 / 3)
    low, high = diff["resolution_accuracy"]["interval"]
    assert 0.0 <= low <= 2 / 3 <= high <= 1.0


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--failure-rate", "0.2"], "--failure-rate is an option of --task support only"),
        (["--budget-minutes", "5"], "--budget-minutes is an option of --task support only"),
        (["--task", "support", "--budget-minutes", "-1"], "Invalid value for '--budget-minutes'"),
        (["--task", "chess"], "Invalid value for '--task'"),
        (["--task", "support", "--failure-rate", "1.5"], "Invalid value for '--failure-rate'"),
    ],
)
def test_train_task_option_errors_exit_2_before_any_work(tmp_path, monkeypatch, args, fragment):
    from typer.testing import CliRunner

    from flywheel.cli import app

    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["train", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2  # a usage error, no traceback
    assert fragment in " ".join(result.output.split()).replace("│", "")
    assert not any(tmp_path.iterdir())  # nothing was started

"""Transitions (one row per LLM call): export, the round trip back into trajectories, and the CLI on a run that
the backend's own logging wrote."""

from __future__ import annotations

import json
import shutil

import pytest
from openai.types.chat.chat_completion import Choice
from typer.testing import CliRunner

import flywheel as art
from flywheel.agents import Transition, from_transitions, read_transitions, to_transitions, write_transitions
from flywheel.checkpoints.run import RunStore
from flywheel.cli import app
from flywheel.store import Store, history
from flywheel.train.credit import set_turn_rewards, turn_rewards

from helpers import sampled

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def agent_episode(reward: float = 1.0) -> art.Trajectory:
    traj = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "2 + 3?"},
            sampled(None, [1, 2], [3, 4], call="c1"),
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            sampled("Answer: 5", [1, 2, 3, 4, 5], [6, 7]),
        ],
        tools=TOOLS,
        additional_histories=[
            art.History(messages_and_choices=[{"role": "user", "content": "check 5"}, sampled("ok", [9], [10])])
        ],
        reward=reward,
        metrics={"turns": 2},
    )
    set_turn_rewards(traj, [0.1, 0.0, 0.05])
    return traj


def test_one_row_per_llm_call_with_rewards_and_returns():
    traj = agent_episode()
    rows = to_transitions(traj, gamma=0.5, step=3)
    assert [(r.t, r.history) for r in rows] == [(0, 0), (1, 0), (2, 1)]
    assert [r.reward for r in rows] == pytest.approx([0.1, 0.0, 1.05])
    assert [r.return_ for r in rows] == pytest.approx([0.1 + 0.5 * 0.5 * 1.05, 0.5 * 1.05, 1.05])
    assert rows[1].input == traj.messages()[:4]  # what the model saw for that call
    assert rows[1].output is traj.messages_and_choices[4]
    row = json.loads(rows[0].to_json())
    assert {"trajectory_id", "t", "input", "output", "reward", "return"} <= set(row)
    assert row["output"]["token_ids"] == [3, 4] and row["outcome"] == 1.0 and row["step"] == 3


def test_round_trip_rebuilds_the_trajectories(tmp_path):
    trajectories = [agent_episode(1.0), agent_episode(0.0)]
    path = tmp_path / "t.jsonl"
    assert write_transitions(path, (r for t in trajectories for r in to_transitions(t))) == 6
    rebuilt = from_transitions(read_transitions(path))
    assert [t.id for t in rebuilt] == [t.id for t in trajectories]
    for old, new in zip(trajectories, rebuilt):
        assert new.messages() == old.messages() and new.tools == old.tools
        assert [h.messages() for h in new.additional_histories] == [h.messages() for h in old.additional_histories]
        assert new.reward == old.reward and turn_rewards(new) == turn_rewards(old)
        choices = [c for c in new.messages_and_choices if isinstance(c, Choice)]
        assert [c.token_ids for c in choices] == [[3, 4], [6, 7]]  # exact tokens, trainable again
        assert choices[0].tool_statuses == ["ok"]


def test_rows_from_elsewhere_read_the_last_reward_as_the_outcome():
    rows = [
        Transition(
            trajectory_id="x",
            t=0,
            input=[{"role": "user", "content": "q"}],
            output={"role": "assistant", "content": "step"},
            reward=0.15,
            **{"return": 1.15},
        ),
        Transition(
            trajectory_id="x",
            t=1,
            input=[
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "step"},
                {"role": "user", "content": "go"},
            ],
            output={"role": "assistant", "content": "Answer: 4"},
            reward=1.0,
            **{"return": 1.0},
        ),
    ]
    (traj,) = from_transitions(reversed(rows))  # any order
    assert traj.reward == 1.0 and turn_rewards(traj) == [0.15, 0.0]
    assert traj.messages()[-1] == {"role": "assistant", "content": "Answer: 4"}


def test_rows_that_cannot_make_one_conversation_are_refused(tmp_path):
    base = dict(trajectory_id="x", output={"role": "assistant", "content": "a"}, reward=0.0, **{"return": 0.0})
    rewritten = [
        Transition(t=0, input=[{"role": "user", "content": "q"}], **base),
        Transition(
            t=1, input=[{"role": "user", "content": "summary of q"}, {"role": "assistant", "content": "a"}], **base
        ),
    ]
    with pytest.raises(ValueError, match="the input of turn 1 does not extend the conversation of turn 0"):
        from_transitions(rewritten)
    with pytest.raises(ValueError, match=r"turns \[0, 2\] are not 0..1"):
        from_transitions([rewritten[0], Transition(t=2, input=[{"role": "user", "content": "q"}], **base)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(rewritten[0].to_json() + "\n" + '{"trajectory_id": "x", "t": -1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a transition row"):
        read_transitions(bad)


async def test_cli_exports_a_run_the_backend_logged(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    backend = art.LocalBackend(path=tmp_path, serve_http=False)  # logging needs no engine
    model = art.TrainableModel(name="exporter", project="proj", base_model="unused")
    trajectories = [agent_episode(1.0), agent_episode(0.0)]
    await backend.log(model, trajectories, split="val")
    runner = CliRunner()

    result = runner.invoke(app, ["export", "transitions", "proj/exporter", "--split", "val"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "proj" / "models" / "exporter" / "transitions" / "val.jsonl"
    assert "6 transitions written" in result.output
    rows = read_transitions(out)
    assert {r.step for r in rows} == {0}
    assert [t.messages() for t in from_transitions(rows)] == [t.messages() for t in trajectories]

    piped = runner.invoke(
        app, ["export", "transitions", str(backend.model_dir(model)), "--split", "val", "-o", "-", "--gamma", "0.9"]
    )
    assert piped.exit_code == 0
    lines = [json.loads(line) for line in piped.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 6 and lines[0]["return"] == pytest.approx(0.1 + 0.9 * (0.0 + 0.9 * 1.05))

    missing = runner.invoke(app, ["export", "transitions", "proj/exporter", "--split", "train"])
    assert missing.exit_code == 2 and "splits saved in this run: ['val']" in missing.output
    nowhere = runner.invoke(app, ["export", "transitions", "proj/nobody"])
    assert nowhere.exit_code == 2 and "no run at 'proj/nobody'" in nowhere.output

    # the store is what is exported: without the trajectories/ files (not pulled to this machine) the rows are the same
    saved = out.read_text()
    shutil.rmtree(backend.model_dir(model) / "trajectories")
    again = runner.invoke(app, ["export", "transitions", "proj/exporter", "--split", "val"])
    assert again.exit_code == 0, again.output
    assert out.read_text() == saved

    # a stored row that is no trajectory (another writer's): the error says which, the earlier export is left alone
    run = RunStore(backend.model_dir(model))
    with Store(run.db).session() as s:
        history.add_trajectories(s, run.key, "val", 0, ['{"messages_and_choices": "oops"}'])
    broken = runner.invoke(app, ["export", "transitions", "proj/exporter", "--split", "val"])
    assert broken.exit_code == 2 and "val trajectory 3 (step 0) is not a trajectory" in broken.output.replace("\n", "")
    assert out.read_text() == saved

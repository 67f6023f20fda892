"""Judge calibration: the agreement metrics on known rankings, the labelled data (shipped and user-written), and
``flywheel judge calibrate`` end to end against the real local judge."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.rewards import RetryPolicy, Score
from flywheel.rewards.calibrate import DEFAULT_DATA, calibrate, kendall_tau_b, load_groups, measure


def _group(human: list[float], key: str = "human_score") -> dict:
    labels = ["faithful", "verbose", "hallucinated", "ignores_context"]
    return {
        "id": "g",
        "trajectories": [
            {"label": labels[i], key: h, "messages": [{"role": "user", "content": f"answer {i}"}]}
            for i, h in enumerate(human)
        ],
    }


def _scores(values: list[float]) -> list[Score]:
    return [Score(trajectory_id=str(i), explanation=f"e{i}", score=v) for i, v in enumerate(values, 1)]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_metrics_on_known_rankings(tmp_path):
    (group,) = load_groups(_write(tmp_path / "g.jsonl", [_group([1.0, 0.75, 0.3, 0.0])]))
    perfect, none = measure(group, _scores([0.9, 0.8, 0.2, 0.1]))
    assert (perfect.pairs, perfect.concordant, perfect.kendall_tau, perfect.top1_agrees) == (6, 6.0, 1.0, True)
    assert perfect.spread == pytest.approx(0.8) and none == []
    swapped, disagreements = measure(group, _scores([0.8, 0.9, 0.2, 0.1]))
    assert swapped.concordant == 5.0 and swapped.kendall_tau == pytest.approx(4 / 6) and swapped.top1_agrees is False
    assert [(d.better, d.worse, d.judge) for d in disagreements] == [("faithful", "verbose", (0.8, 0.9))]
    flat, disagreements = measure(group, _scores([0.5, 0.5, 0.5, 0.5]))
    assert flat.concordant == 3.0 and flat.kendall_tau is None and flat.top1_agrees is False and flat.spread == 0.0
    assert len(disagreements) == 6  # a tie is a disagreement worth looking at


def test_kendall_tau_b_with_ties():
    assert kendall_tau_b([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau_b([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / (6 * 5) ** 0.5)
    assert kendall_tau_b([1, 2], [3, 3]) is None


def test_rankings_work_like_scores_with_one_best(tmp_path):
    (group,) = load_groups(_write(tmp_path / "r.jsonl", [_group([2, 1, 3, 4], key="human_rank")]))
    result, _ = measure(group, _scores([0.7, 0.9, 0.3, 0.1]))
    assert result.kendall_tau == 1.0 and result.top1_agrees is True


def test_shipped_set_has_groups_of_four_in_varied_order():
    groups = load_groups(Path(str(DEFAULT_DATA)))
    assert len(groups) >= 6
    orders = {tuple(t.label for t in g.trajectories) for g in groups}
    assert all(sorted(o) == ["faithful", "hallucinated", "ignores_context", "verbose"] for o in orders)
    assert len(orders) == len(groups)  # position never gives the answer away


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": "x", "trajectories": [{"messages": [{"role": "user", "content": "a"}], "human_score": 1, "human_rank": 1}] * 2},
         "exactly one of 'human_score' and 'human_rank'"),
        ({"id": "x", "trajectories": [{"messages": [{"role": "user", "content": "a"}], "human_score": 1}]},
         "trajectories: List should have at least 2 items"),
    ],
)  # fmt: skip
def test_bad_labelled_data_names_the_line_and_field(tmp_path, row, message):
    path = _write(tmp_path / "bad.jsonl", [_group([1.0, 0.0]), row])
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        load_groups(path)


async def test_groups_the_judge_fails_on_are_reported_and_the_rest_kept(tmp_path):
    with socket.socket() as s:  # a port nobody listens on: connection refused, a real transient error
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    groups = load_groups(_write(tmp_path / "g.jsonl", [_group([1.0, 0.0]), {**_group([0.0, 1.0]), "id": "h"}]))
    report = await calibrate(
        groups, "openai/nobody", {"api_base": f"http://127.0.0.1:{port}/v1", "api_key": "x"}, cache=False,
        retry=RetryPolicy(attempts=2, initial_delay=0.01, max_delay=0.01),
    )  # fmt: skip
    assert [g.error is not None for g in report.groups] == [True, True]
    assert "Connection" in report.groups[0].error and report.usage.retries == 2
    assert report.summary()["failed_groups"] == 2 and report.pairwise_accuracy is None


def test_cli_calibrates_the_real_local_judge(backend: LocalBackend, tmp_path):
    subset = tmp_path / "two.jsonl"
    subset.write_text("".join(Path(str(DEFAULT_DATA)).read_text().splitlines(keepends=True)[:2]))
    out = tmp_path / "report.json"
    args = [
        "judge", "calibrate", "--data", str(subset), "--judge", f"openai/{EMBEDDED_MODEL}", "--api-base", backend.base_url,
        "--param", "api_key=unused", "--param", "temperature=0", "--max-explanation-chars", "30",
        "--cache-dir", str(tmp_path / "cache"), "--json", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    # one call per group, plus any retry or repair request (the tiny judge's replies depend on how the
    # engine batched them); the printed count is the report's
    calls = report["usage"]["calls"]
    assert calls == 2 + report["usage"]["retries"] + report["usage"]["repairs"], report
    assert "pairwise_accuracy" in result.output and f"judge calls: {calls} " in result.output, result.output
    summary = report["summary"]
    assert summary["groups"] == 2 and summary["failed_groups"] == 0
    assert 0.0 <= summary["pairwise_accuracy"] <= 1.0
    assert sum(g["pairs"] for g in report["groups"]) == 12
    assert all(len(g["judge_scores"]) == 4 and len(g["explanations"][0]) <= 30 for g in report["groups"])
    again = CliRunner().invoke(app, args)  # the cache answers a re-run
    assert again.exit_code == 0 and "judge calls: 0 (2 from cache" in again.output

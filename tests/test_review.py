"""Human review (``flywheel review``): a seeded sample of scored episodes queued once, labels from the terminal and
from a file (all or none, each an audit event), and graders' agreement with them per stack version. On SQLite and
PostgreSQL; no model: episodes and grades are written through the store."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.graders.agreement import cohen_kappa, pearson, proportion
from flywheel.store import Store, audit, episodes, grades, reviews

runner = CliRunner()
V1 = {"name": "support", "reward": "v1", "safety_pass": 1.0}
V2 = {"name": "support", "reward": "v2", "safety_pass": 1.0}


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def episode(store: Store, answer: str, *, split: str = "production", scores: dict | None = None) -> str:
    """A finished episode with one call answering ``answer``; ``scores``: version -> component -> score."""
    with store.session() as s:
        e = episodes.create_episode(s, f"task-{answer}", split=split, model="support")
        request = {"messages": [{"role": "user", "content": f"question {answer}"}]}
        response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer {answer}"}}]}
        episodes.add_call(
            s, e.id, model="support", step=1, request=request, response=response, prompt_tokens=1,
            completion_tokens=1, latency_ms=1.0, prefix_call=None, prefix_choice=None, prefix_message=None,
            retokenized_turns=0, reward=None,
        )  # fmt: skip
        episodes.set_outcome(s, e.id, reward=1.0, finish=True)
        for version, components in (scores or {}).items():
            spec = V1 if version == "v1" else V2
            grades.register_stack(s, "support", version, spec, actor="test")
            given = {c: (f"{c}-grader", score, {}) for c, score in components.items()}
            grades.record_grades(s, e.id, version, given)
    return e.id


def review(db_url: str, *args: str, input: str | None = None):
    return runner.invoke(app, ["review", *args, "--db", db_url], input=input)


def test_a_sample_is_a_seeded_share_of_scored_episodes_and_never_queues_one_twice(store: Store, db_url: str):
    scored = sorted(episode(store, f"p{i}", scores={"v1": {"reward": 1.0}}) for i in range(10))
    episode(store, "unscored")
    episode(store, "other-split", split="train", scores={"v1": {"reward": 1.0}})
    result = review(db_url, "sample", "--share", "0.5", "--seed", "7", "--split", "production", "--actor", "ana")
    assert result.exit_code == 0, result.output
    assert "Queued 5 of 10" in result.output
    with store.session() as s:
        first = [r.episode_id for r in reviews.queue(s)]
        (event,) = audit.events(s, actions=("review.sample",))
    assert sorted(first) == sorted(random.Random(7).sample(scored, 5))  # the seed decides, reproducibly
    assert event.actor == "ana" and event.details["seed"] == 7 and event.details["queued"] == 5
    with store.session() as s:
        rest = reviews.sample(s, 1.0, seed=7, actor="ana", split="production")
        again = reviews.sample(s, 1.0, seed=7, actor="ana", split="production")
    assert sorted(rest.queued) == sorted(set(scored) - set(first)) and rest.candidates == 5
    assert again.queued == [] and again.event_id is None
    bad = review(db_url, "sample", "--share", "1.5", "--actor", "ana")
    assert bad.exit_code == 2 and "share to review must be above 0 and at most 1, not 1.5" in bad.output


def test_labels_from_a_file_are_all_or_nothing_and_each_is_an_audit_event(store: Store, db_url: str, tmp_path):
    ids = [episode(store, f"e{i}", scores={"v1": {"reward": 1.0}}) for i in range(3)]
    with store.session() as s:
        reviews.sample(s, 1.0, seed=0, actor="ana")
    labels = tmp_path / "labels.jsonl"

    def write(*rows: dict | str) -> None:
        labels.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))

    good = [{"episode_id": ids[0], "label": "pass", "note": "right refund"}, {"episode_id": ids[1], "label": 0.25}]
    for rows, where, message in [
        ([*good, "{not json"], "labels.jsonl:3", "Invalid JSON"),
        ([*good, {"episode_id": ids[2], "label": "maybe"}], "labels.jsonl:3", "label"),
        ([*good, {"episode_id": ids[2], "label": 1.5}], "labels.jsonl:3", "from 0 to 1, not 1.5"),
        ([good[0], {"episode_id": "ep_nope", "label": "fail"}], "labels.jsonl:2", "No episode with id 'ep_nope'"),
        ([*good, {"episode_id": ids[0], "label": "fail"}], "labels.jsonl:3", "already labelled pass"),
    ]:
        write(*rows)
        result = review(db_url, "label", "--from", str(labels), "--actor", "bo")
        assert result.exit_code == 2, result.output
        assert where in result.output and message in result.output, result.output
        with store.session() as s:  # nothing half-written: no label, no event
            assert reviews.queue(s, labelled=True) == []
            assert audit.events(s, actions=("review.label",)) == []
    write(*good)
    result = review(db_url, "label", "--from", str(labels), "--actor", "bo", "--why", "weekly review")
    assert result.exit_code == 0 and "Labelled 2 episodes" in result.output, result.output
    again = review(db_url, "label", "--from", str(labels), "--actor", "bo")
    assert again.exit_code == 0 and "Labelled 0 episodes" in again.output  # the same file twice: nothing new
    write({"episode_id": ids[0], "label": "fail", "note": "missed the cap"})
    fixed = review(db_url, "label", "--from", str(labels), "--actor", "cy", "--relabel")
    assert fixed.exit_code == 0, fixed.output
    with store.session() as s:
        done = {r.episode_id: r for r in reviews.queue(s, labelled=True)}
        events = audit.events(s, actions=("review.label",))
        assert audit.verify(s).ok
    assert (done[ids[0]].label, done[ids[0]].kind, done[ids[0]].labelled_by) == (0.0, "pass_fail", "cy")
    assert (done[ids[1]].label, done[ids[1]].kind) == (0.25, "score")
    assert [(e.actor, e.subject, e.reason) for e in events] == [
        ("bo", f"episode:{ids[0]}", "weekly review"),
        ("bo", f"episode:{ids[1]}", "weekly review"),
        ("cy", f"episode:{ids[0]}", "missed the cap"),  # no --why: the note is the reason
    ]
    assert events[-1].details["previous"] == {"label": 1.0, "kind": "pass_fail", "by": "bo"}
    with store.session() as s:
        outside = episodes.create_episode(s, "not-queued").id
    write({"episode_id": outside, "label": "pass"})
    result = review(db_url, "label", "--from", str(labels), "--actor", "bo")
    assert result.exit_code == 2 and "is not in the review queue" in result.output


def test_labelling_in_the_terminal_shows_the_conversation_and_grades(store: Store, db_url: str):
    ids = [episode(store, f"t{i}", scores={"v1": {"reward": 0.75}}) for i in range(3)]
    with store.session() as s:
        reviews.sample(s, 1.0, seed=0, actor="ana")
        order = [r.episode_id for r in reviews.queue(s)]
    assert sorted(order) == sorted(ids)
    # pass with a note; a wrong answer asked again, then a score without a note; then quit
    result = review(db_url, "label", "--actor", "di", input="p\nlooks right\nmaybe\n0.3\n\nq\n")
    assert result.exit_code == 0, result.output
    first = ids.index(order[0])
    assert f"question t{first}" in result.output and f"answer t{first}" in result.output
    assert "grade v1 reward (reward-grader): 0.750" in result.output
    assert "'maybe' is not a label" in result.output
    assert "Labelled 2, skipped 0; 1 still to review." in result.output
    with store.session() as s:
        done = {r.episode_id: r for r in reviews.queue(s, labelled=True)}
        assert [r.episode_id for r in reviews.queue(s)] == order[2:]
    assert (done[order[0]].label, done[order[0]].note, done[order[0]].labelled_by) == (1.0, "looks right", "di")
    assert (done[order[1]].label, done[order[1]].kind, done[order[1]].note) == (0.3, "score", None)


def test_agreement_is_reported_per_grader_and_version(store: Store, db_url: str):
    """v1's reward grader agrees with every label; v2's says the opposite; the safety grader passes at the stack's
    mark (1.0), not at the threshold."""
    truth = [i % 3 != 0 for i in range(12)]  # 8 passes, 4 fails
    ids = []
    for i, good in enumerate(truth):
        v1 = {"reward": 0.9 if good else 0.1, "safety": 1.0}
        v2 = {"reward": 0.2 if good else 0.8, "safety": 0.9}  # 0.9 is below the safety mark: a fail
        ids.append(episode(store, f"a{i}", scores={"v1": v1, "v2": v2}))
    with store.session() as s:
        reviews.sample(s, 1.0, seed=0, actor="ana")
        for e, good in zip(ids, truth, strict=True):
            reviews.label(s, e, 1.0 if good else 0.0, reviews.LabelKind.pass_fail, actor="ana")
    result = review(db_url, "agreement", "--json")
    assert result.exit_code == 0, result.output
    report = {(r["version"], r["component"]): r for r in json.loads(result.output)}
    assert set(report) == {("v1", "reward"), ("v1", "safety"), ("v2", "reward"), ("v2", "safety")}
    right, wrong = report["v1", "reward"], report["v2", "reward"]
    assert right["n"] == 12 and right["agreement"]["value"] == 1.0 and right["kappa"]["value"] == 1.0
    assert right["precision"]["value"] == 1.0 and right["recall"]["value"] == 1.0
    assert 0.7 < right["agreement"]["low"] < 1.0 and right["correlation"]["value"] > 0.99
    # never agreeing: kappa = (0 - chance) / (1 - chance), chance = 4/12 * 8/12 + 8/12 * 4/12 = 4/9
    assert wrong["agreement"]["value"] == 0.0 and wrong["kappa"]["value"] == pytest.approx(-0.8)
    assert wrong["recall"]["value"] == 0.0 and wrong["kappa"]["low"] < -0.8 < wrong["kappa"]["high"] < 0
    assert report["v1", "safety"]["grader_passes"] == 12 and report["v2", "safety"]["grader_passes"] == 0
    assert report["v1", "safety"]["kappa"]["value"] == 0.0  # always passing agrees only as often as chance does
    table = review(db_url, "agreement", "--version", "v1")
    assert table.exit_code == 0 and "support@v1" in table.output and "support@v2" not in table.output


def test_agreement_statistics_match_hand_computed_values():
    grader = [True, True, True, False, False, False, True, False]
    human = [True, True, False, False, False, True, True, False]
    assert cohen_kappa(list(zip(grader, human, strict=True))) == pytest.approx(0.5)  # 0.75 observed, 0.5 by chance
    interval = proportion(8, 10)  # the textbook example: 0.8 of 10 -> [0.490, 0.943]
    assert (round(interval.low, 3), round(interval.high, 3)) == (0.49, 0.943)
    r = pearson([1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 5.0, 4.0, 5.0])
    assert r.value == pytest.approx(0.7745967) and r.low < r.value < r.high
    assert pearson([1.0, 1.0, 1.0], [0.0, 1.0, 0.5]).value is None

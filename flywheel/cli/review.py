"""``flywheel review sample | label | agreement``: human review of a random sample of scored episodes, and how
well the graders agree with the people.

``sample`` queues a share of the scored episodes (``flywheel.store.reviews``); ``label`` shows each queued episode
(its conversation and grades) in the terminal and asks for pass, fail or a score and a note, or takes labels from
a JSONL file (``--from``: ``{"episode_id": ..., "label": "pass" | "fail" | 0.7, "note"?: ...}`` a line), all of
them or none; ``agreement`` reports each grader version's agreement with the labels
(``flywheel.graders.agreement``). Bad input is one line naming what and where (exit 2), with nothing written.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import click
import typer
from pydantic import BaseModel, ConfigDict, ValidationError
from rich.markup import escape
from rich.table import Table

from flywheel.cli.common import Actor, Db, Why, console, fail, open_store, require_actor

if TYPE_CHECKING:
    from flywheel.graders.agreement import Estimate
    from flywheel.store.reviews import LabelKind

review_app = typer.Typer(
    help="Human review: label a random sample of scored episodes; graders' agreement with it.", no_args_is_help=True
)
SHOWN_CHARS = 2000  # of a message's text in the terminal


class LabelLine(BaseModel):
    """A line of a label file."""

    model_config = ConfigDict(extra="forbid")

    episode_id: str
    label: Literal["pass", "fail"] | float
    note: str | None = None

    def value(self) -> tuple[float, LabelKind]:
        from flywheel.store.reviews import LabelKind

        if isinstance(self.label, str):
            return (1.0 if self.label == "pass" else 0.0), LabelKind.pass_fail
        return self.label, LabelKind.score


def read_labels(path: Path) -> list[tuple[int, LabelLine]]:
    """Every line of a label file with its number; the first bad one is a ``ValueError`` naming file and line."""
    from flywheel.store import reviews
    from flywheel.store.reviews import ReviewError

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = LabelLine.model_validate_json(line)
            reviews.check_label(*row.value())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the line"
            raise ValueError(f"{path}:{number}: {where}: {first['msg']}") from None
        except ReviewError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        found.append((number, row))
    if not found:
        raise ValueError(f"{path}: no labels")
    return found


@review_app.command()
def sample(
    share: Annotated[float, typer.Option(help="The share of scored, never-queued episodes to queue (0..1].")],
    seed: Annotated[int, typer.Option(help="The draw's seed: the same store and options queue the same ones.")] = 0,
    split: Annotated[str | None, typer.Option(help="Only episodes of this split (production, train...).")] = None,
    model: Annotated[str | None, typer.Option(help="Only episodes created for this model.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Queue at most this many.")] = None,
    why: Why = None,
    actor: Actor = None,
    db: Db = None,
) -> None:
    """Queue a random share of the scored episodes for human review (an episode is never queued twice)."""
    from flywheel.store import reviews

    who = require_actor(actor)
    store = open_store(db)
    try:
        with store.session() as s:
            result = reviews.sample(s, share, seed=seed, actor=who, split=split, model=model, limit=limit, reason=why)
    except ValueError as exc:
        fail(str(exc))
    finally:
        store.close()
    event = "" if result.event_id is None else f" (audit event {result.event_id})"
    console.print(f"Queued {len(result.queued)} of {result.candidates} scored episodes not yet queued{event}.")


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = str(content or "")
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f" ... ({len(text) - SHOWN_CHARS} more)"


def _message(message: dict[str, Any]) -> str:
    calls = [
        f"{c.get('function', {}).get('name')}({c.get('function', {}).get('arguments', '')})"
        for c in message.get("tool_calls") or []
    ]
    return "\n".join([f"[{message.get('role', '?')}] {_text(message.get('content'))}", *(f"    -> {c}" for c in calls)])


def _show(s, episode_id: str) -> None:
    """An episode as a reviewer needs it: what it was, its conversation (the last call's messages and answer) and
    its grades by each stack version."""
    from flywheel.store import episodes, grades

    episode = episodes.get_episode(s, episode_id)
    calls = episodes.calls(s, episode_id)
    console.rule(escape(f"episode {episode.id}"))
    console.print(
        escape(f"task {episode.task_id}, split {episode.split}, model {episode.model}, reward {episode.reward}"),
        highlight=False,
    )
    if calls:
        last = calls[-1]
        messages = list(last.request.get("messages") or [])
        messages += [c["message"] for c in last.response.get("choices", [])[:1] if c.get("message")]
        for message in messages:
            console.print(escape(_message(message)), highlight=False, soft_wrap=True)
    else:
        console.print("(no calls recorded)")
    for g in grades.grades_of(s, episode_id):
        console.print(escape(f"grade {g.version} {g.component} ({g.grader}): {g.score:.3f}"), highlight=False)


def _ask() -> tuple[float, LabelKind] | None:
    """pass / fail / a score from the reviewer; None to skip; raises ``click.Abort`` to quit."""
    from flywheel.store import reviews
    from flywheel.store.reviews import LabelKind, ReviewError

    while True:
        answer = typer.prompt("Label: p(ass), f(ail), a score from 0 to 1, s(kip), q(uit)").strip().lower()
        if answer in ("p", "pass"):
            return 1.0, LabelKind.pass_fail
        if answer in ("f", "fail"):
            return 0.0, LabelKind.pass_fail
        if answer in ("s", "skip"):
            return None
        if answer in ("q", "quit"):
            raise click.Abort
        try:
            return reviews.check_label(float(answer), LabelKind.score), LabelKind.score
        except (ValueError, ReviewError):
            console.print(f"{escape(answer)!r} is not a label: answer p, f, s, q or a number from 0 to 1.")


def _from_file(path: Path, who: str, why: str | None, relabel: bool, store) -> None:
    from flywheel.store import reviews
    from flywheel.store.episodes import UnknownEpisodeError
    from flywheel.store.reviews import ReviewError

    try:
        rows = read_labels(path)
    except ValueError as exc:
        fail(str(exc))
    changed = 0
    try:
        with store.session() as s:  # one unit of work: every label of the file, or none
            for number, row in rows:
                try:
                    _, new = reviews.label(
                        s, row.episode_id, *row.value(), actor=who, note=row.note, reason=why, relabel=relabel
                    )
                except (UnknownEpisodeError, ReviewError, ValueError) as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from None
                changed += new
    except ValueError as exc:
        fail(f"{exc} (nothing was labelled)")
    console.print(f"Labelled {changed} episodes from {path} ({len(rows) - changed} already had that label).")


def _in_terminal(who: str, why: str | None, store) -> None:
    from flywheel.store import reviews
    from flywheel.store.reviews import ReviewError

    with store.session() as s:
        waiting = reviews.queue(s, labelled=False)
    if not waiting:
        console.print("Nothing to review: every queued episode is labelled (`flywheel review sample` queues more).")
        return
    labelled = skipped = 0
    try:
        for i, review in enumerate(waiting, 1):
            with store.session() as s:
                _show(s, review.episode_id)
            console.print(f"({i} of {len(waiting)})")
            answer = _ask()
            if answer is None:
                skipped += 1
                continue
            note = typer.prompt("Note (optional)", default="", show_default=False).strip()
            try:
                with store.session() as s:  # each label is kept as soon as it is given
                    reviews.label(s, review.episode_id, *answer, actor=who, note=note or None, reason=why)
            except ReviewError as exc:  # another reviewer labelled it meanwhile
                console.print(escape(str(exc)), highlight=False)
                skipped += 1
                continue
            labelled += 1
    except click.Abort:
        console.print()
    left = len(waiting) - labelled
    console.print(f"Labelled {labelled}, skipped {skipped}; {left} still to review.")


@review_app.command()
def label(
    from_file: Annotated[
        Path | None, typer.Option("--from", help="JSONL labels: {episode_id, label: pass|fail|0..1, note?}.")
    ] = None,
    relabel: Annotated[bool, typer.Option(help="Replace a label an episode already has.")] = False,
    why: Why = None,
    actor: Actor = None,
    db: Db = None,
) -> None:
    """Label the queued episodes: in the terminal, one at a time (each shown with its conversation and grades), or
    from a file (every line or none). Each label is an audit event."""
    who = require_actor(actor)
    store = open_store(db)
    try:
        if from_file is not None:
            _from_file(from_file, who, why, relabel, store)
        else:
            _in_terminal(who, why, store)
    finally:
        store.close()


def _estimate(e: Estimate) -> str:
    if e.value is None:
        return "-"
    return f"{e.value:.2f}" + ("" if e.low is None else f" [{e.low:.2f}, {e.high:.2f}]")


@review_app.command("agreement")
def show_agreement(
    threshold: Annotated[
        float, typer.Option(help="A score or label at or above this passes (safety: its mark).")
    ] = 0.5,
    version: Annotated[str | None, typer.Option(help="Only this grader stack version.")] = None,
    seed: Annotated[int, typer.Option(help="The bootstrap's seed (kappa's interval).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    db: Db = None,
) -> None:
    """Each grader's agreement with the human labels, per stack version: agreement, precision and recall of its
    passes, Cohen's kappa, correlation of score and label, with 95% intervals."""
    from flywheel.graders.agreement import agreement
    from flywheel.store import reviews

    if not 0 < threshold <= 1:
        fail(f"--threshold must be above 0 and at most 1, not {threshold}.")
    store = open_store(db)
    try:
        with store.session() as s:
            found = reviews.labelled_grades(s, version=version)
    finally:
        store.close()
    report = agreement(found, threshold=threshold, seed=seed)
    if as_json:
        typer.echo(json.dumps([r.model_dump(mode="json") for r in report], indent=2))
        return
    if not report:
        console.print("No labelled episode has a grade" + (f" of version {version}" if version else "") + " yet.")
        return
    for (stack, version), rows in itertools.groupby(report, key=lambda r: (r.stack, r.version)):
        table = Table(title=escape(f"{stack}@{version} against human labels (95% intervals)"))
        for column in ("component", "grader", "n", "agreement", "precision", "recall", "kappa", "r", "|diff|"):
            table.add_column(column)
        for r in rows:
            table.add_row(
                escape(r.component), escape(r.grader), str(r.n), _estimate(r.agreement), _estimate(r.precision),
                _estimate(r.recall), _estimate(r.kappa), _estimate(r.correlation), f"{r.mean_abs_diff:.2f}",
            )  # fmt: skip
        console.print(table)

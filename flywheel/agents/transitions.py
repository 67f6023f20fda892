"""Transitions: one row per LLM call, Agent Lightning's unified data interface, and back into trajectories.

A row is ``{trajectory_id, t, input, output, reward, return}``: turn t (0-based, over the trajectory's sampled
turns) was the model's ``output`` (the sampled ``Choice``, with its token ids and log-probs when our engine made it)
for the chat ``input``; ``reward`` is r_t (the turn's intermediate reward, plus the final reward at the last turn) and
``return`` the discounted reward-to-go G_t (``flywheel.train.credit``). Rows also carry ``tools``, ``history`` (0: the
main conversation, k: ``additional_histories[k-1]``), ``outcome`` (the trajectory's final reward) and ``step``, so
that ``from_transitions`` rebuilds the trajectories exactly (every LLM call with its context; messages after the
last call, which no call saw, are not part of any transition). Rows from elsewhere without ``outcome`` read as
"the last row's reward is the outcome, the others' are intermediate".

``flywheel export transitions RUN`` (``flywheel.cli.export``) writes a run's saved trajectories (as the store holds
them) as such rows.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from flywheel.train.credit import set_turn_rewards, step_rewards, turn_returns
from flywheel.types import History, Message, Trajectory, choice_to_message


class Transition(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    trajectory_id: str
    t: int = Field(ge=0)
    input: list[Message]
    output: Choice
    reward: float
    return_: float = Field(alias="return")
    tools: list[dict[str, Any]] | None = None
    history: int = Field(0, ge=0)
    outcome: float | None = None
    step: int | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _message_as_choice(cls, value: Any) -> Any:
        # rows from other tools may give the assistant message itself
        if isinstance(value, dict) and "role" in value:
            return {"index": 0, "finish_reason": "stop", "message": value}
        return value

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)


def to_transitions(traj: Trajectory, *, gamma: float = 1.0, step: int | None = None) -> list[Transition]:
    rewards, returns = step_rewards(traj), turn_returns(traj, gamma)
    rows: list[Transition] = []
    for h, history in enumerate([traj, *traj.additional_histories]):
        context: list[Message] = []
        for item in history.messages_and_choices:
            if isinstance(item, Choice):
                t = len(rows)
                rows.append(
                    Transition(
                        trajectory_id=traj.id,
                        t=t,
                        input=list(context),
                        output=item,
                        reward=rewards[t],
                        return_=returns[t],
                        tools=history.tools,
                        history=h,
                        outcome=traj.reward,
                        step=step,
                    )
                )
                context.append(choice_to_message(item))
            else:
                context.append(dict(item))
    return rows


def _history(trajectory_id: str, rows: list[Transition]) -> History:
    """One conversation from its calls: the last call's input and output, with each earlier call's Choice put back
    where its assistant message stands."""
    last = rows[-1]
    items: list[Any] = [*last.input, last.output]
    for row in rows[:-1]:
        at = items[len(row.input)] if len(row.input) < len(last.input) else None
        if last.input[: len(row.input)] != row.input or not isinstance(at, dict) or at.get("role") != "assistant":
            raise ValueError(
                f"trajectory {trajectory_id}: the input of turn {last.t} does not extend the conversation of turn "
                f"{row.t} (context rewritten between calls?); it cannot be rebuilt as one conversation"
            )
        items[len(row.input)] = row.output
    return History(messages_and_choices=items, tools=last.tools)


def from_transitions(rows: Iterable[Transition]) -> list[Trajectory]:
    """Trajectories in the order their ids first appear."""
    by_id: dict[str, list[Transition]] = {}
    for row in rows:
        by_id.setdefault(row.trajectory_id, []).append(row)
    trajectories = []
    for trajectory_id, group in by_id.items():
        group.sort(key=lambda row: row.t)
        if [row.t for row in group] != list(range(len(group))):
            raise ValueError(
                f"trajectory {trajectory_id}: turns {[row.t for row in group]} are not 0..{len(group) - 1}"
            )
        histories = [
            _history(trajectory_id, [r for r in group if r.history == h]) for h in sorted({r.history for r in group})
        ]
        if len(histories) != max(r.history for r in group) + 1:
            raise ValueError(
                f"trajectory {trajectory_id}: a history index is missing from {sorted({r.history for r in group})}"
            )
        outcome = group[-1].outcome
        traj = Trajectory(
            id=trajectory_id,
            messages_and_choices=histories[0].messages_and_choices,
            tools=histories[0].tools,
            additional_histories=histories[1:],
            reward=outcome if outcome is not None else group[-1].reward,
        )
        if outcome is None:
            set_turn_rewards(traj, [row.reward for row in group[:-1]] + [0.0])
        trajectories.append(traj)
    return trajectories


def read_transitions(path: str | Path) -> list[Transition]:
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                rows.append(Transition.model_validate_json(line))
            except ValidationError as exc:
                raise ValueError(f"{path}:{n}: not a transition row: {exc}") from exc
    return rows


def write_transitions(path: str | Path, rows: Iterable[Transition]) -> int:
    """Write JSONL atomically (a temp file renamed into place: an interrupted export leaves no half file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        try:
            for row in rows:
                f.write(row.to_json() + "\n")
                count += 1
        except BaseException:
            Path(f.name).unlink(missing_ok=True)
            raise
    Path(f.name).replace(path)
    return count


def run_directory(run: str | Path) -> Path:
    """A model directory as given, or ``project/name`` under ``$FLYWHEEL_HOME``."""
    from flywheel.checkpoints.layout import model_path
    from flywheel.home import default_home

    path = Path(run)
    if path.is_dir():
        return path
    candidate = model_path(default_home(), str(path.parent), path.name) if len(path.parts) == 2 else None
    if candidate is not None and candidate.is_dir():
        return candidate
    raise FileNotFoundError(
        f"no run at {str(run)!r}: it is not a directory"
        + (f", nor a project/name under $FLYWHEEL_HOME ({candidate} does not exist)" if candidate else "")
    )


def run_transitions(run_dir: Path, split: str = "train", *, gamma: float = 1.0) -> Iterator[Transition]:
    """The transitions of a run's trajectories of ``split``, as the store holds them (``$FLYWHEEL_DB``, else the
    home's SQLite: ``flywheel.checkpoints.run.RunStore``; the ``trajectories/`` files are their export, and are
    imported first if the store has none of the run's)."""
    from flywheel.checkpoints.run import RunStore  # torch: not on this module's import path

    run = RunStore(run_dir)
    found = run.trajectory_texts(split)
    if not found:
        splits = run.trajectory_splits()
        raise FileNotFoundError(
            f"no {split} trajectories saved in {run_dir} (splits saved in this run: {splits or 'none'})"
        )
    for n, (step, text) in enumerate(found, start=1):
        try:
            traj = Trajectory.model_validate_json(text)
        except ValidationError as exc:
            raise ValueError(f"{run_dir}: {split} trajectory {n} (step {step}) is not a trajectory: {exc}") from exc
        yield from to_transitions(traj, gamma=gamma, step=step)

"""The dashboard's HTTP API, under ``/ui/api``: runs, a run's history rows and checkpoints, its rollouts by step and
split (paged), a step's groups ranked by reward, one trajectory as a chat (its sampled turns' tokens with their
log-probs where it saved them, its retokenized turns marked). Read-only, over the store (runs' history
rows and trajectories: ``flywheel.store.history``; deployments and gate decisions) and the model directories under a
home (``flywheel.checkpoints.layout``). A checkpoint says where it is deployed and what the gate decided on it, in the
loop API's shapes (``loop_api.py``, which serves the rest of the loop under ``/ui/api/loop``).

Every answer is a pydantic model; NaN and infinities (a metric may be NaN) are sent as null. An unknown run or
trajectory is a 404 with a message naming what exists; a query parameter out of range is FastAPI's 422 (400 on
``flywheel serve``, whose app answers every invalid request so).

A run is named by its project and model name; ``run=`` picks one of the name's runs (``RunKey.run``: one name
trained into one store from two directories is two runs), by default the one the home's directory of that name
keeps, else the one written to last. The store keeps a step's trajectories in the order they were saved, not their
groups: a group here is a stretch of consecutive trajectories of one step and split with the same prompt (the
messages before the first assistant turn), which is how a training step's groups are saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel
from sqlalchemy.orm import Session

from flywheel.checkpoints import layout
from flywheel.dashboard.common import MAX_INT, MAX_PAGE, PAGE, PREFIX, Number, finite
from flywheel.dashboard.loop_api import DeploymentOut, TimelineEventOut, deployment_out, gate_decisions
from flywheel.store import Store, deployments, history
from flywheel.store.history import RunKey, RunSummary
from flywheel.types import Trajectory, choice_to_message, intermediate_reward

VALIDATION = "val"  # the split of validation rows (``backend.log(..., split="val")``)
TRAINING = ("train", "sft")  # the splits of training steps' rows (LocalBackend's RL and SFT steps)
STEP_SECONDS = ("rollout_seconds", "score_seconds", "train_seconds")  # what a step's time is spent on
VALIDATION_REWARD = "val/reward"  # their mean reward: what "best" means for a checkpoint
PREVIEW = 200  # characters of an answer shown in a list
JUDGE = "RULER ("  # how a trajectory's log line from RULER starts (flywheel.rewards.ruler): the judge's explanation

Status = Literal["training", "stopped", "elsewhere"]
# query parameters (module-level: the routes' annotations are resolved here)
Run = Annotated[str | None, Query(max_length=64, description="One of the name's runs (default: see the module)")]
Split = Annotated[str, Query(min_length=1, max_length=64)]
Step = Annotated[int, Query(ge=0, le=MAX_INT)]


class UnknownRunError(LookupError):
    """No run of that project and model name (or no such ``run`` of it) in the store."""


class UnknownTrajectoryError(LookupError):
    """No saved trajectory with that id, or no group with that index at that step."""


# ---- answers ---------------------------------------------------------------------------------------------------


class RunOut(BaseModel):
    """A run in the runs table. ``status``: training (a backend on this machine has the model registered: its
    directory's lock is held), stopped, or elsewhere (its directory is not under this home: trained on another
    machine, or deleted). ``wall_seconds``: from its first row's time to its last's. What it cost, as far as its
    rows say (no prices): ``tokens_trained`` and ``step_seconds`` (sampling, scoring and training) summed over its
    training rows (``train`` and ``sft``), None when no row has them."""

    project: str
    name: str
    run: str
    status: Status
    base_model: str | None  # from its latest checkpoint's adapter config (LoRA); None without one under this home
    tokens_trained: int | None
    step_seconds: Number
    last_step: int
    best_val_reward: Number
    best_val_step: int | None
    wall_seconds: Number
    rows: int
    updated: Number  # the last row's time (Unix seconds)


class HistoryRowOut(BaseModel):
    """One history row: a training step's metrics (split ``train``) or an evaluation's (``val``, ...)."""

    step: int
    split: str | None
    time: Number
    checkpoint: bool  # a checkpoint was written with it
    metrics: dict[str, Number]


class HistoryOut(BaseModel):
    run: RunOut
    rows: list[HistoryRowOut]


class CheckpointOut(BaseModel):
    step: int
    val_reward: Number  # the validation reward logged at its step, if any
    best: bool  # the highest validation reward of the checkpoints (a NaN never wins; ties: the later step)
    deployed: list[DeploymentOut]  # where it is deployed: the aliases pointing at it (calc@production, ...)
    gate: TimelineEventOut | None  # the gate's decision on it (its lift's interval against production), if asked


class CheckpointsOut(BaseModel):
    directory: str | None  # the model's directory under the home, None when the run's is elsewhere
    checkpoints: list[CheckpointOut]


class RolloutStepOut(BaseModel):
    split: str
    step: int
    trajectories: int


class TrajectorySummary(BaseModel):
    id: int
    step: int
    split: str
    reward: float
    metrics: dict[str, Number]
    turns: int  # messages, sampled turns included
    tool_calls: int
    answer: str  # the last assistant turn's text, cut to PREVIEW characters


class TrajectoryPage(BaseModel):
    items: list[TrajectorySummary]
    offset: int
    next_offset: int | None  # where the next page starts; None after the last


class GroupOut(BaseModel):
    """A group of a step: its members ranked by reward, best first (ties: in the order saved)."""

    index: int
    prompt: str  # the last message before the first assistant turn, cut to PREVIEW characters
    reward_mean: float
    reward_spread: float  # best minus worst
    members: list[TrajectorySummary]


class ToolCallOut(BaseModel):
    id: str | None
    name: str
    arguments: str


class TokenOut(BaseModel):
    text: str
    logprob: Number  # the sampler's log-probability of the token it drew


class MessageOut(BaseModel):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut]
    tool_call_id: str | None
    sampled: bool  # the model sampled it (a trained turn), rather than a message given to it
    reward: Number  # a sampled turn's intermediate reward, if it has one
    # a sampled turn's tokens with their log-probs, as the sampler returned them; None when it saved none (the
    # request did not ask for log-probs, or the turn is not sampled)
    tokens: list[TokenOut] | None
    # an assistant turn given as text rather than as the tokens sampled: trained on as context, tokenized again
    # from its text (what the gateway counts as ``retokenized_turns``: a reply the agent edited, or one a lost call
    # never recorded)
    retokenized: bool


class TrajectoryOut(BaseModel):
    id: int
    project: str
    name: str
    run: str
    split: str
    step: int
    branch: str | None  # None on the run's live line; the abandoned branch's name otherwise
    reward: float
    metrics: dict[str, Number]
    graders: dict[str, Number]  # each grader's score ("grader/..." metrics, RULER's "ruler_score")
    judge: list[str]  # the judge's explanations (RULER's log lines)
    metadata: dict[str, Any]
    messages: list[MessageOut]
    tools: list[str]  # the names of the tools offered
    logs: list[str]


class GroupDetailOut(BaseModel):
    index: int
    split: str
    step: int
    members: list[TrajectoryOut]


# ---- the router ------------------------------------------------------------------------------------------------


def dashboard_router(store: Store, home: Path) -> APIRouter:
    """The API's routes over ``store`` and the model directories under ``home``."""
    router = APIRouter(prefix=PREFIX)

    @router.get("/runs")
    def list_runs() -> list[RunOut]:
        with store.session() as s:
            summaries = history.runs(s)
            best = _best_validation(history.split_rows(s, VALIDATION))
            costs = _costs([pair for split in TRAINING for pair in history.split_rows(s, split)])
        return [_run_out(home, summary, best.get(summary.key), costs.get(summary.key)) for summary in summaries]

    @router.get("/runs/{project}/{name}/history")
    def run_history(project: str, name: str, run: Run = None) -> HistoryOut:
        with store.session() as s:
            summary = _summary(s, home, project, name, run)
            rows = history.rows(s, summary.key)
        best = _best_validation([(summary.key, r) for r in rows if r.get("split") == VALIDATION])
        cost = _costs([(summary.key, r) for r in rows if r.get("split") in TRAINING]).get(summary.key)
        return HistoryOut(run=_run_out(home, summary, best.get(summary.key), cost), rows=[_row_out(r) for r in rows])

    @router.get("/runs/{project}/{name}/checkpoints")
    def run_checkpoints(project: str, name: str, run: Run = None) -> CheckpointsOut:
        with store.session() as s:
            key = _summary(s, home, project, name, run).key
            rows = history.rows(s, key)
            deployed = [deployment_out(d) for d in deployments.list_deployments(s, name)]
            gates = gate_decisions(s, name)
        directory = layout.model_path(home, project, name)
        if _directory_run(directory) != key.run:
            return CheckpointsOut(directory=None, checkpoints=[])
        rewards: dict[int, float | None] = {}
        for r in rows:
            if r.get("split") == VALIDATION:
                rewards[int(r.get("step", 0))] = finite(r.get(VALIDATION_REWARD))
        steps = layout.steps(directory)
        scored = [(reward, step) for step in steps if (reward := rewards.get(step)) is not None]
        best = max(scored)[1] if scored else None
        return CheckpointsOut(
            directory=str(directory),
            checkpoints=[
                CheckpointOut(
                    step=step,
                    val_reward=rewards.get(step),
                    best=step == best,
                    deployed=[d for d in deployed if d.step == step],
                    gate=gates.get(step),
                )
                for step in steps
            ],
        )

    @router.get("/runs/{project}/{name}/rollouts")
    def run_rollouts(project: str, name: str, run: Run = None) -> list[RolloutStepOut]:
        with store.session() as s:
            key = _summary(s, home, project, name, run).key
            counts = history.trajectory_counts(s, key)
        return [RolloutStepOut(split=split, step=step, trajectories=n) for split, step, n in counts]

    @router.get("/runs/{project}/{name}/trajectories")
    def run_trajectories(
        project: str,
        name: str,
        split: Split = "train",
        step: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = PAGE,
        offset: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
        run: Run = None,
    ) -> TrajectoryPage:
        with store.session() as s:
            key = _summary(s, home, project, name, run).key
            found = history.trajectory_page(s, key, split, step, limit=limit + 1, offset=offset)
        items = [_summary_out(i, k, split, Trajectory.model_validate_json(text)) for i, k, text in found[:limit]]
        return TrajectoryPage(items=items, offset=offset, next_offset=offset + limit if len(found) > limit else None)

    @router.get("/runs/{project}/{name}/groups")
    def step_groups(project: str, name: str, step: Step, split: Split = "train", run: Run = None) -> list[GroupOut]:
        _, groups = _groups(store, home, project, name, run, split, step)
        return [
            GroupOut(
                index=index,
                prompt=_prompt(members[0][1]),
                reward_mean=sum(t.reward for _, t in members) / len(members),
                reward_spread=max(t.reward for _, t in members) - min(t.reward for _, t in members),
                members=[_summary_out(i, step, split, t) for i, t in _ranked(members)],
            )
            for index, members in enumerate(groups)
        ]

    @router.get("/runs/{project}/{name}/groups/{index}")
    def step_group(
        project: str,
        name: str,
        index: Annotated[int, PathParam(ge=0, le=MAX_INT)],
        step: Step,
        split: Split = "train",
        run: Run = None,
    ) -> GroupDetailOut:
        key, groups = _groups(store, home, project, name, run, split, step)
        if index >= len(groups):
            raise UnknownTrajectoryError(
                f"Step {step} of split '{split}' has {len(groups)} group(s) (indexes 0 to {len(groups) - 1}), no "
                f"group {index}."
            )
        members = [_trajectory_out(i, key, split, step, None, t) for i, t in _ranked(groups[index])]
        return GroupDetailOut(index=index, split=split, step=step, members=members)

    @router.get("/trajectories/{trajectory_id}")
    def one_trajectory(trajectory_id: Annotated[int, PathParam(ge=1, le=MAX_INT)]) -> TrajectoryOut:
        with store.session() as s:
            found = history.trajectory(s, trajectory_id)
        if found is None:
            raise UnknownTrajectoryError(f"No saved trajectory has the id {trajectory_id}.")
        key, split, step, branch, text = found
        return _trajectory_out(trajectory_id, key, split, step, branch, Trajectory.model_validate_json(text))

    return router


# ---- runs ------------------------------------------------------------------------------------------------------


def _summary(s: Session, home: Path, project: str, name: str, run: str | None) -> RunSummary:
    """The run asked for (see the module), or an ``UnknownRunError`` naming those there are."""
    found = [r for r in history.runs(s) if r.key.project == project and r.key.model == name]
    if not found:
        known = sorted({f"{r.key.project}/{r.key.model}" for r in history.runs(s)})
        raise UnknownRunError(
            f"No run of model '{name}' in project '{project}' in the store. Runs: {', '.join(known) or 'none'}."
        )
    if run is None:
        local = _directory_run(layout.model_path(home, project, name))
        return next((r for r in found if r.key.run == local), found[0])
    for r in found:
        if r.key.run == run:
            return r
    raise UnknownRunError(
        f"Model '{name}' of project '{project}' has no run '{run}'. Its runs: {', '.join(r.key.run for r in found)}."
    )


def _directory_run(directory: Path) -> str | None:
    """The run id a model directory keeps ("" for a directory from before run ids), None without a directory."""
    if not directory.is_dir():
        return None
    path = directory / layout.RUN
    return path.read_text().strip() if path.exists() else history.BEFORE_IDS


def _status(home: Path, key: RunKey) -> Status:
    directory = layout.model_path(home, key.project, key.model)
    if _directory_run(directory) != key.run:
        return "elsewhere"
    return "training" if _lock_held(directory / layout.LOCK) else "stopped"


def _lock_held(path: Path) -> bool:
    """Whether some process holds the flock on ``path``, from Linux's ``/proc/locks`` (never taking it: a backend
    registering the model at that instant would be refused). False where there is no ``/proc/locks``."""
    try:
        inode = path.stat().st_ino
        text = Path("/proc/locks").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        fields = line.replace("->", "").split()  # "1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF"
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            return True
    return False


def _best_validation(rows: list[tuple[RunKey, dict[str, Any]]]) -> dict[RunKey, tuple[float, int]]:
    """Each run's best validation reward and its step (a NaN never wins; ties: the later step)."""
    best: dict[RunKey, tuple[float, int]] = {}
    for key, row in rows:
        reward = finite(row.get(VALIDATION_REWARD))
        if reward is not None and (key not in best or (reward, row.get("step", 0)) >= best[key]):
            best[key] = (reward, int(row.get("step", 0)))
    return best


def _costs(rows: list[tuple[RunKey, dict[str, Any]]]) -> dict[RunKey, tuple[int | None, float | None]]:
    """Each run's tokens trained and step seconds summed over ``rows`` (None: no row has them; NaN rows skipped)."""
    sums: dict[RunKey, tuple[int | None, float | None]] = {}
    for key, row in rows:
        tokens, seconds = sums.get(key, (None, None))
        if (n := finite(row.get("tokens_trained"))) is not None:
            tokens = (tokens or 0) + int(n)
        for name in STEP_SECONDS:
            if (t := finite(row.get(name))) is not None:
                seconds = (seconds or 0.0) + t
        sums[key] = (tokens, seconds)
    return sums


def _base_model(home: Path, key: RunKey) -> str | None:
    """The base model named in the run's latest checkpoint's adapter config (a LoRA checkpoint's, as the trainer
    writes it), if its directory is under this home and has one."""
    directory = layout.model_path(home, key.project, key.model)
    if _directory_run(directory) != key.run or (step := layout.latest(directory)) is None:
        return None
    try:
        config = json.loads((layout.checkpoint_dir(directory, step) / layout.ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):  # full fine-tuning writes none; an unreadable one names nothing
        return None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return base if isinstance(base, str) else None


def _run_out(
    home: Path, summary: RunSummary, best: tuple[float, int] | None, cost: tuple[int | None, float | None] | None
) -> RunOut:
    first, last = summary.first_time, summary.last_time
    tokens, seconds = cost or (None, None)
    return RunOut(
        project=summary.key.project,
        name=summary.key.model,
        run=summary.key.run,
        status=_status(home, summary.key),
        base_model=_base_model(home, summary.key),
        tokens_trained=tokens,
        step_seconds=seconds,
        last_step=summary.last_step,
        best_val_reward=best[0] if best else None,
        best_val_step=best[1] if best else None,
        wall_seconds=last - first if first is not None and last is not None else None,
        rows=summary.rows,
        updated=last,
    )


def _row_out(row: dict[str, Any]) -> HistoryRowOut:
    metrics = {
        k: finite(v)
        for k, v in row.items()
        if k not in ("step", "split", "time", "checkpoint") and isinstance(v, int | float) and not isinstance(v, bool)
    }
    return HistoryRowOut(
        step=int(row.get("step", 0)),
        split=row.get("split"),
        time=finite(row.get("time")),
        checkpoint=bool(row.get("checkpoint")),
        metrics=metrics,
    )


# ---- trajectories ----------------------------------------------------------------------------------------------


def _groups(
    store: Store, home: Path, project: str, name: str, run: str | None, split: str, step: int
) -> tuple[RunKey, list[list[tuple[int, Trajectory]]]]:
    """The run, and its step's trajectories in groups (see the module): stretches saved in a row with one prompt."""
    with store.session() as s:
        key = _summary(s, home, project, name, run).key
        found = history.trajectory_page(s, key, split, step)
    if not found:
        raise UnknownTrajectoryError(f"Run {project}/{name} saved no trajectories of split '{split}' at step {step}.")
    groups: list[list[tuple[int, Trajectory]]] = []
    last: str | None = None
    for i, _, text in found:
        trajectory = Trajectory.model_validate_json(text)
        prompt = _prompt_key(trajectory)
        if prompt != last:
            groups.append([])
            last = prompt
        groups[-1].append((i, trajectory))
    return key, groups


def _ranked(members: list[tuple[int, Trajectory]]) -> list[tuple[int, Trajectory]]:
    return sorted(members, key=lambda m: -m[1].reward)  # stable: ties stay in the order saved


def _is_assistant(item: Any) -> bool:
    return isinstance(item, Choice) or (isinstance(item, dict) and item.get("role") == "assistant")


def _prompt_messages(trajectory: Trajectory) -> list[Any]:
    prompt = []
    for item in trajectory.messages_and_choices:
        if _is_assistant(item):
            break
        prompt.append(item)
    return prompt


def _prompt_key(trajectory: Trajectory) -> str:
    return json.dumps(_prompt_messages(trajectory), sort_keys=True, default=str)


def _prompt(trajectory: Trajectory) -> str:
    prompt = _prompt_messages(trajectory)
    return _cut(_text(prompt[-1].get("content")) or "") if prompt else ""


def _text(content: Any) -> str | None:
    """A message's content as text: a string, or a list of parts' texts (other parts named in brackets)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") if p.get("type") == "text" else f"[{p.get('type', 'part')}]"
            for p in content
            if isinstance(p, dict)
        )
    return str(content)


def _cut(text: str) -> str:
    return text if len(text) <= PREVIEW else text[: PREVIEW - 1] + "…"


def _finite(values: dict[str, Any]) -> dict[str, Number]:
    return {k: finite(v) for k, v in values.items()}


def _summary_out(trajectory_id: int, step: int, split: str, trajectory: Trajectory) -> TrajectorySummary:
    messages = trajectory.messages()
    answers = [m for m in messages if m.get("role") == "assistant"]
    return TrajectorySummary(
        id=trajectory_id,
        step=step,
        split=split,
        reward=trajectory.reward,
        metrics=_finite(trajectory.metrics),
        turns=len(messages),
        tool_calls=sum(len(m.get("tool_calls") or []) for m in answers),
        answer=_cut(_text(answers[-1].get("content")) or "") if answers else "",
    )


def _message_out(item: Any) -> MessageOut:
    sampled = isinstance(item, Choice)
    message = choice_to_message(item) if sampled else item
    calls = [
        ToolCallOut(
            id=call.get("id"),
            name=str((call.get("function") or {}).get("name", call.get("type", "tool"))),
            arguments=str((call.get("function") or {}).get("arguments", "")),
        )
        for call in message.get("tool_calls") or []
    ]
    role = str(message.get("role", ""))
    return MessageOut(
        role=role,
        content=_text(message.get("content")),
        tool_calls=calls,
        tool_call_id=message.get("tool_call_id"),
        sampled=sampled,
        reward=finite(intermediate_reward(item)) if sampled else None,
        tokens=_tokens(item) if sampled else None,
        retokenized=role == "assistant" and not sampled,
    )


def _tokens(choice: Choice) -> list[TokenOut] | None:
    content = choice.logprobs.content if choice.logprobs else None
    return [TokenOut(text=t.token, logprob=finite(t.logprob)) for t in content] if content else None


def _trajectory_out(
    trajectory_id: int, key: RunKey, split: str, step: int, branch: str | None, trajectory: Trajectory
) -> TrajectoryOut:
    metrics = _finite(trajectory.metrics)
    return TrajectoryOut(
        id=trajectory_id,
        project=key.project,
        name=key.model,
        run=key.run,
        split=split,
        step=step,
        branch=branch,
        reward=trajectory.reward,
        metrics=metrics,
        graders={k: v for k, v in metrics.items() if k.startswith("grader/") or k == "ruler_score"},
        judge=[line for line in trajectory.logs if line.startswith(JUDGE)],
        metadata={k: finite(v) if isinstance(v, float) else v for k, v in trajectory.metadata.items()},
        messages=[_message_out(item) for item in trajectory.messages_and_choices],
        tools=[str((t.get("function") or {}).get("name", t.get("name", "?"))) for t in trajectory.tools or []],
        logs=trajectory.logs,
    )

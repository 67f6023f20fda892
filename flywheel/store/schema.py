"""The tables (SQLAlchemy 2 declarative models). A change here needs a migration under ``migrations/versions``."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    type_annotation_map: ClassVar = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime(timezone=True)}


class Episode(Base):
    """One run of an agent on one task: its calls, then its outcome."""

    __tablename__ = "episodes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # unguessable: it is the episode's capability URL
    task_id: Mapped[str] = mapped_column(String(256), index=True)  # episodes of one task form a group
    split: Mapped[str] = mapped_column(String(32))
    model: Mapped[str | None] = mapped_column(String(256))  # the model it was created for (calls may name another)
    status: Mapped[str] = mapped_column(String(16), index=True)  # open | finished | abandoned
    reward: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, Any]]
    meta: Mapped[dict[str, Any]]  # the creator's metadata
    created_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]


class Call(Base):
    """One chat completion made in an episode: what was asked, what was fed and sampled, and how."""

    __tablename__ = "calls"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # also the calls' order
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(256))  # the name the request asked for
    step: Mapped[int | None] = mapped_column(Integer)  # the checkpoint step that answered, when known
    request: Mapped[dict[str, Any]]  # messages, tools and parameters, as sent
    response: Mapped[dict[str, Any]]  # the chat.completion body, with every choice's token ids and log-probs
    prompt_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    latency_ms: Mapped[float] = mapped_column(Float)
    # the earlier output whose exact sampled ids this prompt reuses (token-in, token-out), if any
    prefix_call: Mapped[int | None] = mapped_column(Integer)
    prefix_choice: Mapped[int | None] = mapped_column(Integer)
    prefix_message: Mapped[int | None] = mapped_column(Integer)  # that output's index in this request's messages
    retokenized_turns: Mapped[int]  # assistant turns in the request that matched no recorded output
    reward: Mapped[float | None] = mapped_column(Float)  # an intermediate reward for this call alone
    created_at: Mapped[datetime]
    # answered by an upstream (its scheme://host:port), not the local engine; nothing was spliced into its prompt
    upstream: Mapped[str | None] = mapped_column(String(256))
    # its response has no token ids (an upstream returned none): fit for SFT, graders and evaluation, not RL
    text_only: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    deployment: Mapped[str | None] = mapped_column(String(300))  # the alias it was asked as (calc@production)


class Task(Base):
    """Work the training side queued for runners: a payload that ``group_size`` attempts each run once."""

    __tablename__ = "tasks"

    id: Mapped[str] = mapped_column(String(256), primary_key=True)  # the group key: its episodes carry it
    payload: Mapped[dict[str, Any]]  # what the runner's agent is given
    group_size: Mapped[int]
    split: Mapped[str] = mapped_column(String(32))
    model: Mapped[str | None] = mapped_column(String(256))  # the name the agent calls
    max_tries: Mapped[int]  # tries an attempt gets before it fails
    created_at: Mapped[datetime]


class Attempt(Base):
    """One of a task's ``group_size`` runs: queued, leased to a runner (with the episode it runs in), finished or
    failed. An expired or failed try requeues it until ``max_tries``."""

    __tablename__ = "attempts"
    __table_args__ = (Index("ix_attempts_queue", "status", "created_at"),)  # the oldest queued attempt, at once

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    index: Mapped[int]  # 0 .. group_size - 1
    status: Mapped[str] = mapped_column(String(16))  # queued | leased | finished | failed
    tries: Mapped[int]  # tries that ended without a result (lease expired, or the runner failed it)
    runner: Mapped[str | None] = mapped_column(String(256))  # who holds the lease
    # the episode of the current (or last) try: a lease is this episode, a result names it
    episode_id: Mapped[str | None] = mapped_column(ForeignKey("episodes.id", ondelete="SET NULL"))
    lease_seconds: Mapped[float | None] = mapped_column(Float)
    lease_expires_at: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(String(2000))  # why the last try ended without a result
    created_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]  # when it finished or failed


class AuditEvent(Base):
    """One thing someone did (append-only): hash-chained to the event before it (``store/audit.py``)."""

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # the chain's order
    at: Mapped[datetime]
    actor: Mapped[str] = mapped_column(String(256))
    action: Mapped[str] = mapped_column(String(64), index=True)
    subject: Mapped[str] = mapped_column(String(300), index=True)  # what it acted on, e.g. a deployment's alias
    reason: Mapped[str | None] = mapped_column(String(2000))
    details: Mapped[dict[str, Any]]
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))
    mac: Mapped[str | None] = mapped_column(String(64))  # HMAC over hash with the audit key, when one is set


class AuditHead(Base):
    """The chain's one head row: its length and last hash. Each append locks it, so appends never fork."""

    __tablename__ = "audit_head"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1
    count: Mapped[int]
    hash: Mapped[str] = mapped_column(String(64))


class Deployment(Base):
    """A named alias (``<model>@<stage>``) that points at one of the model's checkpoint steps."""

    __tablename__ = "deployments"

    name: Mapped[str] = mapped_column(String(300), primary_key=True)
    model: Mapped[str] = mapped_column(String(256), index=True)
    stage: Mapped[str] = mapped_column(String(32))
    step: Mapped[int]
    share: Mapped[float | None] = mapped_column(Float)  # canary, shadow: the share of traffic, 0..1
    updated_at: Mapped[datetime]
    updated_by: Mapped[str] = mapped_column(String(256))
    event_id: Mapped[int]  # the audit event that set it


class GraderStackVersion(Base):
    """A grader stack as it was at one version (its content hash): what produced the grades that name it."""

    __tablename__ = "grader_stacks"

    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(256), index=True)
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]


class Grade(Base):
    """One component's score for one episode, by one stack version (re-grading with it replaces the row)."""

    __tablename__ = "grades"
    __table_args__ = (
        UniqueConstraint("episode_id", "version", "component", name="uq_grades_episode_version_component"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"))
    version: Mapped[str] = mapped_column(ForeignKey("grader_stacks.version"), index=True)
    component: Mapped[str] = mapped_column(String(300))  # reward | safety | holdout/<name>
    grader: Mapped[str] = mapped_column(String(256))
    score: Mapped[float] = mapped_column(Float)
    details: Mapped[dict[str, Any]]  # sub-rewards, errors, what the grader reported
    created_at: Mapped[datetime]


class Feedback(Base):
    """Outcome feedback that arrived for an episode, possibly long after it finished."""

    __tablename__ = "feedback"
    __table_args__ = (UniqueConstraint("episode_id", "key", name="uq_feedback_episode_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(64))  # resolved | rating | kpi/<name> | ...
    value: Mapped[float] = mapped_column(Float)
    note: Mapped[str | None] = mapped_column(String(2000))
    source: Mapped[str | None] = mapped_column(String(256))  # who sent it (a CRM, the user, a reviewer)
    key: Mapped[str | None] = mapped_column(String(256))  # the sender's id for it: posting it again is harmless
    created_at: Mapped[datetime]


class Review(Base):
    """An episode queued for human review (one row per episode: it is never queued twice), and its label once a
    reviewer gave one: 1 pass, 0 fail, or a score from 0 to 1."""

    __tablename__ = "reviews"

    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True)
    sample_event: Mapped[int]  # the audit event of the sample that queued it (its seed, share and filters)
    queued_at: Mapped[datetime] = mapped_column(index=True)
    label: Mapped[float | None] = mapped_column(Float)
    kind: Mapped[str | None] = mapped_column(String(16))  # pass_fail | score
    note: Mapped[str | None] = mapped_column(String(2000))
    labelled_by: Mapped[str | None] = mapped_column(String(256))
    labelled_at: Mapped[datetime | None]
    label_event: Mapped[int | None]  # the audit event that recorded the label


class RunHistoryRow(Base):
    """One history row of a model's run (a training step's or an evaluation's metrics), as ``flywheel.checkpoints.run``
    writes it: the row itself is JSON text (it may hold NaN, as ``history.jsonl`` does), its step, split and time
    columns are there to query by. ``run`` is the id the model's directory keeps (two machines training one name are two
    runs; "" for rows stored before runs had ids). ``branch`` is None on the run's live line; rows of a branch given up
    (training went on from an earlier checkpoint) keep the name of the ``abandoned/`` directory they were archived
    to."""

    __tablename__ = "run_history"
    __table_args__ = (Index("ix_run_history_run", "project", "model", "run", "branch", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # the rows' order
    project: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(256))
    run: Mapped[str] = mapped_column(String(64), server_default="")
    step: Mapped[int]
    split: Mapped[str | None] = mapped_column(String(64))
    time: Mapped[float | None] = mapped_column(Float)
    row: Mapped[str] = mapped_column(Text)
    branch: Mapped[str | None] = mapped_column(String(256))


class RunTrajectory(Base):
    """One trajectory a model's run saved with a step (the trained ones, an evaluation's), as JSON text;
    ``run`` and ``branch`` as for ``RunHistoryRow``."""

    __tablename__ = "run_trajectories"
    __table_args__ = (Index("ix_run_trajectories_run", "project", "model", "run", "branch", "split", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # the order they were saved in
    project: Mapped[str] = mapped_column(String(256))
    model: Mapped[str] = mapped_column(String(256))
    run: Mapped[str] = mapped_column(String(64), server_default="")
    split: Mapped[str] = mapped_column(String(64))
    step: Mapped[int]
    trajectory: Mapped[str] = mapped_column(Text)
    branch: Mapped[str | None] = mapped_column(String(256))


class FineTuningFile(Base):
    """A file uploaded through ``/v1/files`` (its bytes are under the home's ``files/``, named by its id)."""

    __tablename__ = "ft_files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # file-<hex>
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(Integer)
    lines: Mapped[int] = mapped_column(Integer)  # JSONL rows
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]


class FineTuningJob(Base):
    """A fine-tuning job as ``/v1/fine_tuning/jobs`` created it, and where it stands (OpenAI's states)."""

    __tablename__ = "ft_jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # ftjob-<hex>
    seq: Mapped[int] = mapped_column(Integer, unique=True)  # creation order (the list's, the queue's)
    model: Mapped[str] = mapped_column(String(256))  # as the request named it
    base_model: Mapped[str] = mapped_column(String(256))  # what Flywheel trains (an alias resolved)
    method: Mapped[dict[str, Any]]  # {"type": ..., "<type>": {"hyperparameters": ..., "grader": ...}}, resolved
    training_file: Mapped[str] = mapped_column(String(64))
    validation_file: Mapped[str | None] = mapped_column(String(64))
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(Integer)
    meta: Mapped[dict[str, Any]]  # the request's metadata
    status: Mapped[str] = mapped_column(String(32), index=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, server_default=false())
    fine_tuned_model: Mapped[str | None] = mapped_column(String(256))
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    trained_tokens: Mapped[int | None] = mapped_column(Integer)
    result_files: Mapped[list[str] | None] = mapped_column(JSON)  # file ids: the step metrics, once it succeeded
    estimated_finish: Mapped[datetime | None]  # while it runs: at the pace of its steps so far
    created_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]


class FineTuningEvent(Base):
    """One event of a job (a message, or a step's metrics), as ``/v1/fine_tuning/jobs/{id}/events`` lists them."""

    __tablename__ = "ft_job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("ft_jobs.id", ondelete="CASCADE"), index=True)
    level: Mapped[str] = mapped_column(String(8))  # info | warn | error
    type: Mapped[str] = mapped_column(String(16))  # message | metrics
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]


class FineTuningCheckpoint(Base):
    """A checkpoint a job kept (one per epoch), served as the model ``fine_tuned_model_checkpoint`` names."""

    __tablename__ = "ft_checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_ft_checkpoints_job_step"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # ftckpt-<hex>
    job_id: Mapped[str] = mapped_column(ForeignKey("ft_jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(300))  # name@step
    metrics: Mapped[dict[str, Any]]
    created_at: Mapped[datetime]


class ToolPolicy(Base):
    """A deployment's tools: those it may call (its scope; None: any) and those that are high-impact (in production
    a person approves each call; elsewhere ``otherwise`` decides, so rollouts never wait)."""

    __tablename__ = "tool_policies"

    deployment: Mapped[str] = mapped_column(String(300), primary_key=True)  # an alias, calc@production
    allowed: Mapped[list[Any] | None] = mapped_column(JSON)  # tool names; None: any tool
    high_impact: Mapped[list[Any]]  # tool names
    timeout_s: Mapped[float] = mapped_column(Float)  # a person's time to decide; then the call is denied
    otherwise: Mapped[str] = mapped_column(String(16))  # off production: deny | allow | grader
    grader: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # the grader that decides when otherwise = grader
    threshold: Mapped[float] = mapped_column(Float)  # its least reward that allows the call
    updated_at: Mapped[datetime]
    updated_by: Mapped[str] = mapped_column(String(256))
    event_id: Mapped[int]  # the audit event that set it


class Approval(Base):
    """A high-impact tool call waiting for (or given) a decision: a person's, a policy's, or the timeout's."""

    __tablename__ = "approvals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment: Mapped[str | None] = mapped_column(String(300))  # the alias the call was made to, if any
    episode_id: Mapped[str | None] = mapped_column(String(64), index=True)
    split: Mapped[str | None] = mapped_column(String(32))
    tool: Mapped[str] = mapped_column(String(256))
    arguments: Mapped[str] = mapped_column(Text)  # as the model wrote them (redacted as its split's calls are)
    call_id: Mapped[str | None] = mapped_column(String(256))  # the tool call's id in the model's answer
    status: Mapped[str] = mapped_column(String(16), index=True)  # pending | approved | denied | expired
    requested_at: Mapped[datetime]
    deadline: Mapped[datetime]
    decided_at: Mapped[datetime | None]
    decided_by: Mapped[str | None] = mapped_column(String(256))  # a person, "policy:<rule>" or "timeout"
    reason: Mapped[str | None] = mapped_column(String(2000))
    request_event: Mapped[int]  # the audit event of the request
    decision_event: Mapped[int | None]  # the audit event of the decision

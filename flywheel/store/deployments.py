"""Deployments: named aliases (``<model>@<stage>``, e.g. ``calc@production``, ``calc@canary``) that point at one of
a model's checkpoint steps, and, for a canary or a shadow, the share of traffic it is meant for (0..1).

The gateway applies the share (``flywheel/gateway/traffic.py``): a canary answers that share of production's
episodes, a shadow is sent a copy of that share's calls. ``remove`` ends an alias (audited too).

A stage is a word (``production``, ``canary``, ``shadow``; lowercase letters, digits, ``-`` and ``_``, starting
with a letter): ``name@3`` already means checkpoint step 3. Every change (deploy, promote, rollback) is one unit
of work that updates the alias *and* appends its audit event (``store/audit.py``): both or neither. So an alias's
history is its events in the audit chain, and ``rollback`` replays them.

The store knows no checkpoints on disk: a caller checks that the step exists (the model's ``RunStore``) before it
points an alias at it.
"""

from __future__ import annotations

import math
import re

from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session

from flywheel.store import audit
from flywheel.store.audit import AuditEventRecord
from flywheel.store.episodes import Timestamp
from flywheel.store.schema import Deployment

STAGE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
ACTIONS = ("deploy", "promote", "rollback", "remove")  # the audit actions that move an alias (or end it)


class InvalidAliasError(ValueError):
    """A name that is not ``<model>@<stage>``."""


class UnknownDeploymentError(LookupError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(
            f"The deployment '{name}' does not exist. Deployments of that model: {', '.join(known) or 'none'}."
        )
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])


class NoRollbackError(RuntimeError):
    """An alias whose history has no earlier step to go back to."""


class DeploymentRecord(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    model: str
    stage: str
    step: int
    share: float | None
    updated_at: Timestamp
    updated_by: str
    event_id: int

    @property
    def target(self) -> str:
        """The served name of the checkpoint it points at (``calc@3``)."""
        return f"{self.model}@{self.step}"


def parse_alias(name: str) -> tuple[str, str]:
    """``"calc@production"`` -> ``("calc", "production")``; anything else is an ``InvalidAliasError``."""
    model, sep, stage = name.rpartition("@")
    if not sep or not model:
        raise InvalidAliasError(f"'{name}' is not a deployment: write it as MODEL@STAGE, e.g. calc@production")
    if not STAGE.fullmatch(stage):
        raise InvalidAliasError(
            f"'{stage}' in '{name}' is not a stage: a stage is a word (e.g. production, canary, shadow: lowercase "
            "letters, digits, - and _, starting with a letter, at most 32); MODEL@<number> is a checkpoint step"
        )
    if len(name) > 300:
        raise InvalidAliasError(f"the deployment name '{name[:40]}...' is {len(name)} characters long; at most 300")
    return model, stage


def is_alias(name: str) -> bool:
    """Whether a model name has a deployment's form (``calc@production``, not ``calc`` nor ``calc@3``)."""
    try:
        parse_alias(name)
    except InvalidAliasError:
        return False
    return True


def _known(s: Session, model: str) -> list[str]:
    return list(s.scalars(select(Deployment.name).where(Deployment.model == model).order_by(Deployment.name)))


def find(s: Session, name: str) -> DeploymentRecord | None:
    """The deployment ``name``, or None."""
    parse_alias(name)
    row = s.get(Deployment, name)
    return None if row is None else DeploymentRecord.model_validate(row)


def get(s: Session, name: str) -> DeploymentRecord:
    """The deployment ``name`` (``UnknownDeploymentError`` naming the model's others, if there is none)."""
    if (found := find(s, name)) is None:
        raise UnknownDeploymentError(name, _known(s, name.rpartition("@")[0]))
    return found


def list_deployments(s: Session, model: str | None = None) -> list[DeploymentRecord]:
    query = select(Deployment).order_by(Deployment.model, Deployment.stage)
    if model is not None:
        query = query.where(Deployment.model == model)
    return [DeploymentRecord.model_validate(row) for row in s.scalars(query)]


def deploy(
    s: Session,
    name: str,
    step: int,
    *,
    actor: str,
    share: float | None = None,
    reason: str | None = None,
    action: str = "deploy",
    details: dict | None = None,
) -> DeploymentRecord:
    """Point ``name`` at checkpoint ``step`` (which the caller checked exists), with its audit event, in this unit
    of work. ``action`` names the event (``deploy``, ``promote``, ``rollback``); ``details`` are added to it."""
    model, stage = parse_alias(name)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a checkpoint step (an integer >= 0), not {step!r}")
    if share is not None and not (math.isfinite(share) and 0 <= share <= 1):
        raise ValueError(f"share must be a number from 0 to 1, not {share!r}")
    audit.lock(s)  # first: the step read below is still the alias's when the event records it
    row = s.get(Deployment, name)
    event = audit.append(
        s,
        actor=actor,
        action=action,
        subject=name,
        reason=reason,
        details={
            **(details or {}),
            "model": model,
            "stage": stage,
            "step": step,
            "share": share,
            "previous_step": None if row is None else row.step,
            "previous_share": None if row is None else row.share,
        },
    )
    if row is None:
        row = Deployment(name=name, model=model, stage=stage)
        s.add(row)
    row.step, row.share, row.updated_at, row.updated_by, row.event_id = step, share, event.at, actor, event.id
    s.flush()
    return DeploymentRecord.model_validate(row)


def promote(
    s: Session, model: str, *, actor: str, source: str = "canary", target: str = "production", reason: str | None = None
) -> DeploymentRecord:
    """Point ``model@target`` at the step ``model@source`` has (all of its traffic: no share), audited as a
    promotion."""
    if source == target:
        raise ValueError(f"promote from '{source}' to '{target}': the stages must differ")
    audit.lock(s)
    origin = get(s, f"{model}@{source}")
    return deploy(
        s, f"{model}@{target}", origin.step, actor=actor, reason=reason, action="promote", details={"from": origin.name}
    )


def remove(s: Session, name: str, *, actor: str, reason: str | None = None) -> AuditEventRecord:
    """Delete the alias ``name``, with its audit event, in this unit of work (a canary or shadow ended: the gateway
    sends it no traffic from the next request on). Its history before it was removed is not rolled back to."""
    audit.lock(s)
    current = get(s, name)
    event = audit.append(
        s,
        actor=actor,
        action="remove",
        subject=name,
        reason=reason,
        details={"model": current.model, "stage": current.stage, "previous_step": current.step,
                 "previous_share": current.share},
    )  # fmt: skip
    row = s.get(Deployment, name)
    s.delete(row)
    s.flush()
    return event


def history(s: Session, name: str) -> list[AuditEventRecord]:
    """The audit events that moved (or removed) the alias, oldest first."""
    parse_alias(name)
    return audit.events(s, subject=name, actions=ACTIONS)


def rollback_target(s: Session, name: str) -> tuple[int, float | None]:
    """The step (and share) a rollback of ``name`` goes back to: its history replayed (a deploy or a promotion
    moves it forward, a rollback undoes the latest move not yet undone), the one before the current. Takes the
    audit chain's lock, so a ``deploy`` in the same unit of work applies what was read here."""
    audit.lock(s)
    get(s, name)
    moves = _moves(s, name)
    if len(moves) < 2:
        raise NoRollbackError(f"'{name}' has no earlier step to roll back to (its history: {len(moves)} move(s) left)")
    return moves[-2]


def _moves(s: Session, name: str) -> list[tuple[int, float | None]]:
    """The alias's history replayed: the (step, share) of each move not undone, oldest first (the last is current)."""
    moves: list[tuple[int, float | None]] = []
    for event in history(s, name):
        if event.action == "remove":
            moves.clear()  # what it pointed at before it was removed is not gone back to
        elif event.action == "rollback":
            if moves:
                moves.pop()
        else:
            moves.append((event.details["step"], event.details.get("share")))
    return moves


def steps_in_use(s: Session, model: str, rollback: int = 1) -> set[int]:
    """The checkpoint steps ``model``'s deployments need: the step each alias points at and the ``rollback`` steps
    before it that ``rollback`` would go back to, one after another."""
    steps: set[int] = set()
    for deployment in list_deployments(s, model):
        steps.add(deployment.step)
        if rollback > 0:
            steps.update(step for step, _ in _moves(s, deployment.name)[-1 - rollback : -1])
    return steps

"""``flywheel loop CONFIG``: run the flywheel loop on a local backend and print what it decided; ``--clear-alarm``
clears its reward-hacking alarm instead (audited, with ``--why``)."""

from __future__ import annotations

import asyncio
import getpass
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError
from rich.table import Table

from flywheel.cli.common import VLLMApiKey, console, fail, open_store

if TYPE_CHECKING:
    from flywheel.loop.driver import LoopConfig


def _problems(exc: ValidationError, source: Path) -> str:
    lines = [f"  {'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors(include_url=False)]
    return f"{source}: invalid ({len(lines)} problem{'s' * (len(lines) != 1)}):\n" + "\n".join(lines)


def loop_command(
    config: Annotated[Path, typer.Argument(help="The loop's configuration (YAML or JSON).")],
    home: Annotated[Path | None, typer.Option(help="Projects directory (default $FLYWHEEL_HOME).")] = None,
    actor: Annotated[str | None, typer.Option(help="Who runs it, for the audit trail (default: $USER).")] = None,
    clear_alarm: Annotated[
        bool, typer.Option("--clear-alarm", help="Clear the loop's reward-hacking alarm (with --why) and exit.")
    ] = False,
    why: Annotated[str | None, typer.Option(help="Why the alarm is cleared (the audit event's reason).")] = None,
    vllm: Annotated[
        str | None,
        typer.Option(
            help="vLLM servers (URL[,URL]) that sample the model: every step's LoRA adapter is loaded into them "
            "(VLLMBackend; started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, docs/user-guide.md)."
        ),
    ] = None,
    vllm_model_dir: Annotated[
        Path | None,
        typer.Option(help="The base model directory the vLLM servers serve (default: the loop's base model's)."),
    ] = None,
    vllm_api_key: VLLMApiKey = None,
) -> None:
    """Run the flywheel loop: production episodes become training tasks, the model trains through the gateway's
    runners, and every few steps a candidate meets the promotion gate (a passing one goes to MODEL@canary). Killed
    and started again, it takes up where it stopped (docs/user-guide.md, "Restarting the loop")."""
    from flywheel.graders.spec import GraderSpecError
    from flywheel.local.backend import LocalBackend
    from flywheel.loop.driver import Loop, LoopConfig
    from flywheel.loop.ladder import RewindError

    refusals: tuple[type[Exception], ...] = ()  # --vllm: servers that fail their probes, a model they cannot serve
    try:
        loop_config = LoopConfig.load(config)
        if clear_alarm:
            _clear_alarm(loop_config, config, home, actor or getpass.getuser(), why)
            return
        if vllm is not None:
            from flywheel.inference.vllm_engine import VLLMRefusedError
            from flywheel.vllm_backend import UnservableModelError, VLLMBackend

            refusals = (VLLMRefusedError, UnservableModelError)
            backend: LocalBackend = VLLMBackend(
                vllm,
                vllm_model_dir=vllm_model_dir,
                vllm_api_key=vllm_api_key,
                max_staleness_steps=loop_config.max_staleness_steps,  # groups that old still find their adapter
                path=home,
            )
        else:
            backend = LocalBackend(path=home)
        # the stack, the held-out set and the seed tasks are read before any model loads
        loop = Loop(loop_config, backend, actor=actor or getpass.getuser())
    except ValidationError as exc:
        fail(_problems(exc, config), plain=True)
    except (GraderSpecError, OSError, ValueError) as exc:
        fail(f"{config}: {exc}", plain=True)

    async def run():
        try:
            return await loop.run()
        finally:
            await loop.backend.close()

    from flywheel.checkpoints.run import CheckpointWriteError, ModelInUseError
    from flywheel.inference.protocol import SamplerUnavailableError

    # the loop's progress (each iteration, gate, shadow and canary decision) is logged under "flywheel.loop"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        report = asyncio.run(run())
    except (ModelInUseError, RewindError) as exc:  # the loop runs already (its lock); a rewind's checkpoint gone
        fail(f"{config}: {exc}", plain=True)
    except (SamplerUnavailableError, *refusals) as exc:  # --vllm: a server unreachable, refusing an adapter...
        fail(f"{config}: {exc}", 1, plain=True)
    except CheckpointWriteError as exc:  # a full disk: the loop resumes from the latest checkpoint once there is room
        fail(f"{config}: {exc}", 1, plain=True)
    console.print(f"{len(report.steps)} iterations, step {report.steps[-1] if report.steps else 0}; "
                  f"{report.intake} tasks from production episodes", highlight=False)  # fmt: skip
    excluded = report.excluded_heldout
    console.print(f"held-out items kept out of training: {sum(excluded.values())} (seed tasks {excluded.get('seed', 0)},"
                  f" production episodes {excluded.get('intake', 0)}, off-policy members {excluded.get('off_policy', 0)})",
                  highlight=False)  # fmt: skip
    if report.cancelled:
        console.print(f"{report.cancelled} task(s) an earlier run left open were cancelled", highlight=False)
    table = Table(title="Candidates")
    for column in ("step", "against", "lift [95% interval]", "decision", "deployed"):
        table.add_column(column)
    for c in report.candidates:
        lift = c.decision.lift
        failed = ", ".join(ch.name for ch in c.decision.failed)
        table.add_row(
            str(c.step), c.production, f"{lift.mean:+.3f} [{lift.low:+.3f}, {lift.high:+.3f}]",
            "promote" if c.decision.promote else f"hold ({failed})", c.deployed or ("held" if c.held else "-"),
        )  # fmt: skip
    console.print(table)
    for c in report.candidates:
        if c.held:
            console.print(f"candidate {c.step} passed the gate and is held: {c.held}", highlight=False)
    for r in report.rewinds:
        console.print(f"rewound: step {r.step} has {r.production}'s weights, not step {r.from_step}'s (after audit "
                      f"event {r.rollback_event})", highlight=False)  # fmt: skip
    for v in report.shadow:
        diff = "" if v.difference is None else " ({:+.3f} [{:+.3f}, {:+.3f}])".format(*v.difference)
        console.print(f"shadow: {v.action} after {v.pairs} pairs{diff}: {v.reason}", highlight=False)
    if report.off_policy:  # who joined, each once; what was left out is looked at again each iteration: the last's
        joined, last = sum(s.joined for s in report.off_policy), report.off_policy[-1].left_out
        console.print(f"off-policy members: {joined} production episodes joined groups; left out at the last "
                      f"iteration: {last or 'none'}", highlight=False)  # fmt: skip
    if report.alarm is not None:
        console.print(f"promotions stopped by the reward-hacking alarm: {report.alarm}; once looked into: "
                      f"flywheel loop {config} --clear-alarm --why ...", highlight=False)  # fmt: skip


def _clear_alarm(loop_config: LoopConfig, source: Path, home: Path | None, actor: str, why: str | None) -> None:
    """``--clear-alarm``: a ``loop.alarm.clear`` event naming the model's latest checkpoint (no model loads)."""
    from flywheel.checkpoints import layout
    from flywheel.home import default_home
    from flywheel.loop.alarm import NoAlarmError, clear
    from flywheel.store.db import default_url

    if not why:
        fail(f"{source}: --clear-alarm needs --why: the reason goes into the audit trail", plain=True)
    root = home or default_home()
    step = layout.latest(layout.model_path(root, loop_config.project, loop_config.name)) or 0
    store = open_store(default_url(root), plain=True, prefix=str(source))
    try:
        with store.session() as s:
            event = clear(s, loop_config.name, step=step, actor=actor, reason=why)
    except NoAlarmError as exc:
        fail(f"{source}: {exc}", plain=True)
    finally:
        store.close()
    console.print(f"the alarm of loop {loop_config.name} is cleared (audit event {event.id}): promotions resume; "
                  f"its baseline starts after step {step}", highlight=False)  # fmt: skip

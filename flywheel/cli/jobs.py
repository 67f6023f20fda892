"""``flywheel train | demo``: the example jobs (the calculator agent, the customer-support agent) trained end to end,
the quick look at the model's rollouts, and the flywheel demonstration."""

from __future__ import annotations

import asyncio
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flywheel.cli.common import console, fail
from flywheel.inference.names import EMBEDDED_MODEL


class DemoKind(StrEnum):
    """``flywheel demo [WHICH]``: the quick look (the default), or the flywheel end to end."""

    look = "look"
    flywheel = "flywheel"


def demo(
    which: Annotated[
        DemoKind,
        typer.Argument(
            help="look: serve the model and run a few rollouts (the default). flywheel: users, the loop, the gate, "
            "canaries and the audit trail end to end (~10 minutes on 2 cores)."
        ),
    ] = DemoKind.look,
    problems: Annotated[int, typer.Option(help="look: problems (one group of rollouts each).")] = 4,
    group_size: Annotated[int, typer.Option(help="look: rollouts per problem.")] = 4,
    level: Annotated[int, typer.Option(help="look: difficulty 1..4.")] = 1,
    model: Annotated[str, typer.Option(help="look: the model.")] = EMBEDDED_MODEL,
    seed: Annotated[int, typer.Option()] = 0,
    out: Annotated[
        Path | None,
        typer.Option(
            help="flywheel: a new directory for its store, checkpoints, timeline and plot (default: a new "
            "one under $FLYWHEEL_HOME/demo, else ./demo-out)."
        ),
    ] = None,
    quick: Annotated[
        bool, typer.Option(help="flywheel: tiny sizes (every stage, a few items each; for tests).")
    ] = False,
):
    """Serve the model and run groups of calculator-agent rollouts through its HTTP API; print what happened.
    ``flywheel demo flywheel``: the flywheel demonstration (flywheel/examples/calculator/flywheel_demo.py)."""
    if which is DemoKind.look:
        asyncio.run(_demo(problems, group_size, level, model, seed))
        return
    import os

    from flywheel.examples.calculator.flywheel_demo import run_demo

    if out is None:
        home = os.environ.get("FLYWHEEL_HOME")
        out = (Path(home) / "demo" if home else Path("demo-out")) / time.strftime("flywheel-%Y%m%d-%H%M%S")
    if out.exists() and any(out.iterdir()):
        fail(f"--out {out} is not empty: the demo starts from a new directory")
    try:
        report = asyncio.run(run_demo(out, quick=quick, seed=seed, console=console))
    except (RuntimeError, TimeoutError) as exc:  # a stage that could not go on: the timeline so far is printed
        fail(f"The demo stopped: {exc}  (what it left: {out})", 1)
    if not report.audit_ok:
        raise typer.Exit(1)


async def _demo(n_problems: int, group_size: int, level: int, base_model: str, seed: int) -> None:
    from flywheel.examples.calculator.agent import rollout
    from flywheel.examples.calculator.task import extract_answer, generate_problems
    from flywheel.gather import gather_trajectory_groups
    from flywheel.local.backend import LocalBackend
    from flywheel.model import TrainableModel
    from flywheel.types import TrajectoryGroup, completion_token_count

    backend = LocalBackend()
    try:
        model = TrainableModel(name="calculator-demo", project="demo", base_model=base_model)
        with console.status(f"Loading {base_model}..."):
            await model.register(backend)
        console.print(
            f"Engine serving at [bold]{backend.base_url}[/] (OpenAI-compatible; try curl {backend.base_url}/models)"
        )
        problems = generate_problems("val", n_problems, levels=(level,), seed=seed)
        start = time.perf_counter()
        groups = await gather_trajectory_groups(
            (TrajectoryGroup(rollout(model, p) for _ in range(group_size)) for p in problems),
            pbar_desc="rollouts",
            max_exceptions=0.25,
        )
        elapsed = time.perf_counter() - start
        engine = backend.trainer(model).engine
        table = Table(title=f"Calculator agent, {base_model}, {group_size} rollouts per problem")
        for col in ("problem", "expected", "answers (reward)", "tool calls", "mean"):
            table.add_column(col)
        total = completion_tokens = 0
        rewards = []
        for problem, group in zip(problems, groups):
            answers = []
            for t in group.trajectories:
                final = t.messages()[-1].get("content") or ""
                answers.append(f"{extract_answer(final)} ({t.reward:.0f})")
                rewards.append(t.reward)
                completion_tokens += sum(
                    completion_token_count(c) for c in t.messages_and_choices if not isinstance(c, dict)
                )
            total += len(group.trajectories)
            calls = sum(int(t.metrics.get("tool_calls", 0)) for t in group.trajectories)
            mean = sum(t.reward for t in group.trajectories) / max(len(group.trajectories), 1)
            table.add_row(problem.question, str(problem.answer), ", ".join(answers), str(calls), f"{mean:.2f}")
        console.print(table)
        accuracy = sum(rewards) / max(len(rewards), 1)
        console.print(
            f"{total} rollouts in {elapsed:.1f}s, accuracy {accuracy:.0%}, {completion_tokens} sampled tokens "
            f"({completion_tokens / elapsed:.0f} tok/s through HTTP, {engine.model.dtype}). "
            "The base model rarely uses the tool: the training job (SFT warm start + GRPO) is what fixes that."
        )
    finally:
        await backend.close()


class TrainTask(StrEnum):
    """``flywheel train --task``: which example job."""

    calculator = "calculator"
    support = "support"


def train(
    task: Annotated[
        TrainTask, typer.Option(help="The job: the calculator agent, or the customer-support escalation agent.")
    ] = TrainTask.calculator,
    steps: Annotated[
        int | None,
        typer.Option(min=0, help="GRPO steps (default: calculator 16; support at most 16, as its time budget holds)."),
    ] = None,
    groups: Annotated[
        int | None, typer.Option(min=1, help="Problems or tickets per step (default: calculator 6, support 4).")
    ] = None,
    group_size: Annotated[
        int | None, typer.Option(min=2, help="Rollouts per problem or ticket (default: calculator 8, support 6).")
    ] = None,
    sft_examples: Annotated[
        int | None,
        typer.Option(min=1, help="Demonstrations for the SFT warm start (default: calculator 64, support 64)."),
    ] = None,
    test_problems: Annotated[
        int | None,
        typer.Option(
            "--test-problems",
            "--test-tickets",
            min=1,
            help="Held-out test items (default: calculator 100, support 50).",
        ),
    ] = None,
    val: Annotated[
        int | None,
        typer.Option(
            min=1, help="Validation items, which pick the best checkpoint (default: calculator 64, support 24)."
        ),
    ] = None,
    sft_epochs: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="At most this many SFT epochs, each validated; stops when one does not improve, keeps the best"
            " (default: calculator 4, support 3).",
        ),
    ] = None,
    budget_minutes: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Support: the job's time budget; RL takes another step only if it and the evaluations after it"
            " fit (default 43; 0: exactly --steps).",
        ),
    ] = None,
    failure_rate: Annotated[
        float | None,
        typer.Option(min=0.0, max=0.9, help="Support: each tool call's chance of a transient failure (default 0.1)."),
    ] = None,
    async_steps: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Calculator: the rollouts of the next N steps run while a step trains (flywheel.pipeline; each group"
            " at most N steps stale, staler ones dropped); default 0: synchronous.",
        ),
    ] = None,
    name: Annotated[str, typer.Option(help="Run name (checkpoints under $FLYWHEEL_HOME/TASK/models/NAME).")] = "",
    model: Annotated[str, typer.Option()] = EMBEDDED_MODEL,
    seed: Annotated[int, typer.Option()] = 0,
    full_finetune: Annotated[
        bool, typer.Option("--full-finetune/--lora", help="Train every weight (default) or a LoRA adapter.")
    ] = True,
    vllm: Annotated[
        str | None,
        typer.Option(
            help="vLLM servers (URL[,URL]) of the base model that sample it instead of the embedded engine, each "
            "step's weights synced into them (full fine-tuning: VLLM_SERVER_DEV_MODE=1; --lora: --enable-lora; "
            "docs/user-guide.md, 'Training on vLLM')."
        ),
    ] = None,
):
    """The main job: train an example agent (baseline, SFT warm start, GRPO, best checkpoint, report, plot); the
    calculator agent by default, the customer-support agent with --task support."""
    sizes = {"rl_steps": steps, "groups_per_step": groups, "group_size": group_size, "sft_examples": sft_examples}
    sizes |= {"sft_epochs": sft_epochs}
    if task == TrainTask.calculator:
        from flywheel.examples.calculator.train import JobConfig, run

        support_only = (
            ("--failure-rate", failure_rate),
            ("--budget-minutes", budget_minutes),
        )
        for option, value in support_only:
            if value is not None:
                fail(f"{option} is an option of --task support only.")
        sizes |= {"test_problems": test_problems, "val_problems": val, "async_steps": async_steps}
    else:
        from flywheel.examples.support.train import JobConfig, run  # type: ignore[assignment]

        if async_steps is not None:
            fail("--async-steps is an option of the calculator job only (the support job's steps fit a time budget).")
        sizes |= {"test_tickets": test_problems, "val_tickets": val}
        sizes |= {"failure_rate": failure_rate}
    config = JobConfig(
        base_model=model,
        seed=seed,
        name=name or time.strftime("run-%Y%m%d-%H%M%S"),
        vllm=vllm,
        **{key: value for key, value in sizes.items() if value is not None},
    )
    if budget_minutes is not None:  # 0: no budget (exactly --steps)
        config = config.model_copy(update={"time_budget_minutes": budget_minutes or None})
    if not full_finetune:
        config = config.with_lora()
    from flywheel.checkpoints.run import CheckpointWriteError
    from flywheel.graders.stack import StackGradingError
    from flywheel.inference.protocol import SamplerUnavailableError

    refusals: tuple[type[Exception], ...] = ()
    if vllm is not None:
        from flywheel.inference.vllm_engine import VLLMRefusedError
        from flywheel.vllm_backend import UnservableModelError

        refusals = (VLLMRefusedError, UnservableModelError, SamplerUnavailableError)
    try:
        asyncio.run(run(config, console))
    except (CheckpointWriteError, StackGradingError, *refusals) as exc:  # a full disk, a grader, vLLM: one message
        fail(str(exc), 1)

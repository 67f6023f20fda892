"""The ``flywheel`` command line."""

from __future__ import annotations

import asyncio
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from flywheel.agents.transitions import export_app
from flywheel.deployment_cli import audit_app, deploy, promote, rollback, show_deployments
from flywheel.graders.cli import eval_command, graders_app
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.loop.cli import loop_command
from flywheel.review_cli import review_app
from flywheel.rewards.cli import app as judge_app

app = typer.Typer(
    help="Flywheel: make LLM agents better with reinforcement learning from outcomes.", no_args_is_help=True
)
console = Console()
app.add_typer(export_app, name="export")
app.add_typer(graders_app, name="graders")
app.add_typer(judge_app, name="judge")
app.command("eval")(eval_command)
app.command()(deploy)
app.command()(promote)
app.command()(rollback)
app.command("deployments")(show_deployments)
app.add_typer(audit_app, name="audit")
app.command("loop")(loop_command)
app.add_typer(review_app, name="review")

DTYPES = {"auto": None, "bf16": "bfloat16", "fp32": "float32"}


def _dtype(name: str):
    import torch

    if name not in DTYPES:
        raise typer.BadParameter(f"dtype must be one of {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[name]) if DTYPES[name] else None


class RedactScope(StrEnum):
    """``flywheel serve --redact``: whose calls are redacted before they are stored."""

    production = "production"
    all = "all"
    none = "none"


@app.command()
def prepare(
    model: Annotated[str, typer.Option(help="Model spec to resolve (and convert once if GGUF).")] = EMBEDDED_MODEL,
    chat_template: Annotated[
        Path | None,
        typer.Option(
            help="A Jinja chat template file to give the checkpoint (for a GGUF that carries none); checked, then "
            "saved as its chat_template.jinja, so every later use of the model formats chats with it."
        ),
    ] = None,
):
    """Resolve a model to a local safetensors checkpoint, converting GGUF once, and print where it is."""
    from flywheel.inference.loading import ModelNotFoundError, resolve_model, set_chat_template

    try:
        template = None if chat_template is None else chat_template.read_text(encoding="utf-8")
        resolved = resolve_model(model)
        if template is not None:
            written = set_chat_template(resolved, template, str(chat_template))
            console.print(f"chat template from {chat_template} saved as {written}")
    except (ModelNotFoundError, OSError, ValueError) as exc:  # ValueError: a bad template, or a file not UTF-8
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from exc
    console.print(f"{resolved.name}: {resolved.path}")


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Embedded name, local HF checkpoint dir, or .gguf file.")] = EMBEDDED_MODEL,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    max_batch: Annotated[int, typer.Option(help="Most sequences decoded together.")] = 64,
    dtype: Annotated[str, typer.Option(help="auto (bf16 where the CPU has it) | bf16 | fp32")] = "auto",
    compile: Annotated[
        bool,
        typer.Option(
            help="Compile the decode step (torch.compile; needs a C++ compiler, ~1-2 min at start): faster at few concurrent requests."
        ),
    ] = False,
    db: Annotated[
        str | None,
        typer.Option(
            help="Database of the episodes recorded through /episodes (default: $FLYWHEEL_DB, else SQLite in $FLYWHEEL_HOME)."
        ),
    ] = None,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            help="File of API keys, one 'role key' per line (roles: agent, runner, admin), with those of $FLYWHEEL_API_KEYS ('role:key,...'). Without any key, every route is open."
        ),
    ] = None,
    insecure_no_auth: Annotated[
        bool,
        typer.Option(
            help="Serve on a non-loopback --host without any API key (anyone who reaches it may do anything)."
        ),
    ] = False,
    upstream: Annotated[
        str | None,
        typer.Option(
            help="An OpenAI-compatible server (its base URL, e.g. http://vllm:8000/v1) that answers the models this one does not serve; calls to it in episodes are recorded."
        ),
    ] = None,
    upstream_api_key: Annotated[
        str | None,
        typer.Option(envvar="FLYWHEEL_UPSTREAM_API_KEY", show_default=False, help="The upstream's API key."),
    ] = None,
    upstream_timeout: Annotated[float, typer.Option(help="Seconds an upstream call may take.")] = 300.0,
    upstream_logprobs_mode: Annotated[
        str,
        typer.Option(
            help="The log-probs the upstream returns, as vLLM's --logprobs-mode it was started with: raw_logprobs"
            " (vLLM's default: T = 1's, never compared by TIS for a call at another temperature) or processed_logprobs."
        ),
    ] = "raw_logprobs",
    redact: Annotated[
        RedactScope,
        typer.Option(
            help="Whose calls are redacted before they are stored: production (episodes of split production or"
            " shadow, and calls asked under a deployment's alias) | all | none."
        ),
    ] = RedactScope.production,
    write_behind: Annotated[
        bool,
        typer.Option(
            help="Answer an episode's call once it is queued for the store's writer (default), or once it is"
            " committed (--no-write-behind: for replicas on one database that do not send an episode's calls to one"
            " replica)."
        ),
    ] = True,
):
    """Serve a model over an OpenAI-compatible API (/v1/models, /v1/chat/completions), and the gateway: episodes
    (POST /episodes) whose calls, through /episodes/<id>/v1, are recorded for training."""
    import uvicorn

    from flywheel.gateway.auth import ENV_VAR, ApiKeyError, ApiKeys, is_loopback

    try:  # keys first: a mistake in them, or an open server on the network, is refused before the model loads
        keys = ApiKeys.configured(api_keys)
    except ApiKeyError as exc:
        console.print(f"[red]Invalid API keys: {exc}[/]")
        raise typer.Exit(2) from None
    if not keys and not is_loopback(host) and not insecure_no_auth:
        console.print(
            f"[red]Refusing to serve on {host} without API keys: anyone who can reach it could use the model and"
            f" read, reward or change every episode. Give keys (--api-keys FILE or {ENV_VAR}), bind to 127.0.0.1,"
            " or pass --insecure-no-auth to serve it open anyway.[/]"
        )
        raise typer.Exit(2)

    from flywheel.gateway.upstream import Upstream

    try:
        relay_to = (
            Upstream(upstream, api_key=upstream_api_key, timeout=upstream_timeout, logprobs_mode=upstream_logprobs_mode)
            if upstream
            else None
        )
    except ValueError as exc:
        console.print(f"[red]Invalid --upstream: {exc}[/]")
        raise typer.Exit(2) from None

    from flywheel.store import Store
    from flywheel.store.costs import Prices
    from flywheel.store.db import StoreUnavailableError, shown_url

    try:  # the database and the prices file too, before the model loads
        store = Store(db)
        prices = Prices.from_env()
    except (StoreUnavailableError, ValueError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None

    from flywheel.gateway.recorder import REDACTED_SPLITS, Gateway
    from flywheel.gateway.redact import default_redactor
    from flywheel.inference.engine import InferenceEngine
    from flywheel.inference.loading import ModelNotFoundError, load_model
    from flywheel.inference.registry import ModelRegistry
    from flywheel.server.app import create_app

    try:
        hf_model, tokenizer, resolved = load_model(model, dtype=_dtype(dtype))
    except ModelNotFoundError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from exc
    registry = ModelRegistry()
    try:
        engine = InferenceEngine(hf_model, tokenizer, max_batch=max_batch, compile=compile)
    except ValueError as exc:  # --compile where it cannot run
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from exc
    registry.add(model, engine)
    if resolved.name != model:
        registry.add(resolved.name, engine)
    console.print(f"Serving [bold]{model}[/] ({hf_model.dtype}) at http://{host}:{port}/v1")
    if compile:
        console.print("Compiling the decode step first (~1-2 minutes on 2 cores): requests wait until it is done.")
    console.print(f"Episodes: http://{host}:{port}/episodes, stored in {shown_url(store.url)}")
    console.print(f"API keys: {keys!r}" if keys else "No API keys: every route is open to whoever reaches the server.")
    if relay_to is not None:
        console.print(f"Other models: asked of the upstream at {relay_to.host}")
    gateway = Gateway(
        store,
        redactor=None if redact is RedactScope.none else default_redactor,
        redacted_splits=None if redact is RedactScope.all else REDACTED_SPLITS,
        write_behind=write_behind,
        prices=prices,
    )
    app = create_app(registry, gateway, auth=keys, upstream=relay_to)
    uvicorn.run(app, host=host, port=port, log_level="info")


class DemoKind(StrEnum):
    """``flywheel demo [WHICH]``: the quick look (the default), or the flywheel end to end."""

    look = "look"
    flywheel = "flywheel"


@app.command()
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

    from rich.markup import escape

    from flywheel.examples.calculator.flywheel_demo import run_demo

    if out is None:
        home = os.environ.get("FLYWHEEL_HOME")
        out = (Path(home) / "demo" if home else Path("demo-out")) / time.strftime("flywheel-%Y%m%d-%H%M%S")
    if out.exists() and any(out.iterdir()):
        console.print(f"[red]--out {out} is not empty: the demo starts from a new directory[/]")
        raise typer.Exit(2)
    try:
        report = asyncio.run(run_demo(out, quick=quick, seed=seed, console=console))
    except (RuntimeError, TimeoutError) as exc:  # a stage that could not go on: the timeline so far is printed
        console.print(f"[red]The demo stopped: {escape(str(exc))}[/]  (what it left: {out})")
        raise typer.Exit(1) from None
    if not report.audit_ok:
        raise typer.Exit(1)


async def _demo(n_problems: int, group_size: int, level: int, base_model: str, seed: int) -> None:
    from flywheel.backend import LocalBackend
    from flywheel.examples.calculator.agent import rollout
    from flywheel.examples.calculator.task import extract_answer, generate_problems
    from flywheel.gather import gather_trajectory_groups
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


@app.command()
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
    name: Annotated[str, typer.Option(help="Run name (checkpoints under $FLYWHEEL_HOME/TASK/models/NAME).")] = "",
    model: Annotated[str, typer.Option()] = EMBEDDED_MODEL,
    seed: Annotated[int, typer.Option()] = 0,
    full_finetune: Annotated[
        bool, typer.Option("--full-finetune/--lora", help="Train every weight (default) or a LoRA adapter.")
    ] = True,
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
                console.print(f"[red]{option} is an option of --task support only.[/]")
                raise typer.Exit(2)
        sizes |= {"test_problems": test_problems, "val_problems": val}
    else:
        from flywheel.examples.support.train import JobConfig, run  # type: ignore[assignment]

        sizes |= {"test_tickets": test_problems, "val_tickets": val}
        sizes |= {"failure_rate": failure_rate}
    config = JobConfig(
        base_model=model,
        seed=seed,
        name=name or time.strftime("run-%Y%m%d-%H%M%S"),
        **{key: value for key, value in sizes.items() if value is not None},
    )
    if budget_minutes is not None:  # 0: no budget (exactly --steps)
        config = config.model_copy(update={"time_budget_minutes": budget_minutes or None})
    if not full_finetune:
        config = config.with_lora()
    from flywheel.graders.stack import StackGradingError
    from flywheel.runs import CheckpointWriteError

    try:
        asyncio.run(run(config, console))
    except (CheckpointWriteError, StackGradingError) as exc:  # a full disk, a grader that cannot run: one message
        console.print(f"[red]{exc}[/]", highlight=False)
        raise typer.Exit(1) from None


@app.command()
def runner(
    url: Annotated[str, typer.Option(help="The gateway's root URL (flywheel serve's), e.g. http://127.0.0.1:8000.")],
    agent: Annotated[
        str,
        typer.Option(
            help="The agent as module:function (importable from here): async def agent(task: dict, base_url: str) -> float | dict."
        ),
    ],
    concurrency: Annotated[int, typer.Option(min=1, help="Attempts run at once.")] = 1,
    max_attempts: Annotated[
        int | None, typer.Option(min=1, help="Stop after claiming this many attempts (default: run until stopped).")
    ] = None,
    lease_seconds: Annotated[
        float, typer.Option(min=0.1, help="Lease per attempt, renewed every third of it while the agent runs.")
    ] = 60.0,
    runner_id: Annotated[
        str | None, typer.Option(help="This runner's name in the queue (default: host-pid-random).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="FLYWHEEL_API_KEY", help="A runner (or admin) key, if the server has keys.")
    ] = None,
):
    """Run an agent on the gateway's rollout queue: claim attempts, run the agent against each one's episode URL,
    post its reward. SIGINT or SIGTERM stops it, giving its running attempts back to the queue."""
    import logging
    import os
    import signal
    import sys

    from flywheel.gateway.client import GatewayError
    from flywheel.gateway.runner import Runner, load_agent

    sys.path.insert(0, os.getcwd())  # --agent my_module:fn finds my_module.py here, as `python -m` would
    try:
        function = load_agent(agent)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    worker = Runner(
        url, function, runner_id=runner_id, lease_seconds=lease_seconds, concurrency=concurrency, api_key=api_key
    )

    async def main():
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await worker.run(max_attempts=max_attempts)

    console.print(f"Runner [bold]{worker.runner_id}[/] on {url}")
    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("Stopped.")
    except GatewayError as exc:
        console.print(f"[red]The gateway refused the runner: {exc}[/]")
        raise typer.Exit(1) from None
    finally:
        stats = worker.stats
        console.print(
            f"Claimed {stats.claimed}, completed {stats.completed}, failed {stats.failed}, lost {stats.lost}."
        )


if __name__ == "__main__":
    app()

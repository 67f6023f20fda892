"""``flywheel graders validate | run | regress`` and ``flywheel eval``: grader files checked and tried, a model
evaluated on RFT data, two versions of a grader stack compared on stored episodes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from flywheel.cli.common import console, fail, open_store
from flywheel.graders.spec import GraderSpecError, MultiGrader, load_grader
from flywheel.inference.names import EMBEDDED_MODEL

graders_app = typer.Typer(help="OpenAI-compatible graders: validate and try them.", no_args_is_help=True)

JudgeModel = Annotated[str | None, typer.Option(help="LiteLLM model for every model grader, e.g. openai/NAME.")]
JudgeBaseUrl = Annotated[str | None, typer.Option(help="OpenAI-compatible base URL of the judge.")]
JudgeApiKey = Annotated[str | None, typer.Option(help="API key for the judge (else LiteLLM's usual variables).")]
PythonTimeout = Annotated[float, typer.Option(help="Seconds a python grader may run.")]


def _judge(model: str | None, base_url: str | None, api_key: str | None):
    from flywheel.graders.model_graders import JudgeSettings

    params = {key: value for key, value in (("api_base", base_url), ("api_key", api_key)) if value}
    return JudgeSettings(model=model, params=params)


def _text_or_file(value: str) -> str:
    path = Path(value)
    return path.read_text() if len(value) < 4096 and "\n" not in value and path.is_file() else value


@graders_app.command()
def validate(files: Annotated[list[Path], typer.Argument(help="Grader files (JSON or YAML).")]) -> None:
    """Check grader files; every problem is reported at its JSON path. Exit status 1 if any is invalid."""
    failed = False
    for path in files:
        try:
            grader = load_grader(path)
        except GraderSpecError as exc:
            typer.echo(str(exc), err=True)
            failed = True
            continue
        parts = f", {len(grader.graders)} sub-graders" if isinstance(grader, MultiGrader) else ""
        typer.echo(f"{path}: ok ({grader.type} {grader.name!r}{parts})")
    if failed:
        raise typer.Exit(1)


@graders_app.command()
def run(
    file: Annotated[Path, typer.Argument(help="Grader file (JSON or YAML).")],
    sample: Annotated[str, typer.Option(help="The model's answer: text, or a file holding it.")],
    item: Annotated[str, typer.Option(help="The dataset item: JSON, or a JSON file.")] = "{}",
    judge_model: JudgeModel = None,
    judge_base_url: JudgeBaseUrl = None,
    judge_api_key: JudgeApiKey = None,
    python_timeout: PythonTimeout = 120.0,
) -> None:
    """Grade one sample, printing {reward, sub_rewards, metadata: {errors, ...}} as OpenAI's graders/run does."""
    from flywheel.graders.run import grade
    from flywheel.graders.sandbox import PythonSandbox, SandboxLimits

    try:
        grader = load_grader(file)
    except GraderSpecError as exc:
        fail(str(exc), 1, plain=True)
    try:
        item_value: Any = json.loads(_text_or_file(item))
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--item") from None
    if not isinstance(item_value, dict):
        raise typer.BadParameter("the item must be a JSON object", param_hint="--item")
    sandbox = PythonSandbox(SandboxLimits(timeout_s=python_timeout))
    result = asyncio.run(
        grade(
            grader,
            _text_or_file(sample),
            item_value,
            sandbox=sandbox,
            judge=_judge(judge_model, judge_base_url, judge_api_key),
        )
    )
    typer.echo(json.dumps(result.to_openai(), indent=2))


def _interval(interval) -> str:
    return "-" if interval.method == "none" else f"[{interval.low:.3f}, {interval.high:.3f}]"


def eval_command(
    model: Annotated[str, typer.Option(help="NAME@STEP (a checkpoint), NAME (latest checkpoint, or a base model).")],
    data: Annotated[Path, typer.Option(help="RFT JSONL: {messages, tools?, ...item fields}.")],
    grader: Annotated[list[Path], typer.Option(help="Grader file; repeat for several.")],
    project: Annotated[str | None, typer.Option(help="Project of a trained model (found if unique).")] = None,
    base_model: Annotated[str, typer.Option(help="Base model of a trained model.")] = EMBEDDED_MODEL,
    home: Annotated[Path | None, typer.Option(help="Projects directory (default $FLYWHEEL_HOME).")] = None,
    limit: Annotated[int | None, typer.Option(help="Only the first N rows.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per answer.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    concurrency: Annotated[int, typer.Option(help="Rows answered at once.")] = 8,
    output: Annotated[Path | None, typer.Option(help="Write every answer, grade and the summary as JSON here.")] = None,
    judge_model: JudgeModel = None,
    judge_base_url: JudgeBaseUrl = None,
    judge_api_key: JudgeApiKey = None,
    python_timeout: PythonTimeout = 120.0,
) -> None:
    """Run a model on RFT data and report each grader's mean score with a 95% interval."""
    from flywheel.checkpoints.run import ModelInUseError
    from flywheel.evaluation import EvalConfig, evaluate
    from flywheel.graders.sandbox import SandboxLimits

    config = EvalConfig(
        model=model, data=data, graders=grader, project=project, base_model=base_model, home=home, limit=limit,
        max_tokens=max_tokens, temperature=temperature, concurrency=concurrency,
        judge=_judge(judge_model, judge_base_url, judge_api_key), python=SandboxLimits(timeout_s=python_timeout),
    )  # fmt: skip
    try:
        report = asyncio.run(evaluate(config))
    except (GraderSpecError, ValueError, FileNotFoundError, ModelInUseError) as exc:  # in use: a run is training it
        fail(str(exc), 1, plain=True)
    table = Table(title=f"{report.model} on {data} ({len(report.rows)} rows)")
    for column in ("grader", "mean", "95% interval", "errors"):
        table.add_column(column)
    for summary in report.summaries:
        errors = ", ".join(f"{kind}: {count}" for kind, count in summary.errors.items()) or "0"
        table.add_row(summary.name, f"{summary.score.mean:.3f}", _interval(summary.score), errors)
        for key, interval in summary.sub_scores.items():
            table.add_row(f"  {summary.name}.{key}", f"{interval.mean:.3f}", _interval(interval), "")
    console.print(table)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(report.model_dump_json(indent=2))
        console.print(f"Answers and grades: {output}", highlight=False)


def _stack_from(value: str, store) -> Any:
    """A stack file, or the version (hash) of a stack already stored."""
    from flywheel.graders.stack import load_stack, parse_stack
    from flywheel.store import grades

    if Path(value).exists():
        return load_stack(value)
    with store.session() as s:
        try:
            return parse_stack(grades.get_stack(s, value).spec, f"stored version {value}")
        except grades.UnknownStackError:
            raise typer.BadParameter(f"{value!r} is neither a file nor a stored stack version") from None


@graders_app.command()
def regress(
    old: Annotated[str, typer.Argument(help="The current grader stack: a file (JSON/YAML) or a stored version.")],
    new: Annotated[str, typer.Argument(help="The proposed one, likewise.")],
    split: Annotated[str | None, typer.Option(help="Only episodes of this split (production, train, eval...).")] = None,
    limit: Annotated[int, typer.Option(help="The last N finished episodes.", min=1)] = 1000,
    db: Annotated[
        str | None, typer.Option(help="Store URL (default: $FLYWHEEL_DB, else SQLite in $FLYWHEEL_HOME).")
    ] = None,
    actor: Annotated[str | None, typer.Option(help="Who asks, for the audit trail (default: $USER).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    judge_model: JudgeModel = None,
    judge_base_url: JudgeBaseUrl = None,
    judge_api_key: JudgeApiKey = None,
    python_timeout: PythonTimeout = 120.0,
) -> None:
    """Re-score stored episodes with two versions of a grader stack and report what changed. Both versions are
    stored (a new one is an audit event) and their grades recorded."""
    import getpass

    from flywheel.graders.regress import regress as run_regress
    from flywheel.graders.sandbox import PythonSandbox, SandboxLimits

    store = open_store(db, plain=True)
    try:
        stacks = [_stack_from(value, store) for value in (old, new)]
    except GraderSpecError as exc:
        fail(str(exc), 1, plain=True)
    report = asyncio.run(
        run_regress(
            store, *stacks, actor=actor or getpass.getuser(), split=split, limit=limit,
            sandbox=PythonSandbox(SandboxLimits(timeout_s=python_timeout)),
            judge=_judge(judge_model, judge_base_url, judge_api_key),
        )
    )  # fmt: skip
    store.close()
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
        return

    def mean(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    table = Table(title=f"{report.old} -> {report.new} on {report.episodes} episodes")
    for column in ("component", "old mean", "new mean", "episodes changed"):
        table.add_column(column)
    for c in report.components:
        table.add_row(c.component, mean(c.old_mean), mean(c.new_mean), str(c.changed))
    console.print(table)
    console.print("safety: " + ", ".join(f"{k}: {v}" for k, v in report.safety_flips.items()), highlight=False)
    for change in report.most_changed:
        console.print(f"  {change.episode_id}: {change.old:.3f} -> {change.new:.3f}", highlight=False)

"""``flywheel judge calibrate``: an LLM judge (RULER) checked against human labels before training on it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from flywheel.cli.common import console, fail
from flywheel.rewards.ruler import DEFAULT_JUDGE

judge_app = typer.Typer(
    help="LLM judges (RULER): check a judge against human labels before training on it.", no_args_is_help=True
)


def _params(api_base: str | None, params: list[str] | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"api_base": api_base} if api_base else {}
    for item in params or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--param")
        try:
            extra[key] = json.loads(value)  # numbers, booleans, objects
        except json.JSONDecodeError:
            extra[key] = value
    return extra


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


@judge_app.command()
def calibrate(
    judge: Annotated[str, typer.Option(help="LiteLLM model string of the judge, e.g. openai/o3.")] = DEFAULT_JUDGE,
    data: Annotated[
        Path | None, typer.Option(help="Labelled JSONL (one group per line); default: the shipped refund-policy set.")
    ] = None,
    rubric: Annotated[
        Path | None, typer.Option(help="A file with the rubric (default: RULER's default rubric).")
    ] = None,
    api_base: Annotated[str | None, typer.Option(help="Base URL of an OpenAI-compatible judge server (…/v1).")] = None,
    param: Annotated[list[str] | None, typer.Option(help="Extra LiteLLM parameter KEY=VALUE (repeatable).")] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Groups judged at once.")] = 4,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Judge cache directory (default: $FLYWHEEL_HOME/judge-cache).")
    ] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Always call the judge.")] = False,
    max_explanation_chars: Annotated[
        int | None, typer.Option(help="Cap on each explanation (default: 240 for local judges, none otherwise).")
    ] = None,
    show: Annotated[int, typer.Option(help="Disagreements to print.")] = 10,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the full report as JSON here.")] = None,
):
    """Judge labelled groups and report agreement with the human labels: pairwise ranking accuracy, Kendall tau
    per group, top-1 agreement, score spread, and the disagreements to inspect."""
    from flywheel.rewards.calibrate import DEFAULT_DATA, load_groups, report_json
    from flywheel.rewards.calibrate import calibrate as run_calibration

    try:
        groups = load_groups(data if data is not None else Path(str(DEFAULT_DATA)))
        rubric_text = rubric.read_text(encoding="utf-8") if rubric is not None else None
    except (OSError, ValueError) as exc:
        fail(str(exc))
    report = asyncio.run(
        run_calibration(
            groups,
            judge,
            _params(api_base, param),
            rubric_text,
            concurrency=concurrency,
            cache=False if no_cache else cache_dir,
            max_explanation_chars=max_explanation_chars if max_explanation_chars is not None else "auto",
        )
    )
    labels = {g.id: [t.label or str(i) for i, t in enumerate(g.trajectories, 1)] for g in groups}
    table = Table(title=f"Judge calibration: {judge} on {len(groups)} groups")
    for column in ("group", "judge scores (label=score)", "kendall tau", "top-1", "spread", "pairs right"):
        table.add_column(column, overflow="fold")
    for g in report.groups:
        if g.error is not None:
            table.add_row(g.id, f"[red]failed: {g.error}[/]", "", "", "", "")
            continue
        scores = ", ".join(f"{name}={s:.2f}" for name, s in zip(labels[g.id], g.judge_scores))
        top = "n/a" if g.top1_agrees is None else "yes" if g.top1_agrees else "no"
        table.add_row(g.id, scores, _fmt(g.kendall_tau), top, _fmt(g.spread), f"{g.concordant:g}/{g.pairs}")
    console.print(table)
    for key, value in report.summary().items():
        console.print(f"{key}: {_fmt(value) if isinstance(value, float) else value}")
    u = report.usage
    cost = f", ${u.cost_usd:.4f}" if u.cost_usd is not None else ""
    console.print(
        f"judge calls: {u.calls} ({u.cache_hits} from cache, {u.retries} retries, {u.repairs} repairs, "
        f"{u.clamped} clamped scores), {u.prompt_tokens} prompt + {u.completion_tokens} completion tokens{cost}"
    )
    if report.disagreements and show:
        worst = Table(title=f"Disagreements (biggest human gap first, {min(show, len(report.disagreements))} shown)")
        for column in ("group", "humans prefer", "over", "judge scores", "judge's explanations"):
            worst.add_column(column, overflow="fold")
        for d in report.disagreements[:show]:
            worst.add_row(
                d.group, d.better, d.worse, f"{d.judge[0]:.2f} vs {d.judge[1]:.2f}", " | ".join(d.explanations)
            )
        console.print(worst)
    if json_out is not None:
        json_out.write_text(report_json(report), encoding="utf-8")
        console.print(f"report written to {json_out}")

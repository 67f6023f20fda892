"""``flywheel jobs``: fine-tuning jobs on a server that serves OpenAI's fine-tuning API (``flywheel serve``, or
OpenAI's own), through the openai SDK: upload a file, create a job from its JSON body, list, get, follow its events
and checkpoints, cancel, pause and resume. JSON in, a table out."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from flywheel.cli.common import console, fail

if TYPE_CHECKING:
    from openai import OpenAI

jobs_app = typer.Typer(help="OpenAI fine-tuning jobs on a Flywheel server (flywheel serve) or any that serves the API.", no_args_is_help=True)  # fmt: skip

Url = Annotated[
    str,
    typer.Option(envvar="OPENAI_BASE_URL", help="The server's API base URL ($OPENAI_BASE_URL)."),
]
Key = Annotated[str, typer.Option(envvar="OPENAI_API_KEY", show_default=False, help="Its API key ($OPENAI_API_KEY).")]
Limit = Annotated[int, typer.Option(min=1, help="At most this many, newest first.")]
DEFAULT_URL = "http://127.0.0.1:8000/v1"


def _client(url: str, key: str) -> OpenAI:
    from openai import OpenAI

    return OpenAI(base_url=url, api_key=key or "unused", max_retries=0)


def _call(fn, *args: Any, **kwargs: Any) -> Any:
    """The SDK call; its error as one line (OpenAI's message and the server's status), never a traceback."""
    import openai

    try:
        return fn(*args, **kwargs)
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        fail(f"{exc.status_code}: {body.get('message') or exc.message}")
    except openai.APIConnectionError as exc:
        fail(f"cannot reach {exc.request.url}: is the server running (flywheel serve)? ({exc.__cause__ or exc})")


def _when(ts: int | None) -> str:
    return "" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _jobs_table(jobs: list[Any]) -> Table:
    table = Table("id", "model", "method", "status", "created (UTC)", "fine-tuned model")
    for j in jobs:
        table.add_row(j.id, j.model, j.method.type if j.method else "", j.status, _when(j.created_at), j.fine_tuned_model or "")  # fmt: skip
    return table


@jobs_app.command()
def upload(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A JSONL file of examples.")],
    url: Url = DEFAULT_URL,
    api_key: Key = "",
) -> None:
    """Upload a training or validation file (purpose fine-tune); prints its id."""
    with path.open("rb") as data:
        made = _call(_client(url, api_key).files.create, file=(path.name, data), purpose="fine-tune")
    console.print(f"{made.id}  {made.filename}  {made.bytes} bytes")


@jobs_app.command()
def create(
    body: Annotated[
        str, typer.Argument(help="The job's JSON body (as client.fine_tuning.jobs.create takes it), or a file of it.")
    ],
    url: Url = DEFAULT_URL,
    api_key: Key = "",
) -> None:
    """Create a job from its JSON body: model, training_file, method, suffix, seed, ..."""
    text = Path(body).read_text() if not body.lstrip().startswith("{") and Path(body).is_file() else body
    try:
        fields = json.loads(text)
    except ValueError as exc:
        fail(f"the job's body is not JSON: {exc}")
    if not isinstance(fields, dict):
        fail("the job's body must be a JSON object (model, training_file, method, ...)")
    client = _client(url, api_key)
    console.print(_jobs_table([_call(client.fine_tuning.jobs.create, **fields)]))


@jobs_app.command("list")
def list_jobs(url: Url = DEFAULT_URL, api_key: Key = "", limit: Limit = 20) -> None:
    """The jobs, newest first."""
    page = _call(_client(url, api_key).fine_tuning.jobs.list, limit=limit)
    console.print(_jobs_table(page.data))


@jobs_app.command()
def get(job_id: str, url: Url = DEFAULT_URL, api_key: Key = "") -> None:
    """One job, every field."""
    job = _call(_client(url, api_key).fine_tuning.jobs.retrieve, job_id)
    table = Table("field", "value")
    for key, value in job.model_dump(exclude_none=True).items():
        table.add_row(key, value if isinstance(value, str) else json.dumps(value))
    console.print(table)


@jobs_app.command()
def events(job_id: str, url: Url = DEFAULT_URL, api_key: Key = "", limit: Limit = 50) -> None:
    """A job's latest events, oldest first."""
    page = _call(_client(url, api_key).fine_tuning.jobs.list_events, job_id, limit=limit)
    table = Table("time (UTC)", "level", "message")
    for e in reversed(page.data):
        table.add_row(_when(e.created_at), e.level, e.message)
    console.print(table)


@jobs_app.command()
def checkpoints(job_id: str, url: Url = DEFAULT_URL, api_key: Key = "", limit: Limit = 10) -> None:
    """A job's checkpoints, newest first, with their metrics."""
    page = _call(_client(url, api_key).fine_tuning.jobs.checkpoints.list, job_id, limit=limit)
    table = Table("step", "model", "metrics")
    for c in page.data:
        metrics = {k: v for k, v in c.metrics.model_dump(exclude_none=True).items() if k != "step"}
        table.add_row(str(c.step_number), c.fine_tuned_model_checkpoint, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))  # fmt: skip
    console.print(table)


def _change(action: str):
    def command(job_id: str, url: Url = DEFAULT_URL, api_key: Key = "") -> None:
        jobs = _client(url, api_key).fine_tuning.jobs
        console.print(_jobs_table([_call(getattr(jobs, action), job_id)]))

    command.__doc__ = f"{action.capitalize()} a job."
    return command


for _action in ("cancel", "pause", "resume"):
    jobs_app.command(_action)(_change(_action))

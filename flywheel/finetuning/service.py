"""One server's fine-tuning API: its files, its jobs and the worker that runs them, started and stopped together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flywheel.finetuning.files import Files
from flywheel.finetuning.jobs import BaseModels, Jobs
from flywheel.finetuning.wire import ORGANIZATION
from flywheel.finetuning.worker import RFT_MAX_TOKENS, JobWorker
from flywheel.inference.registry import ServedModel
from flywheel.store import Store, finetuning
from flywheel.store.finetuning import JobStatus


class FineTuning:
    """Files under ``home/files``, jobs' models under ``home/fine-tuning`` (a ``LocalBackend`` home), records in
    ``store``. ``base_models``: the models jobs may fine-tune; ``aliases``: other names for them (OpenAI's);
    ``max_tokens``: the most tokens an RFT answer may take."""

    def __init__(
        self,
        store: Store,
        home: Path,
        base_models: list[str],
        aliases: dict[str, str] | None = None,
        backend_options: dict[str, Any] | None = None,
        max_tokens: int = RFT_MAX_TOKENS,
    ):
        self.store = store
        self.files = Files(store, home / "files")
        self.worker = JobWorker(store, self.files, home, backend_options=backend_options, max_tokens=max_tokens)
        self.jobs = Jobs(store, self.files, BaseModels(base_models, aliases or {}), self.worker)

    def start(self) -> FineTuning:
        """Start the worker (a job the last server left running is resumed, one left validating is validated);
        returns once it is ready."""
        self.worker.start()
        self.jobs.validate_left()
        return self

    def stop(self) -> None:
        self.jobs.close()
        self.worker.stop()

    def serve(self, name: str) -> ServedModel | None:
        """A loader for the server's registry: the jobs' models and checkpoints."""
        return self.worker.serve(name)

    def models(self) -> list[dict[str, Any]]:
        """The succeeded jobs' models, as ``/v1/models`` lists them (served on their first request)."""
        with self.store.session() as s:
            jobs = finetuning.list_jobs(s, after=None, limit=10_000)
            done = [j for j in jobs if j.status == JobStatus.succeeded and j.fine_tuned_model]
            return [{"id": j.fine_tuned_model, "object": "model", "created": int(j.created_at.timestamp()),
                     "owned_by": ORGANIZATION} for j in done]  # fmt: skip

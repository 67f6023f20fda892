"""The HTTP routes of OpenAI's files and fine-tuning jobs APIs, and how their errors look (OpenAI's shape)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from flywheel.finetuning import wire
from flywheel.finetuning.files import FileError
from flywheel.finetuning.jobs import JobError
from flywheel.finetuning.service import FineTuning
from flywheel.server.errors import error_response
from flywheel.store import finetuning
from flywheel.store.finetuning import UnknownObjectError

Limit = Annotated[int, Query(ge=1, le=10_000)]


def mount(app: FastAPI, service: FineTuning) -> None:
    """Add the routes and their error handlers to ``app``."""
    app.include_router(_router(service))

    @app.exception_handler(FileError)
    async def _bad_file(_: Request, exc: FileError):
        return error_response(400, str(exc), "invalid_request_error", param=exc.param, code=exc.code)

    @app.exception_handler(JobError)
    async def _bad_job(_: Request, exc: JobError):
        return error_response(400, str(exc), "invalid_request_error", param=exc.param, code=exc.code)

    @app.exception_handler(UnknownObjectError)
    async def _unknown(_: Request, exc: UnknownObjectError):
        return error_response(404, str(exc), "invalid_request_error", param=exc.param, code="not_found")


def _router(service: FineTuning) -> APIRouter:
    router = APIRouter()
    files, jobs, store = service.files, service.jobs, service.store

    # ---- files ------------------------------------------------------------------------------------------------

    @router.post("/v1/files")
    async def create_file(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]):
        data = await file.read()
        row = await asyncio.to_thread(files.create, file.filename or "upload.jsonl", purpose, data)
        return wire.file_object(row)

    @router.get("/v1/files")
    async def list_files(
        purpose: str | None = None,
        limit: Limit = 10_000,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ):
        def unit(s):  # the objects are built inside the unit of work, while their rows are loaded
            rows = finetuning.list_files(s, purpose=purpose, after=after, limit=limit + 1, order=order)
            return wire.page(rows, limit, wire.file_object)

        return await store.run(unit)

    @router.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str):
        return await store.run(lambda s: wire.file_object(finetuning.get_file(s, file_id)))

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        data = await asyncio.to_thread(files.content, file_id)
        return Response(data, media_type="application/octet-stream")

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        await asyncio.to_thread(files.delete, file_id)
        return wire.file_deleted(file_id)

    # ---- jobs -------------------------------------------------------------------------------------------------

    @router.post("/v1/fine_tuning/jobs")
    async def create_job(body: wire.JobCreate):
        return wire.job_object(await asyncio.to_thread(jobs.create, body))

    @router.get("/v1/fine_tuning/jobs")
    async def list_jobs(request: Request, after: str | None = None, limit: Limit = 20):
        meta = {k[len("metadata[") : -1]: v for k, v in request.query_params.items() if k.startswith("metadata[") and k.endswith("]")}  # fmt: skip

        return await store.run(lambda s: wire.page(finetuning.list_jobs(s, after=after, limit=limit + 1, meta=meta), limit, wire.job_object))  # fmt: skip

    @router.get("/v1/fine_tuning/jobs/{job_id}")
    async def retrieve_job(job_id: str):
        return await store.run(lambda s: wire.job_object(finetuning.get_job(s, job_id)))

    @router.post("/v1/fine_tuning/jobs/{job_id}/cancel")
    async def cancel_job(job_id: str):
        return wire.job_object(await asyncio.to_thread(jobs.cancel, job_id))

    @router.post("/v1/fine_tuning/jobs/{job_id}/pause")
    async def pause_job(job_id: str):
        return wire.job_object(await asyncio.to_thread(jobs.pause, job_id))

    @router.post("/v1/fine_tuning/jobs/{job_id}/resume")
    async def resume_job(job_id: str):
        return wire.job_object(await asyncio.to_thread(jobs.resume, job_id))

    @router.get("/v1/fine_tuning/jobs/{job_id}/events")
    async def list_events(job_id: str, after: str | None = None, limit: Limit = 20):
        return await store.run(lambda s: wire.page(finetuning.list_events(s, job_id, after=after, limit=limit + 1), limit, wire.event_object))  # fmt: skip

    @router.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
    async def list_checkpoints(job_id: str, after: str | None = None, limit: Limit = 10):
        return await store.run(lambda s: wire.page(finetuning.list_checkpoints(s, job_id, after=after, limit=limit + 1), limit, wire.checkpoint_object))  # fmt: skip

    return router

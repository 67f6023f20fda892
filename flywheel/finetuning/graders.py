"""``/v1/fine_tuning/alpha/graders/run`` and ``/validate`` (placeholder: being written)."""

from fastapi import APIRouter


def graders_router() -> APIRouter:
    return APIRouter()

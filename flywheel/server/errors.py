"""OpenAI's error shape as a response: every route's errors, the fine-tuning API's included."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from flywheel.openai_api import ErrorDetail, ErrorResponse


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:  # fmt: skip
    """``{"error": {"message", "type", "param", "code"}}`` with ``status``."""
    body = ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump())

"""Why a grade failed: error kinds as OpenAI's ``graders/run`` names them, plus the sandbox's own.

A failed grade is never an exception to the caller: it scores 0 and its kind is counted, so one bad sample cannot
stop a training step or an evaluation (and the counts show up in metrics, where a broken grader is noticed).
"""

from __future__ import annotations

from typing import Any

# OpenAI's kinds.
INVALID_VARIABLE = "invalid_variable_error"
SAMPLE_PARSE = "sample_parse_error"
FORMULA_PARSE = "formula_parse_error"
MODEL_GRADER_PARSE = "model_grader_parse_error"
MODEL_GRADER_REFUSAL = "model_grader_refusal_error"
MODEL_GRADER_SERVER = "model_grader_server_error"
PYTHON_GRADER_RUNTIME = "python_grader_runtime_error"
PYTHON_GRADER_SERVER = "python_grader_server_error"
OTHER = "other_error"
# Finer kinds than OpenAI reports, so that a sandbox limit is told apart from a bug in the grader.
FORMULA_EVAL = "formula_eval_error"
PYTHON_GRADER_TIMEOUT = "python_grader_timeout"
PYTHON_GRADER_MEMORY = "python_grader_memory"
PYTHON_GRADER_FORBIDDEN = "python_grader_forbidden"


# Flywheel's finer kinds, as the flag OpenAI raises for them
_AS_OPENAI = {
    FORMULA_EVAL: FORMULA_PARSE,
    PYTHON_GRADER_TIMEOUT: "unresponsive_reward_error",
    PYTHON_GRADER_MEMORY: PYTHON_GRADER_SERVER,
    PYTHON_GRADER_FORBIDDEN: PYTHON_GRADER_RUNTIME,
}
OPENAI_FLAGS = (
    FORMULA_PARSE, INVALID_VARIABLE, MODEL_GRADER_PARSE, MODEL_GRADER_REFUSAL, MODEL_GRADER_SERVER, OTHER,
    PYTHON_GRADER_RUNTIME, PYTHON_GRADER_SERVER, SAMPLE_PARSE, "truncated_observation_error",
    "unresponsive_reward_error",
)  # fmt: skip


def openai_flags(counts: dict[str, int], details: dict[str, str]) -> dict[str, Any]:
    """A grade's errors as ``graders/run``'s ``metadata.errors``: OpenAI's flag for each kind (true where one
    occurred), with the details OpenAI gives for some."""
    raised = {_AS_OPENAI.get(kind, kind) for kind in counts}
    flags: dict[str, Any] = {flag: flag in raised for flag in OPENAI_FLAGS}
    flags["python_grader_runtime_error_details"] = details.get(PYTHON_GRADER_RUNTIME) or details.get(
        PYTHON_GRADER_FORBIDDEN
    )
    flags["python_grader_server_error_type"] = PYTHON_GRADER_MEMORY if PYTHON_GRADER_MEMORY in details else None
    flags["model_grader_server_error_details"] = details.get(MODEL_GRADER_SERVER)
    return flags


class GraderError(Exception):
    """One (sub-)grader could not produce a score: ``kind`` is counted, ``detail`` says what happened."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail

"""Why a grade failed: error kinds as OpenAI's ``graders/run`` names them, plus the sandbox's own.

A failed grade is never an exception to the caller: it scores 0 and its kind is counted, so one bad sample cannot
stop a training step or an evaluation (and the counts show up in metrics, where a broken grader is noticed).
"""

from __future__ import annotations

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


class GraderError(Exception):
    """One (sub-)grader could not produce a score: ``kind`` is counted, ``detail`` says what happened."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail

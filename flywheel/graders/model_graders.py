"""``score_model`` and ``label_model``: a judge model, reached through LiteLLM, grades the sample.

The judge gets the grader's rendered ``input`` messages plus an instruction to answer with JSON, and the same
JSON schema as ``response_format`` (servers with structured outputs, Flywheel's own included, then cannot answer
anything else). ``score_model`` expects ``{"steps": [{"description", "conclusion"}], "result": number}``: the
result is clamped to ``range``; a non-number is a ``model_grader_parse_error``. ``label_model`` expects
``{"steps": [...], "result": label}`` and scores 1.0 for a passing label.

Which judge answers: the grader's ``model`` (a LiteLLM model string such as ``openai/gpt-4o-mini``), unless
``JudgeSettings.model`` replaces it; ``JudgeSettings.params`` go to ``litellm.acompletion`` as they are
(``api_base``, ``api_key``, ``timeout``, ``max_tokens``...). Any OpenAI-compatible server can judge, e.g. a model
Flywheel serves: ``JudgeSettings.from_model(model)``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from flywheel.graders.errors import MODEL_GRADER_PARSE, MODEL_GRADER_REFUSAL, MODEL_GRADER_SERVER, GraderError
from flywheel.graders.spec import LabelModelGrader, ScoreModelGrader
from flywheel.graders.templates import render
from flywheel.rewards.ruler import is_local_judge

if TYPE_CHECKING:
    from flywheel.model import Model

_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)
LOCAL_MAX_STEPS = 2
LOCAL_STEP_CHARS = 160


class JudgeSettings(BaseModel):
    """How model graders reach their judge."""

    model: str | None = None
    """Replaces the ``model`` of every model grader (LiteLLM form, e.g. ``openai/<served name>``)."""
    params: dict[str, Any] = {}
    """Extra keyword arguments for ``litellm.acompletion`` (``api_base``, ``api_key``, ``max_tokens``...)."""

    @classmethod
    def from_model(cls, model: Model, **params: Any) -> JudgeSettings:
        """Judge with a model served over an OpenAI-compatible API (e.g. one registered with a LocalBackend)."""
        settings = model.litellm_completion_params()
        return cls(model=settings.pop("model"), params=settings | params)


def _messages(
    grader: ScoreModelGrader | LabelModelGrader, namespaces: Mapping[str, Any], instruction: str
) -> list[dict[str, str]]:
    messages = [{"role": m.role, "content": render(m.template(), namespaces)} for m in grader.input]
    # The answer format goes into the leading system message (chat templates often allow only one, first).
    if messages[0]["role"] in ("system", "developer"):
        messages[0]["content"] = f"{messages[0]['content']}\n\n{instruction}"
    else:
        messages.insert(0, {"role": "system", "content": instruction})
    return messages


def _sampling(grader: ScoreModelGrader) -> dict[str, Any]:
    params = grader.sampling_params
    if params is None:
        return {}
    kwargs = {"temperature": params.temperature, "top_p": params.top_p, "seed": params.seed,
              "max_tokens": params.max_completions_tokens, "reasoning_effort": params.reasoning_effort}  # fmt: skip
    return {key: value for key, value in kwargs.items() if value is not None}


def _steps_schema(local_judge: bool, max_tokens: int | None) -> dict[str, Any]:
    text: dict[str, Any] = {"type": "string"}
    steps: dict[str, Any] = {"type": "array"}
    if local_judge:  # 2 strings per step, a character at most a token, ~48 tokens of JSON around them
        budget = LOCAL_STEP_CHARS if max_tokens is None else (int(max_tokens) - 48) // (2 * LOCAL_MAX_STEPS)
        text["maxLength"] = max(8, min(LOCAL_STEP_CHARS, budget))
        steps["maxItems"] = LOCAL_MAX_STEPS
    steps["items"] = {
        "type": "object",
        "properties": {"description": text, "conclusion": text},
        "required": ["description", "conclusion"],
        "additionalProperties": False,
    }
    return steps


def score_grid(low: float, high: float) -> list[float]:
    """The scores a local judge (``is_local_judge``) may give: ~100 to ~1,000 round numbers from low to high (a
    step of 1/100 of the range's order of magnitude: 0.01 for [0, 1] or [1, 5], 0.1 for [0, 10]), both ends
    included."""
    step = 10.0 ** math.floor(math.log10(high - low)) / 100 if high > low else 1.0
    decimals = max(0, -math.floor(math.log10(step)))
    count = math.floor((high - low) / step + 1e-9)
    return sorted({round(low + i * step, decimals) for i in range(count + 1)} | {low, high})


def _response_format(name: str, result: dict[str, Any], kwargs: dict[str, Any], local_judge: bool) -> dict[str, Any]:
    max_tokens = kwargs.get("max_tokens") or kwargs.get("max_completion_tokens")
    schema = {
        "type": "object",
        "properties": {"steps": _steps_schema(local_judge, max_tokens), "result": result},
        "required": ["steps", "result"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def _ask(
    model: str, messages: list[dict[str, str]], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The judge's JSON object and details (raw answer, token usage); GraderError on any failure."""
    # LiteLLM otherwise fetches a price list from the network when imported; the copy it ships is enough.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = (
        True  # its "Give Feedback / Get Help" banner on every failed call: GraderError says it
    )
    try:
        response = await litellm.acompletion(model=model, messages=messages, **kwargs)
    except Exception as exc:  # any failure to get an answer (connection, auth, 5xx, bad request) is the server's
        raise GraderError(MODEL_GRADER_SERVER, f"{model}: {type(exc).__name__}: {str(exc)[:500]}") from None
    message = response.choices[0].message
    details: dict[str, Any] = {"judge_model": model}
    usage = getattr(response, "usage", None)
    if usage is not None:
        details["token_usage"] = int(getattr(usage, "total_tokens", 0) or 0)
    # LiteLLM keeps OpenAI's refusal as an attribute for some providers, under provider_specific_fields for others.
    refusal = getattr(message, "refusal", None) or (getattr(message, "provider_specific_fields", None) or {}).get(
        "refusal"
    )
    if refusal:
        raise GraderError(MODEL_GRADER_REFUSAL, f"{model} refused: {str(refusal)[:300]}")
    content = message.content or ""
    details["judge_output"] = content[:2000]
    fenced = _FENCE.match(content)
    try:
        answer = json.loads(fenced.group(1) if fenced else content)
    except ValueError:
        raise GraderError(MODEL_GRADER_PARSE, f"{model} did not answer JSON: {content[:300]!r}") from None
    if not isinstance(answer, dict) or "result" not in answer:
        raise GraderError(MODEL_GRADER_PARSE, f"{model} answered without a 'result': {content[:300]!r}")
    if isinstance(answer.get("steps"), list):
        details["steps"] = answer["steps"]
    return answer, details


async def score_model(
    grader: ScoreModelGrader, namespaces: Mapping[str, Any], judge: JudgeSettings
) -> tuple[float, dict[str, Any]]:
    low, high = grader.range
    instruction = (
        "Respond with only a JSON object: "
        '{"steps": [{"description": "...", "conclusion": "..."}], "result": <number>}, '
        f"where steps is your reasoning and result your score, a number from {low:g} to {high:g}."
    )
    model, kwargs = judge.model or grader.model, _sampling(grader) | judge.params
    local_judge = is_local_judge(model, judge.params)
    result_schema: dict[str, Any] = {"type": "number", "minimum": low, "maximum": high}
    if local_judge:  # digits could otherwise run on forever
        result_schema = {"type": "number", "enum": score_grid(low, high)}
    kwargs["response_format"] = _response_format("score", result_schema, kwargs, local_judge)
    answer, details = await _ask(model, _messages(grader, namespaces, instruction), kwargs)
    result = answer["result"]
    if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
        raise GraderError(MODEL_GRADER_PARSE, f"the judge's result {result!r} is not a number")
    score = min(max(float(result), low), high)
    if score != result:
        details["unclamped_result"] = result
    return score, details


async def label_model(
    grader: LabelModelGrader, namespaces: Mapping[str, Any], judge: JudgeSettings
) -> tuple[float, dict[str, Any]]:
    labels = ", ".join(json.dumps(label) for label in grader.labels)
    instruction = (
        "Respond with only a JSON object: "
        '{"steps": [{"description": "...", "conclusion": "..."}], "result": <label>}, '
        f"where steps is your reasoning and result exactly one of these labels: {labels}."
    )
    model, kwargs = judge.model or grader.model, dict(judge.params)
    result_schema = {"type": "string", "enum": grader.labels}
    kwargs["response_format"] = _response_format("label", result_schema, kwargs, is_local_judge(model, judge.params))
    answer, details = await _ask(model, _messages(grader, namespaces, instruction), kwargs)
    label = answer["result"]
    if label not in grader.labels:
        raise GraderError(MODEL_GRADER_PARSE, f"the judge's label {label!r} is not one of {grader.labels}")
    details["label"] = label
    return float(label in grader.passing_labels), details

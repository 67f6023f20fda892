"""RULER: an LLM judge scores a group of trajectories of the same task relative to each other, from 0 to 1.

GRPO only uses how rewards compare within a group, and ranking attempts side by side is much easier for a judge
than grading one in isolation, so no reward function has to be written: the agent's own system prompt says what
the goal is, and a natural-language rubric says how to grade.

What the judge is sent (one request per group):

- the judge's instructions and the rubric, as the system message;
- ``<context>``: the longest leading run of messages that all trajectories share (the agent's system prompt, the
  user's request...), and the tool definitions if they are the same for all, sent once instead of once per
  trajectory;
- one ``<trajectory id="n">`` per distinct trajectory with the rest of its messages; identical trajectories are
  judged once and share the score. A trajectory's ``additional_histories`` (a sub-agent's conversation, turns
  before a context reset) follow its main messages, each in full inside ``<history n="k">``.

Messages are rendered as readable text: ``[role]`` headers, tool calls as ``name({arguments})``, tool results
with the id of the call they answer, and tool definitions as ``name(arg: type, ...)`` lines with descriptions.

The judge must answer ``{"scores": [{"trajectory_id", "explanation", "score"}]}``. The response format sent
narrows that schema to this group (its ids, exactly one entry each); for a local judge (``is_local_judge``)
it also pins each entry to its id, bounds scores to [0, 1], caps explanations and the answer's length, so that a
judge behind a server with constrained decoding (``flywheel serve``, vLLM, Ollama) cannot answer anything else,
however small it is. Answers are validated with pydantic; a wrong set of ids or unparseable JSON gets one repair request that says what was wrong, then fails.
Scores outside [0, 1] are clamped and counted. Timeouts, rate limits, connection errors and 5xx responses are
retried with exponential backoff. Validated answers are cached on disk (see ``flywheel.rewards.cache``).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Awaitable, Sequence
from typing import Any, Literal
from urllib.parse import urlparse

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, Field, ValidationError

from flywheel.rewards.cache import JudgeCache, resolve_cache
from flywheel.types import History, Message, MessageOrChoice, TrajectoryGroup

log = logging.getLogger(__name__)

# Use LiteLLM's bundled price list instead of fetching one from the internet on import (Flywheel runs offline).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

DEFAULT_JUDGE = "openai/o3"

DEFAULT_RUBRIC = """\
- A trajectory that achieves the goal the agent was given should score much higher than one that does not.
- Among trajectories that achieve the goal, the more efficient one (fewer unnecessary steps, tool calls or words)
  should score higher.
- Keep score differences proportional to differences in quality: near-equal trajectories get near-equal scores,
  a clearly worse one a clearly lower score.
- Give partial credit: a trajectory that makes real progress towards the goal scores above one that makes none.
"""

_INSTRUCTIONS = """\
You are a careful, impartial judge of an AI agent. Below are several trajectories: attempts by the agent at the \
same task. Work out the agent's goal from its own instructions (its system prompt and the first messages, in \
<context>, which all trajectories share). Then grade every trajectory relative to the others, with a score from \
0 (worst) to 1 (best), following this rubric:

<rubric>
{rubric}
</rubric>

Reply with JSON only, in this shape: {{"scores": [{{"trajectory_id": "<id>", "explanation": "<why>", "score": \
<number from 0 to 1>}}, ...]}}, with exactly one entry for each trajectory id ({ids}), in that order. Keep each \
explanation to one or two sentences."""

# Providers that run the model on the user's own machine or server (LiteLLM prefixes).
_LOCAL_PROVIDERS = ("hosted_vllm/", "ollama/", "ollama_chat/", "lm_studio/", "llamafile/")
LOCAL_EXPLANATION_CHARS = 240
_SCORE_STEPS = [0, *(round(i / 100, 2) for i in range(1, 100)), 1]

# Request parameters that do not change the judge's answer (or are secrets): left out of the cache key.
_NOT_IN_KEY = frozenset({"api_key", "timeout", "max_retries", "num_retries", "extra_headers", "metadata"})


class Score(BaseModel):
    """The judge's verdict on one trajectory."""

    trajectory_id: str
    explanation: str
    score: float = Field(allow_inf_nan=False)


class JudgeResponse(BaseModel):
    scores: list[Score]


class JudgeError(RuntimeError):
    """The judge could not produce a usable answer (after retries and one repair request)."""


class RetryPolicy(BaseModel):
    """Retries of transient judge errors (timeouts, 429, 5xx, connection errors), with exponential backoff."""

    attempts: int = Field(4, ge=1)
    initial_delay: float = Field(1.0, ge=0)
    max_delay: float = Field(30.0, ge=0)


class JudgeUsage(BaseModel):
    """What judging cost; pass one as ``usage=`` to add up several calls (it is updated in place)."""

    calls: int = 0  # requests that reached the judge, retries and repairs included
    cache_hits: int = 0
    retries: int = 0  # transient errors retried
    repairs: int = 0  # answers sent back for correction
    clamped: int = 0  # scores outside [0, 1] that were clamped
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None  # None while no call had a known price

    def add(self, other: JudgeUsage) -> None:
        for name in ("calls", "cache_hits", "retries", "repairs", "clamped", "prompt_tokens", "completion_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if other.cost_usd is not None:
            self.cost_usd = (self.cost_usd or 0.0) + other.cost_usd


# ---- rendering -----------------------------------------------------------------------------------------------


class _Candidate(BaseModel):
    """One trajectory as the judge sees it."""

    messages: list[Message]
    tools: list[dict] | None = None
    histories: list[History] = []

    def identity(self) -> str:
        extra = [(h.messages(), h.tools) for h in self.histories]
        return json.dumps([self.messages, self.tools, extra], sort_keys=True, default=str)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:  # OpenAI content parts: text is shown, anything else is named
        parts.append(part.get("text", "") if part.get("type") == "text" else f"[{part.get('type', 'part')}]")
    return "".join(parts)


def render_message(message: Message) -> str:
    role = message.get("role", "?")
    body = _text(message.get("content"))
    if role == "tool":
        return f"[tool result for {message.get('tool_call_id', '?')}]\n{body}"
    lines = [f"[{role}]"] + ([body] if body else [])
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        label = f"tool call {call['id']}" if call.get("id") else "tool call"
        lines.append(f"-> {label}: {fn.get('name')}({fn.get('arguments', '')})")
    return "\n".join(lines)


def _signature(schema: dict) -> str:
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    required = set(schema.get("required", [])) if isinstance(schema, dict) else set()

    def kind(p: dict) -> str:
        if "enum" in p:
            return "|".join(json.dumps(v) for v in p["enum"])
        return str(p.get("type", "any"))

    return ", ".join(f"{name}{'' if name in required else '?'}: {kind(p)}" for name, p in props.items())


def render_tools(tools: list[dict]) -> str:
    lines = ["Tools the agent can call:"]
    for tool in tools:
        fn = tool.get("function", tool)
        description = f": {fn['description']}" if fn.get("description") else ""
        lines.append(f"- {fn.get('name')}({_signature(fn.get('parameters', {}))}){description}")
    return "\n".join(lines)


def _render_history(messages: list[Message], tools: list[dict] | None) -> str:
    blocks = ([render_tools(tools)] if tools else []) + [render_message(m) for m in messages]
    return "\n\n".join(blocks)


def _common_prefix(lists: list[list[Message]]) -> int:
    n = 0
    while all(len(m) > n for m in lists) and all(m[n] == lists[0][n] for m in lists[1:]):
        n += 1
    return n


class JudgeRequest(BaseModel):
    """The judge request for one group, and which distinct trajectory (``ids``) each input maps to."""

    messages: list[Message]
    ids: list[str]
    assignment: list[int]  # input index -> index into ids
    response_format: dict[str, Any]


def build_request(
    candidates: Sequence[_Candidate],
    rubric: str = DEFAULT_RUBRIC,
    *,
    dedupe_prefix: bool = True,
    max_explanation_chars: int | None = None,
    local_judge: bool = False,
) -> JudgeRequest:
    """The judge prompt for a group. ``dedupe_prefix=False`` repeats shared messages in every trajectory (only
    for measuring what de-duplication saves). See ``_response_format`` for the other two."""
    unique: dict[str, int] = {}
    assignment = [unique.setdefault(c.identity(), len(unique)) for c in candidates]
    distinct = [candidates[assignment.index(i)] for i in range(len(unique))]
    ids = [str(i + 1) for i in range(len(distinct))]
    shared = dedupe_prefix and len(distinct) > 1
    prefix = _common_prefix([c.messages for c in distinct]) if shared else 0
    tools = distinct[0].tools
    shared_tools = shared and bool(tools) and all(c.tools == tools for c in distinct)
    parts = []
    if prefix or shared_tools:
        context = _render_history(distinct[0].messages[:prefix], tools if shared_tools else None)
        parts.append(f"<context>\n{context}\n</context>")
    for tid, c in zip(ids, distinct):
        body = _render_history(c.messages[prefix:], None if shared_tools else c.tools)
        body = body or "(no messages after the context: the trajectory ends there)"
        for k, h in enumerate(c.histories, 1):
            body += f'\n\n<history n="{k}">\n{_render_history(h.messages(), h.tools)}\n</history>'
        parts.append(f'<trajectory id="{tid}">\n{body}\n</trajectory>')
    system = _INSTRUCTIONS.format(rubric=rubric.strip(), ids=", ".join(f'"{i}"' for i in ids))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}]
    response_format = _response_format(ids, max_explanation_chars, local_judge)
    return JudgeRequest(messages=messages, ids=ids, assignment=assignment, response_format=response_format)


def _response_format(ids: list[str], max_explanation_chars: int | None, local_judge: bool) -> dict[str, Any]:
    """JudgeResponse's JSON schema, narrowed to this group: its ids, one entry each. For a local judge
    (``is_local_judge``) it also pins entry k to id k (``prefixItems``) and scores to hundredths in [0, 1], which
    a constrained decoder then enforces, so that even a tiny judge cannot repeat or skip an id;
    ``max_explanation_chars`` caps explanations (``maxLength``). Hosted APIs accept only a subset of JSON Schema in strict mode, hence the
    plainer schema for them."""
    explanation: dict[str, Any] = {"type": "string"}
    if max_explanation_chars is not None:
        explanation["maxLength"] = max_explanation_chars

    def entry(trajectory_id: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"trajectory_id": trajectory_id, "explanation": explanation, "score": score},
            "required": ["trajectory_id", "explanation", "score"],
            "additionalProperties": False,
        }

    # a bounded number (0, 0.01, ..., 1 as an enum), not merely [0, 1]: digits could otherwise run on forever
    score: dict[str, Any] = {"type": "number"} | ({"enum": _SCORE_STEPS} if local_judge else {})
    scores: dict[str, Any] = {"type": "array", "minItems": len(ids), "maxItems": len(ids)}
    if local_judge:
        scores |= {"prefixItems": [entry({"type": "string", "const": i}) for i in ids], "items": False}
    else:
        scores["items"] = entry({"type": "string", "enum": ids})
    schema = {"type": "object", "properties": {"scores": scores}, "required": ["scores"], "additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema, "strict": True}}


# ---- the judge call ------------------------------------------------------------------------------------------


def is_local_judge(judge_model: str, extra_litellm_params: dict[str, Any] | None) -> bool:
    """A local judge: one the user runs (a local provider, or any provider pointed at a loopback ``api_base``, in
    the params or for ``openai/`` models in LiteLLM's ``OPENAI_BASE_URL`` / ``OPENAI_API_BASE`` environment
    variables), such as ``flywheel serve``, rather than a hosted API. Its server is taken to decode under the full
    JSON schema, so it gets the strict, bounded one, and by default (``max_explanation_chars="auto"``) its
    explanations are capped: a small model might otherwise write on until its token budget runs out."""
    params = extra_litellm_params or {}
    base = params.get("api_base") or params.get("base_url")
    if base is None and judge_model.startswith("openai/"):
        base = os.environ.get("OPENAI_BASE_URL") or os.environ.get("OPENAI_API_BASE")
    host = urlparse(str(base or "")).hostname
    return judge_model.startswith(_LOCAL_PROVIDERS) or host in ("localhost", "127.0.0.1", "::1")


def _problem(content: str | None, ids: list[str]) -> tuple[JudgeResponse | None, str]:
    """The parsed answer, or None and what is wrong with it (in words the judge can act on)."""
    if not content:
        return None, "the reply was empty"
    try:
        parsed = JudgeResponse.model_validate_json(content)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return (
            None,
            f"the reply is not valid JSON of the required shape ({first['msg']}{f' at {where}' if where else ''})",
        )
    got = [s.trajectory_id for s in parsed.scores]
    if sorted(got) != sorted(ids):
        missing = [i for i in ids if i not in got]
        extra = sorted({i for i in got if i not in ids or got.count(i) > 1})
        detail = "; ".join(
            x
            for x in (f"missing ids {missing}" if missing else "", f"unknown or repeated ids {extra}" if extra else "")
            if x
        )
        return None, f"its trajectory ids {got} do not match the trajectories {ids} ({detail})"
    return parsed, ""


def _is_transient(exc: BaseException) -> bool:
    import litellm

    transient = (
        litellm.Timeout,
        litellm.RateLimitError,
        litellm.APIConnectionError,
        litellm.InternalServerError,
        litellm.ServiceUnavailableError,
        litellm.BadGatewayError,
    )
    return isinstance(exc, transient) or (getattr(exc, "status_code", None) or 0) >= 500


async def _complete(
    judge_model: str, messages: list[Message], params: dict[str, Any], retry: RetryPolicy, usage: JudgeUsage
) -> str | None:
    """One judge completion (with retries of transient errors); returns its text and adds to ``usage``."""
    import litellm
    import tenacity

    litellm.suppress_debug_info = True  # its "Give Feedback / Get Help" banner on every failed call: we report failures

    def count_retry(state: tenacity.RetryCallState) -> None:
        usage.retries += 1
        log.warning("judge call failed (%r), retrying (attempt %d)", state.outcome.exception(), state.attempt_number)

    retrying = tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(_is_transient),
        wait=tenacity.wait_random_exponential(multiplier=retry.initial_delay, max=retry.max_delay),
        stop=tenacity.stop_after_attempt(retry.attempts),
        before_sleep=count_retry,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            usage.calls += 1
            response = await litellm.acompletion(model=judge_model, messages=messages, **params)
    if response.usage is not None:
        usage.prompt_tokens += response.usage.prompt_tokens or 0
        usage.completion_tokens += response.usage.completion_tokens or 0
    try:
        cost = litellm.completion_cost(completion_response=response)
    except Exception:  # litellm raises for models it has no price for (local judges)
        cost = None
    if cost:
        usage.cost_usd = (usage.cost_usd or 0.0) + cost
    return response.choices[0].message.content


async def _judge(
    request: JudgeRequest,
    judge_model: str,
    extra_litellm_params: dict[str, Any] | None,
    cache: JudgeCache | None,
    retry: RetryPolicy,
    usage: JudgeUsage,
) -> JudgeResponse:
    # Our own retry loop is the only one: LiteLLM's and the OpenAI SDK's are turned off (unless asked for).
    params: dict[str, Any] = {"response_format": request.response_format, "num_retries": 0, "max_retries": 0}
    params.update(extra_litellm_params or {})
    key = JudgeCache.key(
        judge_model=judge_model,
        messages=request.messages,
        params={k: v for k, v in params.items() if k not in _NOT_IN_KEY},
    )
    if cache is not None and (hit := await _cached(cache.get(key), cache)) is not None:
        parsed, problem = _problem(hit, request.ids)
        if parsed is not None:
            usage.cache_hits += 1
            return parsed
        log.warning("ignoring an unusable cached judge answer (%s)", problem)
    messages = list(request.messages)
    content = await _complete(judge_model, messages, params, retry, usage)
    parsed, problem = _problem(content, request.ids)
    if parsed is None:
        usage.repairs += 1
        log.warning("judge answer unusable (%s); asking once for a corrected one", problem)
        messages += [
            {"role": "assistant", "content": content or ""},
            {
                "role": "user",
                "content": f"That reply cannot be used: {problem}. Reply again with JSON only, exactly one entry for "
                f"each trajectory id ({', '.join(request.ids)}), each score between 0 and 1.",
            },
        ]
        content = await _complete(judge_model, messages, params, retry, usage)
        parsed, problem = _problem(content, request.ids)
        if parsed is None:
            raise JudgeError(f"judge {judge_model} gave no usable answer after one repair request: {problem}")
    if cache is not None:
        await _cached(cache.put(key, parsed.model_dump_json(), model=judge_model), cache)
    return parsed


async def _cached(operation: Awaitable[str | None], cache: JudgeCache) -> str | None:
    """A cache lookup or store; a broken cache (unreadable file, full disk) costs a warning, never the answer."""
    try:
        return await operation
    except sqlite3.Error as exc:
        log.warning("judge cache %s failed (%r); going on without it", cache.path, exc)
        return None


def _auto_explanation_chars(local_judge: bool, n: int, max_tokens: int | None) -> int | None:
    """Hosted judges write freely; a local one is capped so that n guided explanations fit the token budget
    (a character is at most a token; ~40 tokens of JSON around each), else the JSON would be cut off."""
    if not local_judge:
        return None
    if max_tokens is None:
        return LOCAL_EXPLANATION_CHARS
    return min(LOCAL_EXPLANATION_CHARS, max(16, (int(max_tokens) - 32) // max(n, 1) - 40))


async def _score(
    candidates: Sequence[_Candidate],
    judge_model: str,
    extra_litellm_params: dict[str, Any] | None,
    rubric: str,
    *,
    cache: JudgeCache | str | os.PathLike[str] | bool | None,
    retry: RetryPolicy | None,
    usage: JudgeUsage,
    debug: bool,
    max_explanation_chars: int | Literal["auto"] | None,
) -> list[Score]:
    """One score per candidate, in input order (identical candidates share theirs)."""
    if not candidates:
        return []
    local_judge = is_local_judge(judge_model, extra_litellm_params)
    if max_explanation_chars == "auto":
        max_explanation_chars = _auto_explanation_chars(
            local_judge, len(candidates), (extra_litellm_params or {}).get("max_tokens")
        )
    request = build_request(candidates, rubric, max_explanation_chars=max_explanation_chars, local_judge=local_judge)
    if local_judge and max_explanation_chars is not None and "max_tokens" not in (extra_litellm_params or {}):
        # a bound on a runaway answer (a small model may write digits forever): a token per character at worst
        budget = len(request.ids) * (max_explanation_chars + 64) + 32
        extra_litellm_params = {**(extra_litellm_params or {}), "max_tokens": budget}
    answer = await _judge(
        request, judge_model, extra_litellm_params, resolve_cache(cache), retry or RetryPolicy(), usage
    )
    by_id: dict[str, Score] = {}
    for s in answer.scores:
        clamped = min(max(s.score, 0.0), 1.0)
        if clamped != s.score:
            usage.clamped += 1
            log.warning(
                "judge score %g for trajectory %s is outside [0, 1]; clamped to %g", s.score, s.trajectory_id, clamped
            )
        by_id[s.trajectory_id] = Score(trajectory_id=s.trajectory_id, explanation=s.explanation, score=clamped)
    if debug:
        _print_ranking(answer, by_id, judge_model)
    return [by_id[request.ids[i]].model_copy() for i in request.assignment]


def _print_ranking(answer: JudgeResponse, scores: dict[str, Score], judge_model: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print_json(answer.model_dump_json())
    table = Table(title=f"RULER scores ({judge_model})")
    for column in ("rank", "trajectory", "score", "explanation"):
        table.add_column(column, overflow="fold")
    ranked = sorted(scores.values(), key=lambda s: s.score, reverse=True)
    for rank, s in enumerate(ranked, 1):
        table.add_row(str(rank), s.trajectory_id, f"{s.score:.3f}", s.explanation)
    console.print(table)


# ---- public API ----------------------------------------------------------------------------------------------


def _as_messages(items: Sequence[MessageOrChoice]) -> list[Message]:
    return History(messages_and_choices=list(items)).messages()


async def ruler(
    message_lists: Sequence[Sequence[Message | Choice]],
    judge_model: str = DEFAULT_JUDGE,
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[dict] | None = None,
    *,
    debug: bool = False,
    cache: JudgeCache | str | os.PathLike[str] | bool | None = None,
    retry: RetryPolicy | None = None,
    usage: JudgeUsage | None = None,
    max_explanation_chars: int | Literal["auto"] | None = "auto",
) -> list[Score]:
    """Score conversations of the same task relative to each other; one ``Score`` per input, in order.

    ``judge_model`` is a LiteLLM model string (``openai/o3``, ``anthropic/...``, ``ollama/...``,
    ``hosted_vllm/...``; ``openai/<name>`` with ``extra_litellm_params={"api_base": ".../v1"}`` for any
    OpenAI-compatible server, ``flywheel serve`` included). ``extra_litellm_params`` go to ``litellm.acompletion``
    as they are (``api_base``, ``api_key``, ``temperature``, ``max_tokens``, ``timeout``...). ``tools`` are the
    tool definitions the agent was offered. ``cache``: a directory or ``JudgeCache``, False for none (default:
    ``$FLYWHEEL_JUDGE_CACHE`` or ``$FLYWHEEL_HOME/judge-cache``). ``usage`` accumulates tokens, cost, retries,
    repairs, cache hits and clamped scores. ``debug`` prints the judge's answer and a ranked table.
    ``max_explanation_chars`` caps each explanation in the response schema; "auto" caps it at
    ``LOCAL_EXPLANATION_CHARS`` for local judges (``is_local_judge``), whose constrained decoding enforces it and
    whose small models may otherwise ramble until their token budget runs out, and leaves hosted APIs uncapped
    (some refuse ``maxLength`` in a strict schema).
    Raises JudgeError when the judge gives no usable answer, and the judge's error when it keeps failing.
    """
    candidates = [_Candidate(messages=_as_messages(m), tools=tools) for m in message_lists]
    return await _score(
        candidates, judge_model, extra_litellm_params, rubric,
        cache=cache, retry=retry, usage=usage if usage is not None else JudgeUsage(), debug=debug,
        max_explanation_chars=max_explanation_chars,
    )  # fmt: skip


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str = DEFAULT_JUDGE,
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    debug: bool = False,
    cache: JudgeCache | str | os.PathLike[str] | bool | None = None,
    retry: RetryPolicy | None = None,
    usage: JudgeUsage | None = None,
    max_explanation_chars: int | Literal["auto"] | None = "auto",
) -> TrajectoryGroup | None:
    """A copy of the group whose rewards are the judge's scores (works as ``after_each=`` of
    ``gather_trajectory_groups``). Each trajectory keeps its previous reward in ``metrics["independent_reward"]``,
    gets the score in ``metrics["ruler_score"]``, the explanation in ``logs``, and its share of the group's judge
    tokens (and cost, when known) in ``metrics["judge_prompt_tokens"]``, ``["judge_completion_tokens"]`` and
    ``["judge_cost_usd"]``, so that summing them over trajectories gives the totals. The trajectories' own tools
    and ``additional_histories`` are shown to the judge. With ``swallow_exceptions=True`` a failure is logged and
    None returned (which drops the group in ``gather_trajectory_groups``). Other arguments: see ``ruler``.
    """
    call = JudgeUsage()
    try:
        trajectories = [t.model_copy(deep=True) for t in group.trajectories]
        candidates = [
            _Candidate(messages=t.messages(), tools=t.tools, histories=t.additional_histories) for t in trajectories
        ]
        scores = await _score(
            candidates, judge_model, extra_litellm_params, rubric,
            cache=cache, retry=retry, usage=call, debug=debug, max_explanation_chars=max_explanation_chars,
        )  # fmt: skip
    except Exception as exc:
        if not swallow_exceptions:
            raise
        log.warning("RULER failed on a group of %d trajectories; dropping it: %r", len(group.trajectories), exc)
        return None
    finally:
        if usage is not None:
            usage.add(call)
    share = max(len(trajectories), 1)
    for t, s in zip(trajectories, scores):
        t.metrics = {
            **t.metrics,
            "independent_reward": t.reward,
            "ruler_score": s.score,
            "judge_prompt_tokens": call.prompt_tokens / share,
            "judge_completion_tokens": call.completion_tokens / share,
            **({"judge_cost_usd": call.cost_usd / share} if call.cost_usd is not None else {}),
        }
        t.reward = s.score
        t.logs = [*t.logs, f"RULER ({judge_model}) score {s.score:.3f}: {s.explanation}"]
    return TrajectoryGroup(trajectories, exceptions=group.exceptions)

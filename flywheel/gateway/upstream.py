"""Upstreams: the gateway in front of any OpenAI-compatible server (a vLLM server, a hosted API), not only the
local engine.

A chat completion whose model the local registry does not serve goes to the upstream, if one is configured. A plain
``/v1`` call is relayed unchanged (streaming or not). A call made in an episode is relayed and recorded: the gateway
asks the upstream for what training needs, ``logprobs: true`` and vLLM's ``return_token_ids: true`` (vLLM then
returns the prompt's ids as the response's ``prompt_token_ids`` and each choice's sampled ids as its ``token_ids``;
streamed, the prompt's ids come on the first chunk and each chunk's choices carry their new ids), and strips the
log-probs the client did not ask for from what it returns. A response with the prompt's ids and every choice's
sampled ids is recorded as a local call is (``flywheel.types.set_sampled_tokens``: the request's temperature and
top-p, whether it asked for a grammar); one without them (a hosted API) is recorded *text-only*: usable for SFT,
graders and evaluation, never for RL. An upstream that answers 400 to the extra fields is asked once more without
them (and recorded text-only).

The temperature an upstream's log-probs are at is recorded apart from the one it sampled at
(``logprobs_temperature``): vLLM reports, by default (``--logprobs-mode raw_logprobs``), the log-probs of the raw
distribution, T = 1's, whatever the request's temperature; with ``processed_logprobs``, those of the distribution
it drew from, after temperature and after top-p / top-k (then no temperature the trainer computes when the request
truncates: recorded as null). ``Upstream.logprobs_mode`` says which the upstream was started with; an upstream that
states the temperature on its choices (a Flywheel server) is taken at its word. The trainer compares the sampler's
log-probs with its own (truncated importance sampling) only where they are at the temperature the turn trains at
(``SampledTokens.importance_logprobs``): an upstream call at T = 0.7 with raw log-probs trains at weight 1, counted
among ``tokens_without_sampler_logprobs``, and never joins as an off-policy member.

The gateway does not know an upstream's tokenizer, so it splices nothing into an upstream's prompt: each assistant
turn an upstream call re-sends counts as re-tokenized, and each upstream call trains (if it has ids) as the
sequence the upstream was fed and drew.

Errors: an upstream's 4xx goes back to the client as it is (status and body); an upstream that cannot be reached,
times out or answers 5xx is a 502 naming the upstream's host (never its key).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types.chat.chat_completion import Choice

from flywheel.gateway.recorder import Gateway, without_choice_fields
from flywheel.gateway.splice import Splice
from flywheel.openai_api import ErrorDetail, ErrorResponse
from flywheel.types import LOGPROBS_TEMPERATURE, set_sampled_tokens

log = logging.getLogger(__name__)

TRAINING_FIELDS = {"logprobs": True, "return_token_ids": True}  # what the gateway asks an upstream for
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's --logprobs-mode values that are log-probs


@dataclass(frozen=True)
class Upstream:
    """An OpenAI-compatible server the gateway relays to: ``base_url`` is its OpenAI base URL (with ``/v1``),
    ``api_key`` the key it wants (never logged, never shown), ``timeout`` the seconds a call may take,
    ``models_timeout`` those that its model list may take in ``GET /v1/models``, and ``logprobs_mode`` the log-probs
    it returns (vLLM's ``--logprobs-mode``: ``raw_logprobs``, its default, or ``processed_logprobs``)."""

    base_url: str
    api_key: str | None = field(default=None, repr=False)
    timeout: float = 300.0
    models_timeout: float = 2.0
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"The upstream URL {self.host_of(self.base_url)!r} is not an http(s) URL with a host.")
        if parts.username or parts.password:
            raise ValueError("The upstream URL must not hold credentials: give its key as the upstream's api_key.")
        if not (self.timeout > 0 and self.models_timeout > 0):
            raise ValueError("The upstream's timeouts must be positive numbers of seconds.")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"The upstream's logprobs_mode {self.logprobs_mode!r} is not one of {', '.join(LOGPROBS_MODES)}."
            )
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))

    @staticmethod
    def host_of(url: str) -> str:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}" if parts.hostname else url

    @property
    def host(self) -> str:
        """Where it is (scheme, host, port): what errors and call records name."""
        return self.host_of(self.base_url)


def _error(status: int, message: str, code: str) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, type="server_error", code=code))
    return JSONResponse(status_code=status, content=body.model_dump())


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def _logprobs_temperature(body: dict[str, Any], logprobs_mode: str) -> float | None:
    """The temperature an upstream's log-probs are at, for a request ``body`` (see the module doc): T = 1's for raw
    log-probs; the request's for processed ones, or None where top-p / top-k / min-p truncated them."""
    if logprobs_mode == "raw_logprobs":
        return 1.0
    truncated = _number(body, "top_p", 1.0) < 1.0 or _number(body, "top_k", -1) > 0 or _number(body, "min_p", 0) > 0
    return None if truncated else _number(body, "temperature", 1.0) or 1.0


GUIDES = ("guided_choice", "guided_json", "guided_regex", "guided_grammar", "structured_outputs")  # vLLM's fields


def guided_request(body: dict[str, Any]) -> bool:
    """Whether a chat completion request asks for a grammar, so that its choices are drawn from (and their log-probs
    are those of) a masked distribution: a forced tool call (``tool_choice`` "required" or a named function, with
    tools), a ``response_format`` other than text, or one of vLLM's guided-decoding fields."""
    choice, fmt = body.get("tool_choice"), body.get("response_format")
    forced = bool(body.get("tools")) and (choice == "required" or isinstance(choice, dict))
    formatted = isinstance(fmt, dict) and fmt.get("type") not in (None, "text")
    return forced or formatted or any(body.get(k) is not None for k in GUIDES)


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def recorded_response(
    response: dict[str, Any], request: dict[str, Any], logprobs_mode: str = "raw_logprobs"
) -> tuple[dict[str, Any], bool]:
    """The body to record for an upstream's chat.completion to ``request`` (as the client sent it), and whether it
    is text-only: each choice with the prompt's ids (the response's, or its own) and its sampled ids gets them as a
    local call's choice has them, with how it was drawn and the temperature its log-probs are at (the choice's own
    ``logprobs_temperature`` if the upstream states it, else as ``logprobs_mode`` says)."""
    shared = _ids(response.get("prompt_token_ids"))
    choices, text_only = [], not response.get("choices")
    temperature, top_p = _number(request, "temperature", 1.0), _number(request, "top_p", 1.0)
    for raw in response.get("choices") or []:
        prompt, completion = _ids(raw.get("prompt_token_ids")) or shared, _ids(raw.get("token_ids"))
        if prompt is None or completion is None:
            text_only = True
            choices.append(raw)
            continue
        choice = Choice.model_validate(raw)
        stated = raw.get(LOGPROBS_TEMPERATURE)
        logprobs_at = stated if isinstance(stated, int | float) else _logprobs_temperature(request, logprobs_mode)
        set_sampled_tokens(choice, prompt, completion, temperature, top_p=top_p, guided=guided_request(request))
        setattr(choice, LOGPROBS_TEMPERATURE, logprobs_at)  # None (kept as null): at no temperature TIS computes
        choices.append(choice.model_dump(mode="json", exclude_none=True) | {LOGPROBS_TEMPERATURE: logprobs_at})
    return {k: v for k, v in response.items() if k != "prompt_token_ids"} | {"choices": choices}, text_only


def without_logprobs(response: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion (or chunk) without its choices' log-probs."""
    return without_choice_fields(response, "logprobs")


class StreamAssembly:
    """A streamed chat completion's chunks put back together as one chat.completion body (what a non-streaming
    call would have returned, token ids and log-probs included)."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.prompt: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, dict[str, Any]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        self.head = self.head or {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        self.prompt = self.prompt or _ids(chunk.get("prompt_token_ids"))
        self.usage = chunk.get("usage") or self.usage
        for part in chunk.get("choices") or []:
            c = self.choices.setdefault(
                int(part.get("index", 0)),
                {"content": None, "calls": {}, "token_ids": [], "logprobs": [], "finish_reason": None, "prompt": None},
            )
            delta = part.get("delta") or {}
            if delta.get("content"):
                c["content"] = (c["content"] or "") + delta["content"]
            for call in delta.get("tool_calls") or []:
                slot = c["calls"].setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            c["token_ids"] += _ids(part.get("token_ids")) or []
            c["prompt"] = c["prompt"] or _ids(part.get("prompt_token_ids"))
            c["logprobs"] += (part.get("logprobs") or {}).get("content") or []
            c["finish_reason"] = part.get("finish_reason") or c["finish_reason"]

    @property
    def finished(self) -> bool:
        return bool(self.choices) and all(c["finish_reason"] for c in self.choices.values())

    def completion(self) -> dict[str, Any]:
        choices = []
        for index, c in sorted(self.choices.items()):
            calls = [
                {"id": s["id"], "type": "function", "function": {"name": s["name"], "arguments": s["arguments"]}}
                for _, s in sorted(c["calls"].items())
            ]
            message = {"role": "assistant", "content": c["content"]} | ({"tool_calls": calls} if calls else {})
            choice = {"index": index, "message": message, "finish_reason": c["finish_reason"]}
            choice |= {"logprobs": {"content": c["logprobs"]}} if c["logprobs"] else {}
            choice |= {"token_ids": c["token_ids"]} if c["token_ids"] else {}
            choice |= {"prompt_token_ids": c["prompt"]} if c["prompt"] else {}
            choices.append(choice)
        usage = self.usage
        if usage is None:
            completion_tokens = sum(len(c["token_ids"]) for c in self.choices.values())
            prompt_tokens = len(self.prompt or [])
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
        body = {"object": "chat.completion", **self.head, "choices": choices, "usage": usage}
        return body | ({"prompt_token_ids": self.prompt} if self.prompt else {})


class Relay:
    """Chat completions and model lists from an ``upstream``; calls in episodes are recorded through ``gateway``."""

    def __init__(self, upstream: Upstream, gateway: Gateway | None):
        self.upstream = upstream
        self.gateway = gateway

    def _client(self, timeout: float) -> httpx.AsyncClient:
        key = self.upstream.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.upstream.base_url, headers=headers, timeout=timeout)

    async def models(self) -> list[dict[str, Any]]:
        """The upstream's models (``GET /models``), or none if it does not answer in ``models_timeout``."""
        try:
            async with self._client(self.upstream.models_timeout) as http:
                response = await http.get("/models")
            response.raise_for_status()
            return [m for m in response.json()["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "The upstream at %s listed no models (%s): listing the local ones only.", self.upstream.host, exc
            )
            return []

    def _unavailable(self, exc: Exception) -> JSONResponse:
        what = (
            f"did not answer within {self.upstream.timeout:g} s"
            if isinstance(exc, httpx.TimeoutException)
            else f"could not be reached ({type(exc).__name__}: {exc or 'no detail'})"
        )
        return _error(502, f"The upstream at {self.upstream.host} {what}.", "upstream_unavailable")

    async def _refusal(self, response: httpx.Response) -> Response:
        """An upstream's error answer for the client: a 4xx as it is (OpenAI-shaped), a 5xx as a 502."""
        raw = await response.aread()
        try:
            body = json.loads(raw)
            message = body["error"]["message"] if isinstance(body.get("error"), dict) else str(body)
        except (ValueError, AttributeError, KeyError, TypeError):
            body, message = None, raw.decode("utf-8", "replace")[:500] or response.reason_phrase
        if response.status_code >= 500:
            text = f"The upstream at {self.upstream.host} failed ({response.status_code}): {message}"
            return _error(502, text, "upstream_error")
        if body is None or not isinstance(body.get("error"), dict):
            body = ErrorResponse(
                error=ErrorDetail(message=message, type="invalid_request_error", code=str(response.status_code))
            ).model_dump()
        return JSONResponse(status_code=response.status_code, content=body)

    async def _open(self, body: dict[str, Any]) -> tuple[httpx.AsyncClient, httpx.Response]:
        """Send ``body`` to the upstream's chat completions, its answer's body not read yet (raises httpx's
        errors); the caller closes both."""
        http = self._client(self.upstream.timeout)
        try:
            request = http.build_request("POST", "/chat/completions", json=body)
            return http, await http.send(request, stream=True)
        except BaseException:
            await http.aclose()
            raise

    async def chat(self, body: dict[str, Any], episode_id: str | None) -> Response:
        """Relay a chat completion (``body`` as the client sent it); in an episode, record it."""
        if episode_id is not None:
            assert self.gateway is not None
            await self.gateway.check_open(episode_id)  # unknown: 404; closed: 409, before the upstream is asked
        start = time.perf_counter()
        asked = body | TRAINING_FIELDS if episode_id is not None else body
        try:
            http, response = await self._open(asked)
            if response.status_code == 400 and asked is not body:  # it refuses the extra fields: ask as the client did
                await response.aclose()
                await http.aclose()
                http, response = await self._open(body)
        except httpx.HTTPError as exc:
            return self._unavailable(exc)
        if response.status_code >= 400:
            try:
                return await self._refusal(response)
            finally:
                await http.aclose()
        call = None if episode_id is None else _Call(self, episode_id, body, start)
        if body.get("stream"):
            return StreamingResponse(self._stream(http, response, call), media_type="text/event-stream")
        try:
            raw = await response.aread()
        except httpx.HTTPError as exc:
            return self._unavailable(exc)
        finally:
            await http.aclose()
        if call is None:  # a plain call: unchanged
            return Response(raw, status_code=response.status_code, media_type=response.headers.get("content-type"))
        try:
            full = json.loads(raw)
        except ValueError:
            return _error(502, f"The upstream at {self.upstream.host} answered with no JSON body.", "upstream_error")
        await call.record(full)  # queued for the writer before the agent sees the answer
        return JSONResponse(full if body.get("logprobs") else without_logprobs(full))

    async def _stream(
        self, http: httpx.AsyncClient, response: httpx.Response, call: _Call | None
    ) -> AsyncIterator[str]:
        """The upstream's server-sent events relayed as they come (in an episode: log-probs the client did not ask
        for taken out, and the call recorded once the stream is done, before its ``[DONE]``)."""
        assembly, done = StreamAssembly(), False
        try:
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip() if line.startswith("data:") else None
                if call is None or data is None:
                    yield line + "\n"
                elif data == "[DONE]":
                    if assembly.finished:
                        await call.record(assembly.completion())
                    done = True
                    yield line + "\n"
                else:
                    chunk = json.loads(data)
                    assembly.add(chunk)
                    shown = chunk if call.body.get("logprobs") else without_logprobs(chunk)
                    yield f"data: {json.dumps(shown)}\n"
            if call is not None and not done and assembly.finished:  # an upstream that sends no [DONE]
                await call.record(assembly.completion())
        except Exception as exc:  # the status line is already sent: report the error in-band, as OpenAI does
            message = (
                f"The upstream at {self.upstream.host} broke off the stream ({type(exc).__name__}: {exc})."
                if isinstance(exc, httpx.HTTPError | json.JSONDecodeError)
                else str(exc)  # the record was refused (e.g. the episode closed meanwhile)
            )
            yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
        finally:
            await response.aclose()
            await http.aclose()


@dataclass
class _Call:
    """An episode's call to the upstream, to record once its answer is complete."""

    relay: Relay
    episode_id: str
    body: dict[str, Any]  # as the client sent it
    start: float

    async def record(self, full: dict[str, Any]) -> None:
        gateway = self.relay.gateway
        assert gateway is not None
        response, text_only = recorded_response(full, self.body, self.relay.upstream.logprobs_mode)
        messages = self.body.get("messages") or []
        turns = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        await gateway.record(
            self.episode_id,
            Splice([], retokenized_turns=turns),  # nothing spliced: the gateway does not know its tokenizer
            set(),
            model=str(self.body.get("model")),
            step=None,
            request=self.body,
            response=response,
            latency_ms=(time.perf_counter() - self.start) * 1000,
            text_only=text_only,
            upstream=self.relay.upstream.host,
        )

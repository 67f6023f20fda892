"""Sampling on vLLM servers (issue #40): ``VLLMPool``, the servers of one base model and the tokenizer of the same
model directory, and ``VLLMEngine``, a ``SamplingEngine`` over them that speaks token ids, so that the gateway keeps
splicing exact ids and recording log-probs as it does with the embedded engine.

vLLM runs as its own server in its own environment (it pins its own torch, transformers and FastAPI); this module
talks HTTP with httpx and never imports it. A request goes to ``POST /inference/v1/generate`` (token ids in, token
ids and log-probs out; vLLM serves it with ``--enable-scale-out``), or, on a server without that route, to
``/v1/completions`` with the prompt as a list of ids and ``return_token_ids``. Either way the answer is streamed
and turned into ``TokenEvent``s; the text is decoded here, by the embedded engine's rules (``DecodedText``).

``VLLMPool.start`` refuses a server that would record wrong data, saying which URL and what disagreed: one whose
``/tokenize`` disagrees with the local tokenizer, one whose log-probs are not the sampling distribution's
(``--logprobs-mode processed_logprobs``: the same prompt at T=0.5 and T=1 must give different log-probs; vLLM's
default reports T=1's), one that does not serve the model. A guided request (``Guide``) sends its Lark grammar as
vLLM's structured output (``--structured-outputs-config '{"backend": "guidance"}'``, llguidance as here).

A request with a top-p below 1 is refused (a ``ValueError``, the API's 400): vLLM's processed log-probs are then the
renormalised nucleus's (``vllm/v1/sample/ops/topk_topp_sampler.py``: the top-k/top-p mask, then ``log_softmax``),
where the embedded engine records, and the trainer scores, the untruncated distribution's (``sampling.py``).

Faults of a server (a 5xx, a timeout, a dropped stream, a refused connection) become ``SamplerUnavailableError``
(the API's 502, naming the URL); a request vLLM refuses (4xx) stays the client's error (``VLLMRequestError``, 400).
Requests are routed by a hash of their first 512 prompt ids (a group's attempts and an episode's turns share one
server's prefix cache), unless that server has ``BUSY_SLACK`` more requests in flight than the least busy one.

LoRA adapters (vLLM started with ``--enable-lora --max-loras N --max-lora-rank R`` and the environment variable
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): ``VLLMPool.load_adapter`` loads a peft adapter directory into every server
under a name (``/v1/load_lora_adapter``), ``view(name, step)`` is the engine whose requests name that adapter, and
``unload_adapter`` closes the view, waits until none of its requests is in flight and unloads it from every server.
A refused load or unload is ``VLLMAdapterError``, naming the server and vLLM's message. Versioned names and their
retirement are ``flywheel.inference.vllm_adapters``'s.

Full fine-tuning (vLLM started with ``VLLM_SERVER_DEV_MODE=1``): ``VLLMPool.reload_weights`` replaces every server's
weights in place (``/pause?mode=wait``, ``/collective_rpc`` running the worker method ``reload_weights`` on a
directory of safetensors, ``/reset_prefix_cache``, ``/resume``); an engine ``hold``s its requests meanwhile, so each
is answered by the weights it names."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from flywheel.inference.engine import Completion, ContextOverflowError, DecodedText, EngineClosedError, TokenEvent
from flywheel.inference.protocol import SamplerUnavailableError
from flywheel.inference.sampling import SamplingParams

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
ROUTE_PREFIX = 512  # prompt ids hashed to pick a server
BUSY_SLACK = 8  # requests in flight beyond the least busy server's before the hashed server is passed over
LOAD_ADAPTER, UNLOAD_ADAPTER = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
# vLLM's routes for a weight reload (served with VLLM_SERVER_DEV_MODE=1): requests in flight finish, new ones wait
PAUSE, RELOAD, RESET_PREFIX_CACHE, RESUME = "/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"
DEV_ROUTES = "start vLLM with VLLM_SERVER_DEV_MODE=1 (its routes /pause, /collective_rpc, /resume)"
IDLE_POLL_S = 0.05  # how often an unload looks whether its adapter's last request has finished
PROBE_TEXT = 'Flywheel probe: 12 * 7 = 84; ünïcödé ✓ 漢字 <tool_call>{"name": "calc"}</tool_call>\n'
PROBE_GAP = 1e-3  # nats: the least difference between the T=0.5 and T=1 log-probs of a processed server
TOP_P_REFUSED = (
    "top_p={top_p}: a model sampled on vLLM takes only top_p = 1. vLLM's processed log-probs at a top-p below 1 are "
    "the nucleus's, renormalised (log p - log of the nucleus's mass), while the trainer scores the untruncated "
    "softmax(logits / T), as the embedded engine records it: every importance ratio would be off by the factor of "
    "the nucleus's mass. Leave top_p at 1 (the default), or sample on the embedded engine."
)


class VLLMRequestError(ValueError):
    """vLLM refused the request as malformed (a 4xx): the client's error, passed on as a 400 with vLLM's message."""


class VLLMRefusedError(RuntimeError):
    """A vLLM server failed a start-up probe: it would record data the trainer cannot use. Names the URL."""


class VLLMAdapterError(SamplerUnavailableError):
    """A vLLM server refused (or did not answer) a LoRA adapter's load or unload, or a reload of its weights: names
    the server, what was asked and vLLM's message (the API's 502: the fault is not the client's)."""


# ---- the wire: what vLLM 0.32 sends (only the fields used; the rest are ignored) --------------------------------


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _TopLogprob(_Wire):
    token_id: int
    logprob: float
    rank: int | None = None


class _TokenLogprob(_TopLogprob):
    top_logprobs: list[_TopLogprob] = []


class _GenerateLogprobs(_Wire):
    content: list[_TokenLogprob] | None = None


class _GenerateChoice(_Wire):
    index: int
    token_ids: list[int] | None = None
    logprobs: _GenerateLogprobs | None = None
    finish_reason: str | None = None


class _CompletionLogprobs(_Wire):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None


class _CompletionChoice(_Wire):
    index: int
    token_ids: list[int] | None = None
    logprobs: _CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Chunk(_Wire):
    choices: list[dict[str, Any]] = []
    error: dict[str, Any] | None = None


@dataclass
class _Delta:
    """One choice's new tokens in one chunk, whichever route sent them."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str | None


def _from_generate(raw: dict[str, Any], top_k: int) -> _Delta:
    choice = _GenerateChoice.model_validate(raw)
    content = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    ids = choice.token_ids or [c.token_id for c in content]
    # vLLM lists the sampled token first, then the ranked ones (asked for top_k + 1): the top k by rank
    top = [sorted(((t.token_id, t.logprob) for t in c.top_logprobs if t.rank and t.rank <= top_k), key=lambda p: -p[1])
           for c in content] if top_k else []  # fmt: skip
    return _Delta(choice.index, ids, [c.logprob for c in content], top, choice.finish_reason)


def _token_id(token: str) -> int:
    return int(token.removeprefix("token_id:"))  # return_tokens_as_token_ids: "token_id:123"


def _from_completions(raw: dict[str, Any], top_k: int) -> _Delta:
    choice = _CompletionChoice.model_validate(raw)
    lp = choice.logprobs or _CompletionLogprobs()
    ids = choice.token_ids or [_token_id(t) for t in lp.tokens]
    logprobs = [math.nan if x is None else x for x in lp.token_logprobs]
    top = (
        [sorted(((_token_id(t), v) for t, v in (d or {}).items()), key=lambda p: -p[1])[:top_k] for d in lp.top_logprobs or []]
        if top_k
        else []
    )  # fmt: skip
    return _Delta(choice.index, ids, logprobs, top, choice.finish_reason)


# ---- servers and the pool --------------------------------------------------------------------------------------


@dataclass
class VLLMServer:
    url: str
    route: str = GENERATE  # or COMPLETIONS, on a server without the token-in route (decided by ``VLLMPool.start``)
    in_flight: int = 0


@dataclass
class _Choice:
    """What this side knows of one choice: its ids so far, its text and whether it finished."""

    output: list[int] = field(default_factory=list)
    decoded: DecodedText = field(default_factory=DecodedText)
    finished: bool = False


class VLLMPool:
    """The vLLM servers of one base model (``urls``) and the tokenizer of the model directory they serve
    (``model_dir``, as the embedded engine loads it). ``model``: the name the servers serve it as (default: the one
    model the first server lists). ``start()`` before use."""

    def __init__(
        self,
        urls: list[str],
        model_dir: Path,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
    ):
        if not urls:
            raise ValueError("A vLLM pool needs at least one server URL.")
        self.servers = [VLLMServer(url.rstrip("/")) for url in urls]
        self.model_dir, self.model, self.timeout = Path(model_dir), model, timeout
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(self.model_dir)
        eos = set()
        if (self.model_dir / "generation_config.json").exists():
            configured = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            eos |= set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids: frozenset[int] = frozenset(eos)  # the embedded engine's rule
        self.context_length = 0
        self._views: dict[str | None, VLLMEngine] = {}  # one engine per served name: its requests counted together
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # one client per event loop: its connections belong to the loop that opened them (the server's, a test's)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if (client := self._clients.get(loop)) is None:
            timeout = httpx.Timeout(self.timeout, connect=10.0)
            client = self._clients[loop] = httpx.AsyncClient(headers=self._headers, timeout=timeout)
        return client

    async def start(self) -> VLLMPool:
        """Ask every server for its models and context length, and probe it (``VLLMRefusedError`` if it fails)."""
        lengths = []
        for server in self.servers:
            lengths.append(await self._models(server))
            await self._probe_tokenizer(server)
            await self._probe_route(server)
            await self._probe_logprobs(server)
        self.context_length = min(lengths)
        return self

    def engine(self) -> VLLMEngine:
        """The engine of the base model."""
        return self.view(None)

    def view(self, lora_name: str | None, step: int | None = None) -> VLLMEngine:
        """The engine whose requests name the adapter ``lora_name`` (None: the base model), loaded by
        ``load_adapter``; one per name while it is open, so that its requests in flight are counted together.
        ``step``: the checkpoint step the adapter holds, for whoever records what answered."""
        view = self._views.get(lora_name)
        if view is None or view.closed:
            view = self._views[lora_name] = VLLMEngine(self, lora_name, step)
        return view

    async def load_adapter(self, lora_name: str, path: Path) -> None:
        """Load the peft adapter directory ``path`` into every server as ``lora_name``. A version is never changed
        in place: a server that holds ``lora_name`` from ``path`` already (loaded by an earlier process) keeps it,
        one that holds it from another directory is refused. If a server refuses, those that loaded it here
        unload it again, and ``VLLMAdapterError`` says which server refused and why."""
        body = {"lora_name": lora_name, "lora_path": str(path)}  # as the servers see it: give it absolute
        done: list[VLLMServer] = []
        try:
            for server in self.servers:
                held = await self._adapter_path(server, lora_name)
                if held == str(path):
                    continue
                if held is not None:
                    raise VLLMAdapterError(
                        server.url,
                        f"it serves the adapter '{lora_name}' from {held} already, not from {path}: a version is "
                        "never changed in place (unload it first: POST /v1/unload_lora_adapter)",
                    )
                await self._adapter_call(server, LOAD_ADAPTER, body, f"load the adapter '{lora_name}' from {path}")
                done.append(server)
        except VLLMAdapterError:
            for server in done:
                await self._adapter_call(server, UNLOAD_ADAPTER, {"lora_name": lora_name}, "unload it again")
            raise

    async def unload_adapter(self, lora_name: str) -> None:
        """Unload ``lora_name`` from every server once none of its requests is in flight: its view takes no new
        requests from now on (``EngineClosedError``), those in flight finish first. An adapter a server does not
        hold (404) is gone there already."""
        view = self._views.pop(lora_name, None)
        if view is not None:
            view.close()
            # polled, not an Event: its requests may run on another thread's event loop (the server's)
            while view.in_flight:  # noqa: ASYNC110
                await asyncio.sleep(IDLE_POLL_S)
        for server in self.servers:
            await self._adapter_call(
                server, UNLOAD_ADAPTER, {"lora_name": lora_name}, f"unload the adapter '{lora_name}'", missing_ok=True
            )

    async def reload_weights(self, directory: Path) -> None:
        """Every server's weights replaced, in place, by the model in ``directory`` (``model.safetensors``, the
        weights under their Hugging Face names: a full fine-tuning checkpoint's): generation paused once the requests
        in flight have finished (new ones wait), vLLM's worker method ``reload_weights`` run, the prefix cache
        (computed with the old weights) dropped, generation resumed. The servers in parallel; one that fails is
        resumed anyway and ``VLLMAdapterError`` names it and what it said."""

        async def reload(server: VLLMServer) -> None:
            await self._adapter_call(server, PAUSE, {}, "pause generation", missing=DEV_ROUTES)
            try:
                body = {"method": "reload_weights", "kwargs": {"weights_path": str(directory)}}
                await self._adapter_call(
                    server, RELOAD, body, f"reload its weights from {directory}", missing=DEV_ROUTES
                )
                await self._adapter_call(server, RESET_PREFIX_CACHE, {}, "drop its prefix cache")
            finally:
                await self._adapter_call(server, RESUME, {}, "resume generation")

        await asyncio.gather(*(reload(server) for server in self.servers))

    async def adapters(self) -> dict[str, set[str]]:
        """The adapters the servers hold now (loaded by this process or an earlier one): each name, with the
        directories the servers hold it from (one, unless servers disagree)."""
        held: dict[str, set[str]] = {}
        for server in self.servers:
            for name, root in (await self._adapter_roots(server)).items():
                held.setdefault(name, set()).add(root)
        return held

    async def _adapter_roots(self, server: VLLMServer) -> dict[str, str]:
        """The adapters ``server`` serves, each with the directory it was loaded from (vLLM lists it as the
        adapter's root)."""
        try:
            body = await self._get_json(server, "/v1/models")
        except VLLMRefusedError as exc:
            raise VLLMAdapterError(server.url, str(exc)) from exc
        cards = [m for m in body.get("data", []) if isinstance(m, dict) and m.get("id") != self.model]
        return {str(m.get("id")): str(m.get("root")) for m in cards}

    async def _adapter_path(self, server: VLLMServer, lora_name: str) -> str | None:
        """The directory ``server`` serves the adapter ``lora_name`` from, or None if it does not serve it."""
        return (await self._adapter_roots(server)).get(lora_name)

    async def _adapter_call(
        self, server: VLLMServer, path: str, body: dict, what: str, *, missing_ok: bool = False, missing: str = ""
    ) -> None:
        """POST ``body`` to ``server``'s ``path``; a refusal is ``VLLMAdapterError`` saying it could not ``what``.
        ``missing_ok``: a 404 is fine; ``missing``: what to do about a 404 (a route the server does not have)."""
        try:
            response = await self._client.post(server.url + path, json=body)
        except httpx.HTTPError as exc:
            raise VLLMAdapterError(server.url, f"it did not answer the request to {what}: {exc!r}") from exc
        if response.status_code == 200 or (missing_ok and response.status_code == 404):
            return
        advice = f" ({missing})" if missing and response.status_code == 404 else ""
        raise VLLMAdapterError(
            server.url, f"it refused to {what} (HTTP {response.status_code}): {self._message(response)}{advice}"
        )

    async def aclose(self) -> None:
        """Close this event loop's connections."""
        if (client := self._clients.pop(asyncio.get_running_loop(), None)) is not None:
            await client.aclose()

    # ---- probes ----

    async def _models(self, server: VLLMServer) -> int:
        body = await self._get_json(server, "/v1/models")
        models = {m.get("id"): m for m in body.get("data", []) if isinstance(m, dict)}
        if self.model is None and models:
            self.model = next(iter(models))
        if self.model not in models:
            raise VLLMRefusedError(
                f"The vLLM server at {server.url} does not serve the model '{self.model}' (it serves: "
                f"{', '.join(map(str, models)) or 'nothing'}); start it with --served-model-name {self.model}."
            )
        length = models[self.model].get("max_model_len")
        if not isinstance(length, int):
            raise VLLMRefusedError(f"The vLLM server at {server.url} did not say its context length (max_model_len).")
        return length

    async def _probe_tokenizer(self, server: VLLMServer) -> None:
        text = PROBE_TEXT + (self.tokenizer.eos_token or "")
        body = await self._post_json(
            server, "/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False}
        )
        local = self.tokenizer.encode(text, add_special_tokens=False)
        if body.get("tokens") != local:
            raise VLLMRefusedError(
                f"The vLLM server at {server.url} tokenizes differently from {self.model_dir}: {text!r} is "
                f"{body.get('tokens')} there and {local} here. Serve the same model directory on both sides."
            )

    async def _probe_route(self, server: VLLMServer) -> None:
        """The token-in route, or the completions fallback where the server has not that route (404; 403: vLLM
        without --enable-scale-out)."""
        ids = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        body = self._request_body(server, ids, SamplingParams(temperature=0, max_tokens=1), stream=False)
        try:
            response = await self._client.post(server.url + server.route, json=body)
        except httpx.HTTPError as exc:
            raise VLLMRefusedError(f"The vLLM server at {server.url} did not answer: {exc!r}") from exc
        if response.status_code in (403, 404):
            server.route = COMPLETIONS
        elif response.status_code != 200:
            raise VLLMRefusedError(
                f"The vLLM server at {server.url} refused a token-in request ({response.status_code}): "
                f"{response.text[:300]}"
            )

    async def _probe_logprobs(self, server: VLLMServer) -> None:
        ids = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        best = []
        for temperature in (0.5, 1.0):
            params = SamplingParams(temperature=temperature, max_tokens=1, seed=0, top_logprobs=1, logprobs=True)
            deltas = [d async for d in self._deltas(server, ids, params)]
            tops = [d.top[0][0][1] for d in deltas if d.top and d.top[0]]
            if not tops:
                raise VLLMRefusedError(f"The vLLM server at {server.url} returned no log-probs for a probe.")
            best.append(tops[0])
        if abs(best[0] - best[1]) < PROBE_GAP:
            raise VLLMRefusedError(
                f"The vLLM server at {server.url} returns the same log-probs at T=0.5 and T=1 ({best[0]:.4f}): "
                "those of T=1, not of the distribution it samples from, which every importance ratio would get "
                "wrong. Start it with --logprobs-mode processed_logprobs."
            )

    # ---- requests ----

    def pick(self, prompt: list[int]) -> VLLMServer:
        """The server for a prompt: the one its first ``ROUTE_PREFIX`` ids hash to (rendezvous hashing, so that
        adding a server moves few prefixes), unless it is ``BUSY_SLACK`` requests busier than the least busy."""
        key = json.dumps(prompt[:ROUTE_PREFIX]).encode()
        ranked = sorted(self.servers, key=lambda s: hashlib.blake2b(key + s.url.encode(), digest_size=8).digest())
        least = min(s.in_flight for s in self.servers)
        return next(s for s in ranked if s.in_flight <= least + BUSY_SLACK)

    def _request_body(
        self, server: VLLMServer, prompt: list[int], params: SamplingParams, *, stream: bool, model: str | None = None
    ) -> dict:
        """vLLM's request body; ``model``: the served name asked for (an adapter's), else the base model's."""
        model = model or self.model
        sampling: dict[str, Any] = {
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "seed": params.seed,
            "stop": params.stop,
            "ignore_eos": params.ignore_eos,
            # the sampled token's log-prob always (the gateway records it); vLLM's list starts with the sampled
            # token, so the top k come with k + 1
            "logprobs": params.top_logprobs + 1 if params.top_logprobs else 0,
        }
        if not params.ignore_eos:
            sampling["stop_token_ids"] = sorted(self.eos_ids)  # the embedded engine's stop tokens, whatever vLLM's
        if params.guide is not None:
            sampling["structured_outputs"] = {"grammar": params.guide.grammar}
        if server.route == GENERATE:
            return {"model": model, "token_ids": prompt, "sampling_params": sampling, "stream": stream}
        sampling.pop("structured_outputs", None)
        extra = {"structured_outputs": {"grammar": params.guide.grammar}} if params.guide is not None else {}
        return {
            "model": model, "prompt": prompt, **sampling, **extra, "stream": stream, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "skip_special_tokens": False,
        }  # fmt: skip

    async def _deltas(
        self, server: VLLMServer, prompt: list[int], params: SamplingParams, model: str | None = None
    ) -> AsyncIterator[_Delta]:
        """The streamed answer's chunks as deltas; a fault of the server's is ``SamplerUnavailableError``."""
        parse = _from_generate if server.route == GENERATE else _from_completions
        body = self._request_body(server, prompt, params, stream=True, model=model)
        server.in_flight += 1
        finished: set[int] = set()
        try:
            async with self._client.stream("POST", server.url + server.route, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise self._status_error(server, response)
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ").strip()
                    if data == "[DONE]":
                        break
                    chunk = _Chunk.model_validate_json(data)
                    if chunk.error is not None:
                        raise self._stream_error(server, chunk.error)
                    for raw in chunk.choices:
                        delta = parse(raw, params.top_logprobs)
                        if delta.finish_reason is not None:
                            finished.add(delta.index)
                        yield delta
        except (httpx.TimeoutException, httpx.TransportError) as exc:
            raise SamplerUnavailableError(server.url, f"{type(exc).__name__}: {exc or 'no detail'}") from exc
        except (ValidationError, ValueError) as exc:
            if isinstance(exc, VLLMRequestError):
                raise
            raise SamplerUnavailableError(server.url, f"an answer this client cannot read ({exc})") from exc
        finally:
            server.in_flight -= 1
        if len(finished) < params.n:
            raise SamplerUnavailableError(
                server.url, f"the stream ended with {params.n - len(finished)} of {params.n} choices unfinished"
            )

    @staticmethod
    def _message(response: httpx.Response) -> str:
        try:
            error = response.json().get("error", {})
            return str(error.get("message") if isinstance(error, dict) else error) or response.text[:300]
        except ValueError:
            return response.text[:300]

    def _status_error(self, server: VLLMServer, response: httpx.Response) -> Exception:
        if 400 <= response.status_code < 500 and response.status_code not in (401, 403, 404, 408, 429):
            return VLLMRequestError(f"vLLM refused the request: {self._message(response)}")
        return SamplerUnavailableError(server.url, f"HTTP {response.status_code}: {self._message(response)}")

    @staticmethod
    def _stream_error(server: VLLMServer, error: dict[str, Any]) -> Exception:
        message, code = str(error.get("message", error)), error.get("code")
        if isinstance(code, int) and 400 <= code < 500:
            return VLLMRequestError(f"vLLM refused the request: {message}")
        return SamplerUnavailableError(server.url, f"an error in its stream: {message}")

    async def _get_json(self, server: VLLMServer, path: str) -> dict[str, Any]:
        try:
            response = await self._client.get(server.url + path)
        except httpx.HTTPError as exc:
            raise VLLMRefusedError(f"The vLLM server at {server.url} did not answer {path}: {exc!r}") from exc
        if response.status_code != 200:
            raise VLLMRefusedError(f"The vLLM server at {server.url} answered {path} with {response.status_code}.")
        return response.json()

    async def _post_json(self, server: VLLMServer, path: str, body: dict) -> dict[str, Any]:
        try:
            response = await self._client.post(server.url + path, json=body)
        except httpx.HTTPError as exc:
            raise VLLMRefusedError(f"The vLLM server at {server.url} did not answer {path}: {exc!r}") from exc
        if response.status_code != 200:
            raise VLLMRefusedError(
                f"The vLLM server at {server.url} answered {path} with {response.status_code}: {response.text[:300]}"
            )
        return response.json()


class VLLMEngine:
    """A ``SamplingEngine`` over a started ``VLLMPool``: token events with the server's log-probs (at the sampling
    temperature: the probe saw to it), text decoded here by the embedded engine's rules. ``lora_name``: the adapter
    its requests name (``VLLMPool.view``), None for the base model; ``in_flight``: its requests not finished yet."""

    def __init__(self, pool: VLLMPool, lora_name: str | None = None, step: int | None = None):
        if not pool.context_length:
            raise ValueError("Start the vLLM pool (await pool.start()) before making an engine of it.")
        self.pool, self.lora_name, self.step = pool, lora_name, step
        self.tokenizer, self.eos_ids, self.context_length = pool.tokenizer, pool.eos_ids, pool.context_length
        self.in_flight = 0
        self._closed = False
        self._open = threading.Event()  # cleared while the weights it names are being loaded (``hold``)
        self._open.set()

    @property
    def closed(self) -> bool:
        return self._closed

    def hold(self) -> None:
        """Requests wait (before they reach a server) until ``release``: the weights this engine names are not on
        the servers yet (a full fine-tuning step being reloaded)."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.context_length:
            raise ContextOverflowError(self.context_length, prompt_tokens, max_tokens)

    async def stream(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if not self._open.is_set():  # set from another thread (the backend's), read on the server's event loop
            await asyncio.to_thread(self._open.wait)
        if self._closed:
            what = f"the adapter '{self.lora_name}'" if self.lora_name else "the vLLM engine"
            raise EngineClosedError(f"{what[0].upper()}{what[1:]} is closed (unloaded): it accepts no new requests.")
        if not prompt:
            raise ValueError("The prompt is empty.")
        if params.top_p < 1.0:
            raise ValueError(TOP_P_REFUSED.format(top_p=params.top_p))
        self.check_fits(len(prompt), params.max_tokens)
        choices = [_Choice() for _ in range(params.n)]
        server = self.pool.pick(prompt)
        self.in_flight += 1  # until the last chunk is read or the stream given up: an unload waits for it
        try:
            async for delta in self.pool._deltas(server, prompt, params, self.lora_name):
                if not 0 <= delta.index < params.n or choices[delta.index].finished:
                    raise SamplerUnavailableError(server.url, f"a chunk for choice {delta.index}, which is not open")
                yield self._event(server, choices[delta.index], delta, params)
        finally:
            self.in_flight -= 1

    def _event(self, server: VLLMServer, choice: _Choice, delta: _Delta, params: SamplingParams) -> TokenEvent:
        """The delta as a token event: the embedded engine's text rules (``InferenceEngine._accept``), vLLM's ids."""
        stopped = False
        for token in delta.token_ids:
            choice.output.append(token)
            if token in self.eos_ids and not params.ignore_eos:
                stopped = True
            elif not stopped and choice.decoded.update(self.tokenizer, choice.output, params.stop):
                stopped = True
        finish = None
        if delta.finish_reason not in (None, "stop", "length"):  # "abort": vLLM gave up on it
            raise SamplerUnavailableError(server.url, f"choice {delta.index} ended with '{delta.finish_reason}'")
        if delta.finish_reason is not None:
            choice.finished = True
            finish = "length" if delta.finish_reason == "length" and not stopped else "stop"
        return TokenEvent(
            index=delta.index,
            token_ids=delta.token_ids,
            logprobs=delta.logprobs,
            top_logprobs=delta.top if params.top_logprobs else [],
            text_delta=choice.decoded.delta(params.stop, finished=finish is not None),
            finish_reason=finish,
        )

    async def generate(self, prompt: list[int], params: SamplingParams) -> list[Completion]:
        done = [Completion(i, "", [], [], [], "") for i in range(params.n)]
        async for event in self.stream(prompt, params):
            c = done[event.index]
            c.text += event.text_delta
            c.token_ids += event.token_ids
            c.logprobs += event.logprobs
            c.top_logprobs += event.top_logprobs
            c.finish_reason = event.finish_reason or c.finish_reason
        return done

    def close(self, *, drain: bool = False, timeout: float = 10.0) -> None:
        """No new requests from now on; those in flight finish (vLLM's server is not this engine's to stop)."""
        self._closed = True
        self._open.set()  # requests held are refused now, not left waiting

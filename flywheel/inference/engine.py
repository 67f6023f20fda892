"""In-process inference engine: continuous batching over a slot KV cache, for any HF causal LM.

One worker thread owns the model. Each iteration it (1) admits waiting requests by prefilling their prompts
packed into one sequence, (2) decodes one token for every running sequence in a single batched forward, and
(3) hands new tokens to the requests' asyncio loops. Requests that arrive while a batch decodes join it at the
next iteration; finished ones leave without disturbing the others. ``n > 1`` prefills the prompt once and copies
its cache rows. The trainer shares the same model object: ``engine.exclusive()`` pauses decoding around a
weight update, so the very next token is sampled from the new weights, and ``engine.call(fn)`` runs a training
step on the worker thread itself (see ``call``). ``close()`` ends every request still waiting or decoding with
``EngineClosedError`` (or, with ``drain``, lets them finish first); engines still open when the interpreter exits
are closed by an ``atexit`` hook, so that no worker thread is inside a torch operator while Python finalizes.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flywheel.inference import llama_forward
from flywheel.inference.guided import constrain
from flywheel.inference.kv_attention import ATTN_IMPLEMENTATION, WINDOW_STEP, DecodeBatch, PrefillBatch, SlotKVCache
from flywheel.inference.memory import freeze_objects, keep_freed_memory, release_free_memory, thaw_objects
from flywheel.inference.packed_linear import PackedLinears, packing_available
from flywheel.inference.prefix_cache import MIN_REUSE, PrefixCache, common_prefix
from flywheel.inference.sampling import SamplingParams, sample

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger(__name__)
T = TypeVar("T")
EXIT_JOIN_SECONDS = 60.0  # at interpreter exit, how long to wait for a worker's current step (a training step)


class EngineClosedError(RuntimeError):
    """The engine was closed: a request or call submitted after that, or still unfinished then, gets this."""


class ContextOverflowError(ValueError):
    """Prompt plus requested completion does not fit in the model's context window. The message is OpenAI's (and
    vLLM's), then what to do: the largest ``max_tokens`` that fits after these messages, or how much to shorten them.
    The request is refused, not clipped to what is left, as they do."""

    def __init__(self, limit: int, prompt_tokens: int, max_tokens: int):
        self.limit, self.prompt_tokens, self.max_tokens = limit, prompt_tokens, max_tokens
        largest = limit - prompt_tokens  # the largest max_tokens that fits; 0 or less: none does
        remedy = (
            f"At most {largest} completion tokens fit after these messages: ask max_tokens (or "
            f"max_completion_tokens) of {largest} or less, or leave it out for whatever the context has left."
            if largest > 0
            else f"The messages alone fill the context: shorten them by at least {1 - largest} tokens."
        )
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
            f"Please reduce the length of the messages or completion. {remedy}"
        )


@dataclass
class TokenEvent:
    """What a request learns after each step: new tokens for one of its ``n`` choices."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text_delta: str
    finish_reason: str | None = None  # "stop" | "length" once finished

    def extend(self, later: TokenEvent) -> TokenEvent:
        """This event followed by ``later`` (of the same choice), as one."""
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.top_logprobs += later.top_logprobs
        self.text_delta += later.text_delta
        self.finish_reason = later.finish_reason
        return self


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str


@dataclass
class DecodedText:
    """A choice's text as its tokens arrive, by the rules every engine shares: the tokens so far decoded whole (a
    token may complete a character the last one began), cut before the first stop string, and handed out without
    what may still become a stop string or a character (``delta``). End-of-sequence tokens never reach it."""

    text: str = ""
    emitted: int = 0  # characters of ``text`` already handed out

    def update(self, tokenizer: PreTrainedTokenizerBase, output: list[int], stops: list[str]) -> bool:
        """Decode ``output`` (all the choice's tokens); True when a stop string appeared, the text cut before it."""
        text = tokenizer.decode(output, skip_special_tokens=False)
        hit = False
        if stops:
            # only the tail can contain a stop string that was not there one token ago
            window = len(self.text) - max(len(s) for s in stops)
            hits = [i for s in stops if (i := text.find(s, max(window, 0))) >= 0]
            if hits:
                text, hit = text[: min(hits)], True
        self.text = text
        return hit

    def delta(self, stops: list[str], finished: bool) -> str:
        """The text not handed out yet, less (unless ``finished``) a tail that could begin a stop string or is half
        a character; it counts as handed out."""
        hold = 0 if finished else max((len(s) - 1 for s in stops), default=0)
        visible = len(self.text) - hold
        if not finished and self.text.endswith("\ufffd"):
            visible = min(visible, len(self.text) - 1)
        delta = self.text[self.emitted : max(visible, self.emitted)]
        self.emitted += len(delta)
        return delta


@dataclass
class _Sequence:
    index: int
    request: _Request
    generator: torch.Generator | None
    row: int = -1
    length: int = 0  # tokens stored in the KV cache
    output: list[int] = field(default_factory=list)
    decoded: DecodedText = field(default_factory=DecodedText)  # its text so far, cut at a stop string
    finish_reason: str | None = None
    generation: int = 0  # the weights generation its KV started in (see ``InferenceEngine.exclusive``)
    matcher: LLMatcher | None = None  # the parser state of a guided (response_format) request
    held: TokenEvent | None = None  # a ``whole`` request's events so far, merged


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    # one event per choice when it finishes, not one per token: each event wakes the request's coroutine on its
    # loop's thread, whose Python work then takes the GIL and a core from the decode step
    whole: bool = False
    cancelled: bool = False


def _put_all(batch: list[tuple[_Request, TokenEvent | BaseException]]) -> None:
    for request, item in batch:
        request.queue.put_nowait(item)


class InferenceEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch: int = 64,
        max_prefill_tokens: int = 4096,
        prefix_cache_entries: int = 32,
        pack_weights: bool = True,
        compile: bool = False,
    ):
        self.model, self.tokenizer = model, tokenizer
        # sampling on CPU with weights in the GEMM's own layout (see packed_linear.py); training is unaffected
        self._packed = PackedLinears(model) if pack_weights and packing_available(model) else None
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self._llama = llama_forward.supports(model)  # a faster forward for sampling (see llama_forward.py)
        self._compiled = self._compiled_decode() if compile else None
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cfg = model.config.get_text_config()
        self.context_length: int = int(getattr(cfg, "max_position_embeddings", 4096))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cache = SlotKVCache(
            cfg.num_hidden_layers,
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim,
            dtype=model.dtype,
            device=model.device,
            max_rows=max_batch,
            max_capacity=self.context_length,
        )
        self.prefix_cache = PrefixCache(self.cache, prefix_cache_entries) if prefix_cache_entries else None
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos_ids)
        self._waiting: deque[_Request] = deque()
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._running: list[_Sequence] = []  # index i lives in cache row i
        self._wake = threading.Condition()
        self._model_lock = threading.RLock()
        self._closed = False  # no new requests or calls; the worker stops once idle (``close(drain=True)``)
        self._stopped = False  # the worker stops after its current step
        # bumped by every ``exclusive()`` (a weight update): KV computed in an older generation is never cached
        self.weights_generation = 0
        self._ids = itertools.count()
        freeze_objects()  # what the model and libraries hold is never garbage: keep full collections off it
        keep_freed_memory()  # a decode step reuses the last one's pages instead of faulting in fresh ones
        self._thread = threading.Thread(target=self._run, name="flywheel-engine", daemon=True)
        self._thread.start()
        _open_engines.add(self)

    def _compiled_decode(self) -> llama_forward.CompiledDecode:
        """The opt-in compiled decode step (``llama_forward.CompiledDecode``), or a clear error where it cannot run."""
        if not (self._llama and self._packed is not None):
            raise ValueError(
                "compile=True compiles the CPU decode step of Llama-architecture models (SmolLM2, Llama, TinyLlama) "
                f"with packed weights; this engine has a {type(self.model).__name__} on {self.model.device} "
                f"({self.model.dtype}, weights {'packed' if self._packed else 'not packed'}). Leave compile off."
            )
        if not llama_forward.cxx_compiler_found():
            raise ValueError(
                "compile=True needs a C++ compiler (torch.compile builds C++ kernels on CPU): install g++ (Debian, "
                "Ubuntu: apt install g++) or clang, or set CXX, or leave compile off."
            )
        return llama_forward.CompiledDecode(self.model, self._packed)

    # ---- public API ------------------------------------------------------------------------------------------

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.context_length:
            raise ContextOverflowError(self.context_length, prompt_tokens, max_tokens)

    async def stream(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """Yield token events for all ``params.n`` choices as they are produced."""
        async for event in self._events(prompt, params, whole=False):
            yield event

    async def _events(self, prompt: list[int], params: SamplingParams, *, whole: bool) -> AsyncIterator[TokenEvent]:
        """Token events of the request; with ``whole``, one per choice, when it finishes (see ``_Request``)."""
        if not prompt:
            raise ValueError("The prompt is empty.")
        self.check_fits(len(prompt), params.max_tokens)
        request = _Request(
            prompt=list(prompt), params=params, loop=asyncio.get_running_loop(), queue=asyncio.Queue(), whole=whole
        )
        with self._wake:
            if self._closed:
                raise EngineClosedError("The inference engine is closed: it accepts no new requests.")
            self._waiting.append(request)
            self._wake.notify()
        unfinished = params.n
        try:
            while unfinished:
                event = await request.queue.get()
                if isinstance(event, BaseException):
                    raise event
                if event.finish_reason is not None:
                    unfinished -= 1
                yield event
        finally:
            request.cancelled = True  # a client that went away stops costing compute

    async def generate(self, prompt: list[int], params: SamplingParams) -> list[Completion]:
        parts: list[dict] = [dict(text="", token_ids=[], logprobs=[], top=[], finish=None) for _ in range(params.n)]
        async for ev in self._events(prompt, params, whole=True):
            p = parts[ev.index]
            p["text"] += ev.text_delta
            p["token_ids"] += ev.token_ids
            p["logprobs"] += ev.logprobs
            p["top"] += ev.top_logprobs
            p["finish"] = ev.finish_reason or p["finish"]
        return [
            Completion(i, p["text"], p["token_ids"], p["logprobs"], p["top"], p["finish"]) for i, p in enumerate(parts)
        ]

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the model between engine steps (for a weight update); decoding resumes on exit. Cached
        prefixes were computed with the old weights, so they are dropped. With nothing decoding, the KV buffers
        are given back first, so that a training step's activations and the sampler's cache never add up. So are
        the packed copies of trainable weights: they will change, and are packed again on the next forward."""
        with self._model_lock:
            self.weights_generation += 1  # sequences decoding now carry KV of the old weights: never cached
            if not self._running:
                # released, not kept (SlotKVCache.empty): decoding attends over the whole capacity, and a kept one
                # would start the next phase at the last phase's longest length (costing more in attention than
                # the resizes it saves)
                self.cache.release()
            self._drop_derived_state()
            release_free_memory()  # what sampling held goes back to the OS before the update allocates
            try:
                yield
            finally:
                self._drop_derived_state()
                release_free_memory()  # the update's activations, before sampling grows its KV buffers

    def _drop_derived_state(self) -> None:
        """Forget what was computed from weights that may change (cached prefixes, packed trainable weights)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear(self.weights_generation)
        if self._packed is not None:
            self._packed.drop_trainable()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine's worker thread, between two decode steps, and return its result.

        Training steps run here rather than in a thread of their own: every thread that runs torch ops gets its
        own OpenMP team, and once a process has more OpenMP threads than cores, libgomp stops spinning between
        parallel regions. On 2 cores that made every decode step after the first training step slower."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._closed:
                raise EngineClosedError("The inference engine is closed: it runs no more calls.")
            self._calls.append((lambda: fn(*args), future))
            self._wake.notify()
        return await asyncio.wrap_future(future)

    def close(self, *, drain: bool = False, timeout: float = 10.0) -> None:
        """Stop the engine. New requests and calls get ``EngineClosedError`` from now on.

        By default, requests still waiting or decoding end at once with ``EngineClosedError``, calls not started
        too, and this returns when the worker has finished its current step (at most ``timeout`` seconds). With
        ``drain``, it returns at once: what was submitted before finishes, then the worker stops (an engine evicted
        while it serves). Either way the worker thaws the frozen objects (``freeze_objects``) as it stops."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            if drain:
                return
            self._stopped = True
            waiting, self._waiting = list(self._waiting), deque()
            calls, self._calls = self._calls, []
        self._fail(waiting, calls)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine's worker is still busy %.0f s after close(); it stops after its step", timeout)

    def _fail(self, requests: list[_Request], calls: list[tuple[Callable[[], Any], concurrent.futures.Future]]) -> None:
        """End unfinished requests and calls not started with ``EngineClosedError``."""
        message = "The inference engine was closed before this {} finished."
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosedError(message.format("call")))
        self._deliver([(req, EngineClosedError(message.format("request"))) for req in requests])

    # ---- worker thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        """The worker: serve until stopped (or closed and idle), then end whatever is left with
        ``EngineClosedError`` (a worker that died on an error ends it too, rather than leave requests waiting)."""
        try:
            if self._compiled is not None:
                self._warm_up()
            self._serve()
        finally:
            with self._wake:
                self._closed = self._stopped = True
                unfinished = {id(r): r for r in [*self._waiting, *(s.request for s in self._running)]}
                self._waiting = deque()
                calls, self._calls = self._calls, []
            self._running = []
            self._fail(list(unfinished.values()), calls)
            _open_engines.discard(self)
            thaw_objects()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._stopped or self._closed or self._waiting or self._running or self._calls):
                    self._wake.wait()
                if self._stopped or not (self._waiting or self._running or self._calls):
                    return  # stopped, or closed with drain and nothing left to do
                calls, self._calls = self._calls, []
                admitted = self._take_waiting()
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as exc:  # the caller gets it; the engine keeps serving
                        future.set_exception(exc)
            try:
                with self._model_lock, torch.inference_mode():
                    if admitted:
                        self._prefill(admitted)
                    if self._running:
                        self._decode()
            except Exception as exc:  # fail the affected requests, keep serving the others
                log.exception("engine step failed")
                for seq in self._running:
                    self._send(seq.request, exc)
                for req in admitted:
                    self._send(req, exc)
                self._running.clear()

    def _warm_up(self) -> None:
        """Compile the decode step before serving (requests wait meanwhile): for one row and for several, as
        torch.compile specialises a dimension of size 1. Scratch rows of the cache, released after; a capacity
        unlike the model's sizes (the shape tracer takes equal sizes for the same, and would compile again)."""
        start = time.perf_counter()
        log.info("compiling the decode step (~1-2 minutes on 2 cores; seconds with inductor's cache warm)")
        with self._model_lock, torch.inference_mode():
            for rows in (1, 2):
                self.cache.fit(rows, WINDOW_STEP * 3 - 1)
                lengths = torch.zeros(rows, dtype=torch.long, device=self.model.device)
                ids = torch.zeros(rows, 1, dtype=torch.long, device=self.model.device)
                self._decode_logits(ids, lengths, DecodeBatch(self.cache, lengths=lengths))
            self.cache.release()
        log.info("decode step compiled in %.0f s", time.perf_counter() - start)

    def _take_waiting(self) -> list[_Request]:
        """Requests to prefill now. One that shares a long prefix with a request taken in this round, beyond
        what the prefix cache holds, waits one step: it then reuses that prefix instead of recomputing it."""
        taken: list[_Request] = []
        deferred: list[_Request] = []
        rows, tokens = len(self._running), 0
        while self._waiting:
            req = self._waiting[0]
            if req.cancelled:
                self._waiting.popleft()
                continue
            if taken and (rows + req.params.n > self.max_batch or tokens + len(req.prompt) > self.max_prefill_tokens):
                break
            if not taken and rows + req.params.n > self.max_batch and self._running:
                break  # wait for rows to free up
            self._waiting.popleft()
            if self.prefix_cache is not None and taken:
                shared = max(common_prefix(req.prompt, t.prompt) for t in taken)
                if shared - self.prefix_cache.peek(req.prompt) >= 4 * MIN_REUSE:
                    deferred.append(req)
                    continue
            taken.append(req)
            rows += req.params.n
            tokens += len(req.prompt)
        self._waiting.extendleft(reversed(deferred))
        return taken

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, batch, keep: torch.Tensor | int
    ) -> torch.Tensor:
        if self._llama:
            return llama_forward.logits(self.model, input_ids, position_ids, batch, keep, self._packed)
        out = self.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep, kv_batch=batch
        )
        return out.logits

    def _decode_logits(self, ids: torch.Tensor, lengths: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        if self._compiled is not None:
            try:
                logits = self._compiled.logits(ids, lengths, batch)
            except Exception:  # a compiler or inductor failure costs speed, never the requests
                log.exception("the compiled decode step failed; decoding eagerly from now on")
                self._compiled = None
            else:
                if logits is not None:
                    return logits
        return self._forward(ids, lengths[:, None], batch, 1)

    def _prefill(self, requests: list[_Request]) -> None:
        device = self.model.device
        first_row = len(self._running)
        rows_needed = first_row + sum(r.params.n for r in requests)
        self.cache.fit(rows_needed, max([len(r.prompt) for r in requests] + [s.length + 1 for s in self._running]))
        rows, starts, seqs_per_request = [], [], []
        cached_logits: list[torch.Tensor | None] = []
        # A GRPO group sends the same prompt G times at once: each distinct prompt is prefilled once, and requests
        # repeating it copy its cache rows (as the n choices of one request do).
        first_with: dict[tuple[int, ...], int] = {}
        repeats: dict[int, int] = {}  # request -> the earlier request of this batch with the same prompt
        row = first_row
        for r, req in enumerate(requests):
            seqs = []
            for i in range(req.params.n):
                seed = req.params.seed
                gen = None
                if seed is not None:
                    gen = torch.Generator(device=device).manual_seed(seed + i)
                seq = _Sequence(index=i, request=req, generator=gen, row=row + i, length=len(req.prompt))
                seq.generation = self.weights_generation
                if req.params.guide is not None:
                    seq.matcher = req.params.guide.matcher()
                seqs.append(seq)
            seqs_per_request.append(seqs)
            reused, known = 0, None
            if (first := first_with.setdefault(tuple(req.prompt), r)) != r:
                repeats[r] = first
            elif self.prefix_cache is not None:
                cached_row, reused, known = self.prefix_cache.lookup(req.prompt)
                if reused:
                    self.prefix_cache.restore(cached_row, reused, self.cache, row)
            rows.append(row)
            starts.append(reused)
            cached_logits.append(known)
            row += req.params.n
        # prompts seen before in full need no forward at all (and give bit-identical results, seeds included)
        todo = [i for i, known in enumerate(cached_logits) if known is None and i not in repeats]
        logits: list[torch.Tensor | None] = list(cached_logits)
        if todo:
            lengths = [len(requests[i].prompt) - starts[i] for i in todo]
            ids = torch.tensor([t for i in todo for t in requests[i].prompt[starts[i] :]], device=device)[None]
            pos = torch.cat([torch.arange(starts[i], len(requests[i].prompt), device=device) for i in todo])[None]
            last = torch.tensor(list(itertools.accumulate(lengths)), device=device) - 1
            batch = PrefillBatch(
                self.cache, rows=[rows[i] for i in todo], starts=[starts[i] for i in todo], lengths=lengths
            )
            fresh = self._forward(ids, pos, batch, last)[0].float()  # [len(todo), V]
            for j, i in enumerate(todo):
                logits[i] = fresh[j]
                if self.prefix_cache is not None:
                    self.prefix_cache.insert(
                        requests[i].prompt, self.cache, rows[i], fresh[j], generation=self.weights_generation
                    )
        for r, first in repeats.items():
            logits[r] = logits[first]
            self.cache.copy_row(rows[first], rows[r], len(requests[r].prompt))
        for req, seqs, base_row in zip(requests, seqs_per_request, rows):
            for seq in seqs[1:]:
                self.cache.copy_row(base_row, seq.row, len(req.prompt))
        new = [s for seqs in seqs_per_request for s in seqs]
        row_logits = torch.cat([logits[i][None].expand(len(seqs), -1) for i, seqs in enumerate(seqs_per_request)])
        self._running.extend(new)
        self._accept(new, row_logits)

    def _decode(self) -> None:
        device = self.model.device
        seqs = self._running
        lengths = torch.tensor([s.length for s in seqs], device=device)
        self.cache.fit(len(seqs), max(s.length for s in seqs) + 1)
        ids = torch.tensor([s.output[-1] for s in seqs], device=device)[:, None]
        logits = self._decode_logits(ids, lengths, DecodeBatch(self.cache, lengths=lengths))[:, 0]
        for s in seqs:
            s.length += 1
        self._accept(list(seqs), logits)

    def _accept(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample the next token of each sequence, emit it, and retire finished sequences."""
        params = [s.request.params for s in seqs]
        constrain(logits, [s.matcher for s in seqs])
        drawn = sample(logits, params, [s.generator for s in seqs])
        outbox: list[tuple[_Request, TokenEvent]] = []
        for i, seq in enumerate(seqs):
            token = drawn.tokens[i]
            seq.output.append(token)
            p = seq.request.params
            if token in self.eos_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
            elif seq.matcher is not None and not seq.matcher.consume_token(token):
                log.warning("grammar refused token %d: %s", token, seq.matcher.get_error())
                seq.finish_reason = "stop"
            elif seq.decoded.update(self.tokenizer, seq.output, p.stop):
                seq.finish_reason = "stop"
            if seq.finish_reason is None and len(seq.output) >= p.max_tokens:
                seq.finish_reason = "length"
            delta = seq.decoded.delta(p.stop, finished=seq.finish_reason is not None)
            event = TokenEvent(
                index=seq.index,
                token_ids=[token],
                logprobs=[drawn.logprobs[i]],
                top_logprobs=[drawn.top[i]] if p.top_logprobs else [],
                text_delta=delta,
                finish_reason=seq.finish_reason,
            )
            if seq.request.whole:
                event = seq.held = event if seq.held is None else seq.held.extend(event)
                if event.finish_reason is None:
                    continue
            outbox.append((seq.request, event))
        self._deliver(outbox)
        self._retire()

    def _retire(self) -> None:
        """Drop finished or cancelled sequences; the highest rows move into the holes so rows stay 0..B-1."""
        keep = [s for s in self._running if s.finish_reason is None and not s.request.cancelled]
        if len(keep) == len(self._running):
            return
        if self.prefix_cache is not None:  # a finished turn is the prefix of the conversation's next prompt
            for s in self._running:
                # one whose KV began under older weights (a training step came while it decoded) is never reused
                if s.finish_reason is not None and s.index == 0 and s.generation == self.weights_generation:
                    tokens = s.request.prompt + s.output[: s.length - len(s.request.prompt)]
                    self.prefix_cache.insert(tokens, self.cache, s.row, generation=s.generation)
        holes = [s.row for s in self._running[: len(keep)] if s not in keep]
        movers = [s for s in self._running[len(keep) :] if s in keep]
        for hole, seq in zip(holes, movers):
            self.cache.copy_row(seq.row, hole, seq.length)
            seq.row = hole
        self._running = sorted(keep, key=lambda s: s.row)

    def _send(self, request: _Request, item: TokenEvent | BaseException) -> None:
        self._deliver([(request, item)])

    @staticmethod
    def _deliver(items: list[tuple[_Request, TokenEvent | BaseException]]) -> None:
        """One wake-up per event loop per step, not one per token: waking a loop thread for every token makes it
        fight the engine thread for the GIL, which costs more than the step itself."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, TokenEvent | BaseException]]] = {}
        for request, item in items:
            by_loop.setdefault(request.loop, []).append((request, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # its loop closed (nobody listens any more), maybe just now
                loop.call_soon_threadsafe(_put_all, batch)


_open_engines: weakref.WeakSet[InferenceEngine] = weakref.WeakSet()


@atexit.register
def close_open_engines() -> None:
    """At interpreter exit, close the engines a script left open (ART's examples never close their backend).

    Python finalizes with daemon threads still running: one inside a torch operator (which released the GIL) is
    ended by ``pthread_exit`` when it takes the GIL back, and that unwinding through torch's C++ frames calls
    ``std::terminate`` ("terminate called without an active exception", exit status 134). atexit hooks run before
    that, so the workers stop here, after their current step, and the process exits cleanly."""
    for engine in list(_open_engines):
        engine.close(timeout=EXIT_JOIN_SECONDS)

"""The gateway's side of a chat completion made in an episode: the prompt to feed (``prepare``) and the record of
what happened (``record``), written through the store."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from flywheel.gateway.redact import Redactor, default_redactor, redact_value
from flywheel.gateway.splice import Output, Splice, output_key, splice_prompt
from flywheel.store import CallRecord, EpisodeRecord, Store
from flywheel.store import episodes as db

CACHED_EPISODES = 4096  # open episodes whose outputs stay in memory (others are read back from the store)
REDACTED_SPLITS = frozenset({"production", "shadow"})  # whose calls are redacted by default: what users sent
WRITER_IDLE_S = 5.0  # the call writer's thread ends after this long with nothing to write


def without_choice_fields(response: dict[str, Any], *fields: str) -> dict[str, Any]:
    """A chat.completion (or chunk) whose choices lack ``fields``."""
    if "choices" not in response:
        return response
    return response | {"choices": [{k: v for k, v in c.items() if k not in fields} for c in response["choices"] or []]}


def without_token_ids(response: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion body without what would spell out its text token by token (ids, log-probs)."""
    return without_choice_fields(response, "token_ids", "prompt_token_ids", "logprobs")


def outputs_of(call: CallRecord, eos_ids: set[int]) -> list[Output]:
    """The outputs a recorded call returned, one per choice with token ids (none for an upstream's call: its ids
    are another tokenizer's, as far as the gateway knows)."""
    if call.upstream is not None:
        return []
    messages, tools = call.request.get("messages", []), call.request.get("tools")
    found = []
    for choice in call.response.get("choices", []):
        prompt, completion = choice.get("prompt_token_ids"), choice.get("token_ids")
        if prompt is None or not completion:
            continue
        reply = {"role": "assistant", **{k: v for k, v in choice["message"].items() if k in ("content", "tool_calls")}}
        found.append(
            Output(
                call.id,
                choice["index"],
                output_key(messages, tools, reply),
                prompt + completion,
                completion[-1] in eos_ids,
            )
        )
    return found


@dataclass
class _Pending:
    """A finished call waiting for the writer: what to store, and whom to answer once it is committed."""

    episode_id: str
    fields: dict[str, Any]
    eos_ids: set[int]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[CallRecord]


def _settle(results: list[tuple[asyncio.Future, CallRecord | BaseException]]) -> None:
    """On the waiting calls' event loop: each call's record or error (a call cancelled meanwhile is recorded all
    the same, and told nothing)."""
    for future, outcome in results:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


class Gateway:
    """Episodes in front of the engine: prepares each call's prompt from the episode's earlier outputs and
    records the call. Thread-safe; its store calls run off the event loop. Calls are recorded by one writer
    thread, which commits all those that finished together in one transaction (group commit) before any of them
    is answered: a burst of calls waits for one commit, not for one another's."""

    def __init__(
        self,
        store: Store,
        *,
        redactor: Redactor | None = default_redactor,
        redacted_splits: frozenset[str] | None = REDACTED_SPLITS,
    ):
        self.store = store
        self.redactor = redactor  # runs on what is stored, never on what is answered; None: store as is
        # The episodes it runs on: those of these splits (None: every episode), and every call asked under a
        # deployment's alias. Training and evaluation episodes (the training side's own tasks) are stored as
        # sampled: a redacted call loses its token ids, and an RL update on a run's own tasks needs them.
        self.redacted_splits = redacted_splits
        self._splits: OrderedDict[str, str] = OrderedDict()  # episode -> its split, for those this process read
        self.redactions: Counter[str] = Counter()  # what it replaced, by kind, since this gateway started
        self._outputs: OrderedDict[str, list[Output]] = OrderedDict()  # episode -> its outputs, most recent last
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []  # calls to record, in the order they finished
        self._queued = threading.Condition()  # guards _queue and _writer
        self._writer: threading.Thread | None = None  # runs while there are calls to write

    def redacts(self, split: str | None) -> bool:
        """Whether what is stored for an episode of ``split`` is redacted (an unknown split: it is)."""
        return self.redactor is not None and (
            self.redacted_splits is None or split is None or split in self.redacted_splits
        )

    def redact(self, value: Any, split: str | None = None) -> tuple[Any, int]:
        """``value`` as it may be stored for an episode of ``split`` (every string through the redactor, unless
        that split is stored as is) and how many things it replaced."""
        if self.redactor is None or not self.redacts(split):
            return value, 0
        redacted, found = redact_value(value, self.redactor)
        if found:
            with self._lock:
                self.redactions.update(found)
        return redacted, sum(found.values())

    def _note_split(self, episode: EpisodeRecord) -> None:
        with self._lock:
            self._splits[episode.id] = episode.split
            self._splits.move_to_end(episode.id)
            while len(self._splits) > CACHED_EPISODES:
                self._splits.popitem(last=False)

    def _split_of(self, episode_id: str) -> str | None:
        with self._lock:
            return self._splits.get(episode_id)

    def _redacted(self, fields: dict[str, Any], split: str | None) -> dict[str, Any]:
        """A call's columns as they may be stored in an episode of ``split``: request and response redacted (if
        that split's are, or the call was asked under a deployment's alias); a call in which something was
        redacted keeps no token ids or log-probs (they would spell it out) and is text-only."""
        if fields.get("deployment") is not None:
            split = None
        request, in_request = self.redact(fields["request"], split)
        response, in_response = self.redact(fields["response"], split)
        if not (in_request or in_response):
            return fields
        return fields | {"request": request, "response": without_token_ids(response), "text_only": True}

    def _cached(self, episode_id: str) -> list[Output] | None:
        """The outputs of an episode this process holds (open, recorded here), if it holds them."""
        with self._lock:
            cached = self._outputs.get(episode_id)
            if cached is None:
                return None
            self._outputs.move_to_end(episode_id)
            return list(cached)

    def _prepare(
        self,
        episode_id: str,
        messages: list[dict],
        tools: list[dict] | None,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: set[int],
    ) -> Splice:
        """``prepare`` for an episode this process does not hold: its outputs read back from the store, then held."""
        with self.store.session() as s:
            episode = db.check_open(s, episode_id)  # unknown: 404; finished or abandoned: 409, before sampling
            found = [o for call in db.calls(s, episode_id) for o in outputs_of(call, eos_ids)]
        self._note_split(episode)
        with self._lock:
            self._outputs[episode_id] = found
            while len(self._outputs) > CACHED_EPISODES:
                self._outputs.popitem(last=False)
        return splice_prompt(tokenizer, messages, tools, list(found))

    async def check_open(self, episode_id: str) -> None:
        """Raise unless calls may be recorded in the episode (unknown: ``UnknownEpisodeError``; closed:
        ``EpisodeConflictError``). An episode whose outputs this process holds is open as far as it knows (one
        closed meanwhile elsewhere is refused when its call is recorded, as ``prepare`` says)."""
        if self._cached(episode_id) is None:
            self._note_split(await self.store.run(db.check_open, episode_id))

    async def prepare(
        self,
        episode_id: str,
        messages: list[dict],
        tools: list[dict] | None,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: set[int],
    ) -> Splice:
        """The prompt for a call in an episode (an unknown one: ``UnknownEpisodeError``; a closed one:
        ``EpisodeConflictError``, before any token is sampled). An episode whose outputs this process holds (open,
        recorded here, not finished or abandoned here) is prepared on the event loop, with no thread hop and no
        query, so that its request reaches the engine as soon as a plain one would (a few milliseconds later, it
        would often miss the engine's next batch and wait a decode step). One closed meanwhile by another process
        (or by a lease's expiry) is refused when its call is recorded, after it ran."""
        if (cached := self._cached(episode_id)) is not None:
            return splice_prompt(tokenizer, messages, tools, cached)
        return await asyncio.to_thread(self._prepare, episode_id, messages, tools, tokenizer, eos_ids)

    async def record(
        self,
        episode_id: str,
        splice: Splice,
        eos_ids: set[int],
        *,
        model: str,
        step: int | None,
        request: dict[str, Any],
        response: dict[str, Any],
        latency_ms: float,
        text_only: bool = False,
        upstream: str | None = None,
        deployment: str | None = None,  # the alias it was asked as (calc@production), if any
    ) -> CallRecord:
        """Store a finished call. ``response``: the chat.completion body with every choice's token ids and
        log-probs (whatever the client asked to see); ``text_only``: it has no token ids (an upstream returned
        none); ``upstream``: where the call was answered, if not by the local engine. Returns once the call is
        committed (with those that finished with it), so that whoever is answered then finds it recorded; its
        episode unknown or closed meanwhile: ``UnknownEpisodeError`` or ``EpisodeConflictError`` for it alone."""
        usage = response.get("usage") or {}
        fields = dict(
            prefix_call=splice.prefix_call,
            prefix_choice=splice.prefix_choice,
            prefix_message=splice.prefix_message,
            retokenized_turns=splice.retokenized_turns,
            reward=None,
            model=model,
            step=step,
            request=request,
            response=response,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            latency_ms=latency_ms,
            text_only=text_only,
            upstream=upstream,
            deployment=deployment,
        )
        loop = asyncio.get_running_loop()
        pending = _Pending(episode_id, fields, eos_ids, loop, loop.create_future())
        with self._queued:
            self._queue.append(pending)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="flywheel-call-writer", daemon=True)
                self._writer.start()
            self._queued.notify()
        return await pending.future

    def _write(self) -> None:
        """The writer thread: commits what is queued, one transaction per batch, until nothing came for
        ``WRITER_IDLE_S`` seconds."""
        while True:
            with self._queued:
                if not self._queue:
                    self._queued.wait(WRITER_IDLE_S)
                if not self._queue:
                    self._writer = None  # the next call starts another
                    return
                batch, self._queue = self._queue, []
            settled: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, CallRecord | BaseException]]] = {}
            splits = self._splits_of(batch)
            for p in batch:  # here, not on the event loop: it reads every string of the call
                p.fields = self._redacted(p.fields, splits.get(p.episode_id))
            for p, outcome in zip(batch, self._commit(batch), strict=True):
                settled.setdefault(p.loop, []).append((p.future, self._hold(p, outcome)))
            for loop, results in settled.items():  # one wake-up per event loop per batch
                try:
                    loop.call_soon_threadsafe(_settle, results)
                except RuntimeError:  # that loop is closed: nobody waits for these answers any more
                    pass

    def _splits_of(self, batch: list[_Pending]) -> dict[str, str]:
        """The splits of a batch's episodes: as this process read them when it prepared their calls, else (an
        episode it forgot meanwhile) from the store; one it cannot read is left out (and its calls redacted)."""
        splits = {p.episode_id: split for p in batch if (split := self._split_of(p.episode_id)) is not None}
        unknown = {p.episode_id for p in batch} - splits.keys()
        if unknown and self.redactor is not None:
            try:
                with self.store.session() as s:
                    splits |= db.splits_of(s, unknown)
            except Exception:  # the store unreachable: the commit that follows says so, call by call
                pass
        return splits

    def _hold(self, p: _Pending, outcome: CallRecord | BaseException) -> CallRecord | BaseException:
        """Add a recorded call's outputs to its episode's, if this process holds them (before the call is answered:
        the episode's next call is spliced onto them)."""
        if not isinstance(outcome, CallRecord):
            return outcome
        try:
            outputs = outputs_of(outcome, p.eos_ids)
        except Exception as exc:  # a body with no readable choices: recorded, but its answer says so
            return exc
        with self._lock:
            if p.episode_id in self._outputs:
                self._outputs[p.episode_id] += outputs
        return outcome

    def _commit(self, batch: list[_Pending]) -> list[CallRecord | BaseException]:
        """Write a batch of calls in one transaction; if it fails as a whole, each call alone (so that one call's
        failure is that call's only)."""
        try:
            with self.store.session() as s:
                return list(db.add_calls(s, [(p.episode_id, p.fields) for p in batch]))
        except Exception as exc:
            if len(batch) == 1:
                return [exc]
            return [outcome for p in batch for outcome in self._commit([p])]

    def forget(self, episode: EpisodeRecord) -> None:
        """Drop a closed episode's outputs from memory."""
        with self._lock:
            self._outputs.pop(episode.id, None)

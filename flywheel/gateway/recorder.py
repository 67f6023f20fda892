"""The gateway's side of a chat completion made in an episode: the prompt to feed (``prepare``) and the record of
what happened (``record``), written through the store behind the answer (write-behind).

A call is answered once it is queued for the writer thread, which commits queued calls in batches. What reads or
changes an episode waits for its calls first (``settled``): those being generated (from ``prepare`` until
``record``, or until the request ends without one) and those queued; its next call's prompt is spliced onto its
outputs in memory (named by a provisional id that the writer turns into the committed one), its outcome and its
exports wait, and so does the server's shutdown (``drain``). A call that cannot be written after its answer left
is a lost call: its open episode is abandoned with the reason (``store.episodes.lose_call``: it never trains, its
finish is a 409 naming the call) and counted. A call whose episode was closed before it could be written (by
another process, or a lease's expiry) is a late call: counted and dropped, the episode's outcome stands.

The database may go away for a while (a restart, a failover): a write that fails on its side is retried with
backoff for ``WriteLimits.retry_s``, and only then are its calls lost; a lost call that cannot be marked in the
store then is marked once it answers again (this process refuses the episode meanwhile). What the gateway holds is
bounded (``max_queued`` calls being generated or queued: one more is a 503 with Retry-After, before it runs), and
so is every wait for it (``wait_s``: a 503; the shutdown's ``drain``: ``retry_s`` + ``wait_s``, then what it could
not write is logged).

A gateway killed between an answer and its commit loses the calls answered in that window (one batch: a few
milliseconds of traffic). The agent's next call, to a restarted gateway, re-sends those replies as history; they
match no recorded output, so they are fed as re-tokenized context and counted as such (``retokenized_turns``),
like a reply the agent edited: the episode trains on the actions that were recorded. Replicas of the gateway on
one database must route each episode's calls to one replica (the episode id is in the path), or answer after the
commit (``write_behind=False``, ``flywheel serve --no-write-behind``): a replica that reads an episode while
another still holds its last call queued would splice around it, and an outcome posted to it would close the
episode before that call lands (a lost call).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections import Counter, OrderedDict
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from transformers import PreTrainedTokenizerBase

from flywheel.gateway.redact import Redactor, default_redactor, redact_value
from flywheel.gateway.splice import Output, Splice, output_key, splice_prompt
from flywheel.store import CallRecord, EpisodeConflictError, EpisodeRecord, Store, episodes
from flywheel.store.costs import Prices
from flywheel.types import TOKENIZER

CACHED_EPISODES = 4096  # open episodes whose outputs stay in memory (others are read back from the store)
REDACTED_SPLITS = frozenset({"production", "shadow"})  # whose calls are redacted by default: what users sent
WRITER_IDLE_S = 5.0  # the call writer's thread ends after this long with nothing to write
COMMITTED_IDS = 65536  # provisional -> committed ids kept, for splices prepared before their prefix's commit
# SQLite's errors that pass: locked or busy, the file not openable or full for now, an I/O error
SQLITE_TRANSIENT = frozenset(
    {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR}
)
RETRY_PAUSE_S = (0.05, 2.0)  # the writer's first pause after a failed write, and its longest (doubling between)
log = logging.getLogger(__name__)
N = TypeVar("N", int, float)


@dataclass(frozen=True)
class WriteLimits:
    """How long write-behind keeps trying and how much it holds. A write that fails on the database's side (a
    disconnect, a server restarting, a lock not granted: ``transient``) is retried with backoff for up to
    ``retry_s`` seconds before its calls are lost; at most ``max_queued`` calls are queued or being generated at
    once (one more is refused before it runs: a 503 with Retry-After); what waits for an episode's calls (its
    outcome, its reads) gives up after ``wait_s`` seconds (a 503 with Retry-After), the server's shutdown after
    ``retry_s`` + ``wait_s``. ``from_env``: ``FLYWHEEL_WRITE_RETRY_S``, ``FLYWHEEL_WRITE_MAX_QUEUED``,
    ``FLYWHEEL_WRITE_WAIT_S``."""

    retry_s: float = 30.0
    max_queued: int = 10_000
    wait_s: float = 60.0

    def __post_init__(self) -> None:
        if not (self.retry_s >= 0 and self.wait_s > 0 and self.max_queued >= 1):
            raise ValueError(
                f"write limits {self}: retry_s must be >= 0, wait_s > 0 (seconds) and max_queued >= 1 (calls)"
            )

    @classmethod
    def from_env(cls) -> WriteLimits:
        """The defaults, each overridden by its environment variable if set."""
        return cls(
            retry_s=_env_number("FLYWHEEL_WRITE_RETRY_S", float, cls.retry_s),
            max_queued=_env_number("FLYWHEEL_WRITE_MAX_QUEUED", int, cls.max_queued),
            wait_s=_env_number("FLYWHEEL_WRITE_WAIT_S", float, cls.wait_s),
        )


def _env_number(variable: str, kind: type[N], default: N) -> N:
    """The number in environment variable ``variable`` (``default`` if unset); not a number: a ``ValueError``."""
    value = os.environ.get(variable)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{variable} was {value!r}; it must be a number ({kind.__name__})") from None


class GatewayBusyError(RuntimeError):
    """The gateway cannot take or settle a call now: too many calls queued for writing, or an episode's calls not
    written in time (the database is not answering). A 503; ``retry_after``: seconds to wait before trying again."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


def transient(exc: BaseException) -> bool:
    """Whether a failed write may succeed if tried again: the database unreachable or restarting, a connection
    dropped, a lock or a pooled connection not granted in time (not a value the database refuses, nor a bug).
    SQLite says which by its error code: its ``OperationalError`` also means a missing table or a bad query."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(orig := getattr(exc, "orig", None), sqlite3.Error) and orig.sqlite_errorcode is not None:
        return orig.sqlite_errorcode & 0xFF in SQLITE_TRANSIENT
    return isinstance(exc, OperationalError | InterfaceError | PoolTimeoutError)


def without_choice_fields(response: dict[str, Any], *fields: str) -> dict[str, Any]:
    """A chat.completion (or chunk) whose choices lack ``fields``."""
    if "choices" not in response:
        return response
    return response | {"choices": [{k: v for k, v in c.items() if k not in fields} for c in response["choices"] or []]}


def without_token_ids(response: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion body without what would spell out its text token by token (ids, log-probs)."""
    return without_choice_fields(response, "token_ids", "prompt_token_ids", "logprobs")


def _reply(choice: dict[str, Any]) -> dict[str, Any]:
    """A choice's message as the agent re-sends it: an assistant message with its content and tool calls."""
    return {"role": "assistant", **{k: v for k, v in choice["message"].items() if k in ("content", "tool_calls")}}


def _outputs(
    call_id: int, request: dict[str, Any], response: dict[str, Any], upstream: str | None, eos_ids: set[int]
) -> list[Output]:
    if upstream is not None:
        return []
    messages, tools = request.get("messages", []), request.get("tools")
    found = []
    for choice in response.get("choices", []):
        prompt, completion = choice.get("prompt_token_ids"), choice.get("token_ids")
        if prompt is None or not completion:
            continue
        key = output_key(messages, tools, _reply(choice))
        ended = completion[-1] in eos_ids
        found.append(Output(call_id, choice["index"], key, prompt + completion, ended, choice.get(TOKENIZER)))
    return found


def outputs_of(call: CallRecord, eos_ids: set[int]) -> list[Output]:
    """The outputs a recorded call returned, one per choice with token ids (none for an upstream's call: its ids
    are another tokenizer's, as far as the gateway knows)."""
    return _outputs(call.id, call.request, call.response, call.upstream, eos_ids)


@dataclass
class _Pending:
    """A call queued for the writer: what to store, and its outcome once committed (or refused)."""

    episode_id: str
    ticket: int  # its provisional id is -ticket: what a splice on its outputs names it by until it is committed
    fields: dict[str, Any]
    eos_ids: set[int]
    held: bool  # its outputs joined its episode's when it was queued (else, redacted maybe: once committed)
    done: Future[CallRecord | BaseException]


def _parts(batch: list[_Pending]) -> list[list[_Pending]]:
    """A batch cut before each call that continues an output of a call before it in the same part (its prefix's
    id is known only once that part is inserted)."""
    parts: list[list[_Pending]] = [[]]
    tickets: set[int] = set()
    for p in batch:
        prefix = p.fields["prefix_call"]
        if prefix is not None and -prefix in tickets:
            parts.append([])
            tickets = set()
        parts[-1].append(p)
        tickets.add(p.ticket)
    return parts


class Gateway:
    """Episodes in front of the engine: prepares each call's prompt from the episode's earlier outputs and
    records the call. Thread-safe; its store calls run off the event loop. Calls are recorded by one writer
    thread, which commits all those queued together in one transaction (group commit), behind their answers (see
    the module doc): what reads or changes an episode awaits ``settled`` first."""

    def __init__(
        self,
        store: Store,
        *,
        redactor: Redactor | None = default_redactor,
        redacted_splits: frozenset[str] | None = REDACTED_SPLITS,
        write_behind: bool = True,
        prices: Prices | None = None,
        limits: WriteLimits | None = None,
    ):
        self.store = store
        self.limits = limits or WriteLimits.from_env()
        self.prices = prices or Prices.from_env()  # what the episode API prices calls at (store/costs.py)
        # answer a call once it is queued for the writer (True), or once it is committed (False: for gateway
        # replicas on one database that do not route an episode's calls to one replica, see the module doc)
        self.write_behind = write_behind
        self.redactor = redactor  # runs on what is stored, never on what is answered; None: store as is
        # The episodes it runs on: those of these splits (None: every episode), and every call asked under a
        # deployment's alias. Training and evaluation episodes (the training side's own tasks) are stored as
        # sampled: a redacted call loses its token ids, and an RL update on a run's own tasks needs them.
        self.redacted_splits = redacted_splits
        self._splits: OrderedDict[str, str] = OrderedDict()  # episode -> its split, for those this process read
        self.redactions: Counter[str] = Counter()  # what it replaced, by kind, since this gateway started
        self.recorded_calls = self.redacted_calls = 0  # calls it wrote (or tried to), those of them it redacted
        self._outputs: OrderedDict[str, list[Output]] = OrderedDict()  # episode -> its outputs, most recent last
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []  # calls to record, in the order they finished
        self._queued = threading.Condition()  # guards _queue, _unsettled and _writer
        self._unsettled: dict[str, list[_Pending]] = {}  # episode -> its queued calls, until committed or lost
        self._writer: threading.Thread | None = None  # runs while there are calls to write
        self._tickets = itertools.count(1)
        self._committed: OrderedDict[int, int] = OrderedDict()  # ticket -> the call's id, for splices on it
        self._lost: OrderedDict[str, str] = OrderedDict()  # episode -> why it lost a call, for those lost here
        self.lost_calls = 0  # calls answered and never recorded, since this gateway started
        self.late_calls = 0  # calls answered after their episode closed (elsewhere), dropped, since it started
        # calls being generated: episode -> each one's future, done once it is queued for the writer (or dropped);
        # and the way to end each, by its Splice's id (``prepare`` starts one, ``record`` ends it)
        self._generating: dict[str, set[Future[None]]] = {}
        self._landings: dict[int, weakref.finalize] = {}
        self._held = 0  # calls being generated or queued, until written or lost: at most limits.max_queued
        self._unmarked: OrderedDict[str, list[str]] = OrderedDict()  # lost calls not yet marked in the store
        self._marking = threading.Lock()  # one marks them at a time (the writer, or the shutdown's drain)

    def redacts(self, split: str | None) -> bool:
        """Whether what is stored for an episode of ``split`` is redacted (an unknown split: it is)."""
        return self.redactor is not None and (
            self.redacted_splits is None or split is None or split in self.redacted_splits
        )

    def redact(self, value: Any, split: str | None = None) -> tuple[Any, int]:
        """``value`` as it may be stored for an episode of ``split`` (every string through the redactor, unless
        that split is stored as is) and how many things it replaced."""
        if not self.redacts(split):
            return value, 0
        redacted, found = redact_value(value, self.redactor)
        if found:
            with self._lock:
                self.redactions.update(found)
        return redacted, sum(found.values())

    def _note_split(self, episode: EpisodeRecord) -> None:
        with self._lock:
            _remember(self._splits, episode.id, episode.split)

    def split_of(self, episode_id: str) -> str | None:
        """The split of an episode this process prepared a call of (None: not known here)."""
        with self._lock:
            return self._splits.get(episode_id)

    def _redacted(self, fields: dict[str, Any], split: str | None) -> dict[str, Any]:
        """A call's columns as they may be stored in an episode of ``split``: request and response redacted (if
        that split's are, or the call was asked under a deployment's alias); a call in which something was
        redacted keeps no token ids or log-probs (they would spell it out) and is text-only."""
        split = _call_split(split, fields["deployment"])
        request, in_request = self.redact(fields["request"], split)
        response, in_response = self.redact(fields["response"], split)
        with self._lock:
            self.recorded_calls += 1
            self.redacted_calls += bool(in_request or in_response)
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
            episode = episodes.check_open(s, episode_id)  # unknown: 404; finished or abandoned: 409, before sampling
            calls = episodes.calls(s, episode_id)
        self._note_split(episode)
        found = [o for call in calls for o in outputs_of(call, eos_ids)]
        with self._lock:
            found = self._outputs.setdefault(episode_id, found)  # or what a call prepared meanwhile put there
            while len(self._outputs) > CACHED_EPISODES:
                self._outputs.popitem(last=False)
            found = list(found)
        return splice_prompt(tokenizer, messages, tools, found)

    async def check_open(self, episode_id: str) -> None:
        """Raise unless calls may be recorded in the episode (unknown: ``UnknownEpisodeError``; closed:
        ``EpisodeConflictError``). An episode whose outputs this process holds is open as far as it knows (one
        closed meanwhile elsewhere is refused when its call is recorded, as ``prepare`` says)."""
        self.refuse_lost(episode_id)
        self._admit()
        if self._cached(episode_id) is None:
            self._note_split(await self.store.run(episodes.check_open, episode_id))

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
        would often miss the engine's next batch and wait a decode step); its calls still queued are in it (those
        of an episode whose calls may be redacted join it once committed: it waits for them). One closed meanwhile
        by another process (or by a lease's expiry) is a late call when the call is written, after it ran. With
        ``limits.max_queued`` calls held already: ``GatewayBusyError``, before it runs."""
        self.refuse_lost(episode_id)
        self._admit()
        with self._queued:
            redacting = any(not p.held for p in self._unsettled.get(episode_id, ()))
        if redacting:
            await self._written(episode_id)
        if (cached := self._cached(episode_id)) is not None:
            return self._take_off(episode_id, splice_prompt(tokenizer, messages, tools, cached))
        await self._written(episode_id)  # forgotten meanwhile (LRU): its queued calls first, then the store
        splice = await asyncio.to_thread(self._prepare, episode_id, messages, tools, tokenizer, eos_ids)
        return self._take_off(episode_id, splice)

    def _admit(self) -> None:
        """Refuse a call while ``limits.max_queued`` calls are being generated or queued for writing (the database
        is slower than the traffic, or not answering): the queue stays bounded and the agent is told to retry."""
        with self._queued:
            held = self._held
        if held >= self.limits.max_queued:
            raise GatewayBusyError(
                f"The gateway holds {held} calls not yet written to its store (at most {self.limits.max_queued}):"
                " retry shortly.",
                retry_after=max(1, round(min(self.limits.retry_s, 5.0))),
            )

    def _take_off(self, episode_id: str, splice: Splice) -> Splice:
        """Count the call that ``splice`` is the prompt of as being generated, until ``record`` queues it or the
        Splice is dropped unrecorded (its request failed, its client went away): what closes its episode waits."""
        flight: Future[None] = Future()
        flight.set_running_or_notify_cancel()
        with self._queued:
            self._generating.setdefault(episode_id, set()).add(flight)
            self._held += 1
            self._landings[id(splice)] = weakref.finalize(splice, self._land, id(splice), episode_id, flight)
        return splice

    def _land(self, key: int, episode_id: str, flight: Future[None]) -> None:
        """A call is no longer being generated (recorded, or its Splice dropped): whoever waits for it is told."""
        with self._queued:
            self._landings.pop(key, None)
            flying = self._generating.get(episode_id, set())
            if flight in flying:
                flying.discard(flight)
                self._held -= 1
            if not flying:
                self._generating.pop(episode_id, None)
        flight.set_result(None)

    async def settled(self, episode_id: str | None = None, *, generating: bool = True) -> None:
        """Wait until an episode's calls are committed or lost: those being generated now (unless not
        ``generating``: a lease's heartbeat) and those queued. None: the calls queued so far in any episode. After
        ``limits.wait_s`` seconds: ``GatewayBusyError`` (the calls go on being written)."""
        try:
            async with asyncio.timeout(self.limits.wait_s):
                if episode_id is not None and generating:
                    with self._queued:
                        flying = list(self._generating.get(episode_id, ()))
                    if flying:  # each queued by now, or dropped
                        await asyncio.gather(*(asyncio.wrap_future(f) for f in flying))
                await self._written(episode_id)
        except TimeoutError:
            which = f"episode {episode_id!r}'s calls" if episode_id is not None else "the calls queued"
            raise GatewayBusyError(
                f"Waited {self.limits.wait_s:g} s for {which} to be written to the store (the database is slow or"
                " not answering): retry shortly; nothing was changed.",
                retry_after=max(1, round(min(self.limits.retry_s, 5.0))),
            ) from None

    async def _written(self, episode_id: str | None = None) -> None:
        """Wait until the calls queued so far in an episode (None: in any) are committed or lost."""
        with self._queued:
            queued = self._unsettled.values() if episode_id is None else [self._unsettled.get(episode_id, [])]
            waiting = [p.done for pending in queued for p in pending]
        if waiting:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in waiting))  # each holds its outcome, never raises

    def drain(self) -> None:
        """Wait until every call queued so far is committed or lost, and lost calls are marked in the store (before
        the server exits), for at most ``limits.retry_s`` + ``limits.wait_s`` seconds; what is left then is logged
        (the calls are answered and not in the store: the module doc's gateway killed before its commit)."""
        with self._queued:
            waiting = [p.done for pending in self._unsettled.values() for p in pending]
        _, left = wait_all(waiting, timeout=self.limits.retry_s + self.limits.wait_s)
        self._mark_lost()
        with self._queued:
            unmarked = sum(len(reasons) for reasons in self._unmarked.values())
        if left or unmarked:
            log.error(
                "The gateway stops with %d calls answered and not written to its store, and %d lost calls not"
                " marked there (the database did not answer): their episodes are open in the store",
                len(left),
                unmarked,
            )

    def refuse_lost(self, episode_id: str) -> None:
        """Raise ``EpisodeConflictError`` if the episode lost a call in this process (the store is told too, when
        it can be: then it refuses the episode's outcome itself)."""
        with self._lock:
            reason = self._lost.get(episode_id)
        if reason is not None:
            raise EpisodeConflictError(f"Episode {episode_id!r} lost a call: {reason}. It is abandoned.")

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
    ) -> None:
        """Queue a finished call for the writer. ``response``: the chat.completion body with every choice's token
        ids and log-probs (whatever the client asked to see); ``text_only``: it has no token ids (an upstream
        returned none); ``upstream``: where the call was answered, if not by the local engine. With write-behind,
        returns once it is queued, its outputs in its episode's for the next call's prompt: its agent may be
        answered, the writer commits it behind the answer (one that fails then is a lost call, see the module doc).
        Without, returns once committed: its episode unknown or closed meanwhile: ``UnknownEpisodeError`` or
        ``EpisodeConflictError``."""
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
        ticket = next(self._tickets)
        outputs = _outputs(-ticket, request, response, upstream, eos_ids)  # a body it cannot read: nothing queued
        held = not self.redacts(_call_split(self.split_of(episode_id), deployment))  # stored as is
        pending = _Pending(episode_id, ticket, fields, eos_ids, held, Future())
        pending.done.set_running_or_notify_cancel()  # a waiter cancelled (its client gone) cannot cancel it for all
        with self._queued:
            self._queue.append(pending)
            self._unsettled.setdefault(episode_id, []).append(pending)
            self._held += 1
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="flywheel-call-writer", daemon=True)
                self._writer.start()
            self._queued.notify()
        with self._queued:
            landing = self._landings.get(id(splice))
        if landing is not None:
            landing()  # it was being generated: now it is queued
        if held:
            with self._lock:
                if episode_id in self._outputs:
                    self._outputs[episode_id] += outputs
        if self.write_behind:  # answered before its commit (else after it, with its error if it fails)
            return
        outcome = await asyncio.wrap_future(pending.done)
        if isinstance(outcome, BaseException):
            raise outcome

    def _write(self) -> None:
        """The writer thread: commits what is queued, one transaction per batch, and marks lost calls in the store
        (retried with backoff while it does not answer), until nothing came for ``WRITER_IDLE_S`` seconds and
        every lost call is marked."""
        pause = RETRY_PAUSE_S[0]
        while True:
            with self._queued:
                if not self._queue:
                    self._queued.wait(pause if self._unmarked else WRITER_IDLE_S)
                if not self._queue and not self._unmarked:
                    self._writer = None  # the next call starts another
                    return
                batch, self._queue = self._queue, []
            if not batch:  # only lost calls to mark: try again, a little later each time
                pause = RETRY_PAUSE_S[0] if self._mark_lost() else min(pause * 2, RETRY_PAUSE_S[1])
                continue
            try:
                splits = self._splits_of(batch)
                for p in batch:  # here, not on the event loop: it reads every string of the call
                    p.fields = self._redacted(p.fields, splits.get(p.episode_id))
                outcomes = self._commit(batch)
            except Exception as exc:  # a bug (the store's errors are each call's outcome): lost, not quietly
                outcomes = [exc] * len(batch)
            for p, outcome in zip(batch, outcomes, strict=True):
                self._settle(p, outcome)
            self._mark_lost()  # before anyone waiting is told: a wait that ends sees its episode's lost call marked
            for p, outcome in zip(batch, outcomes, strict=True):
                self._release(p, outcome)

    def _settle(self, p: _Pending, outcome: CallRecord | BaseException) -> None:
        """A call's outcome: its outputs given their committed id (or, not held yet, added); if it failed after
        its answer, its episode loses it (``_release`` then tells whoever waits for it)."""
        if isinstance(outcome, CallRecord):
            with self._lock:
                held = self._outputs.get(p.episode_id)
                if held is not None and p.held:
                    self._outputs[p.episode_id] = [
                        replace(o, call_id=outcome.id) if o.call_id == -p.ticket else o for o in held
                    ]
                elif held is not None:
                    held += outputs_of(outcome, p.eos_ids)
        elif self.write_behind and isinstance(outcome, EpisodeConflictError):  # closed before it was written
            with self._lock:
                self.late_calls += 1  # dropped: the episode's outcome (finished, or abandoned) stands
        elif self.write_behind:
            call = p.fields["response"].get("id", f"#{p.ticket}")
            self._lose(p.episode_id, f"call {call} was answered, then could not be recorded ({outcome})")

    def _release(self, p: _Pending, outcome: CallRecord | BaseException) -> None:
        """The call is settled: whoever waits for it (its request, its episode's ``settled``) is told."""
        with self._queued:
            pending = self._unsettled.get(p.episode_id, [])
            pending.remove(p)
            if not pending:
                self._unsettled.pop(p.episode_id, None)
            self._held -= 1
        p.done.set_result(outcome)

    def _lose(self, episode_id: str, reason: str) -> None:
        """An episode lost a call (answered, not in the store): counted, refused here, to be marked in the store
        (abandoned there: ``_mark_lost``)."""
        with self._lock:
            self.lost_calls += 1
            _remember(self._lost, episode_id, reason)
            self._outputs.pop(episode_id, None)
        with self._queued:
            self._unmarked.setdefault(episode_id, []).append(reason)

    @property
    def unmarked_calls(self) -> int:
        """Lost calls not yet marked in the store (it did not answer): their episodes look open there."""
        with self._queued:
            return sum(len(reasons) for reasons in self._unmarked.values())

    def _mark_lost(self) -> bool:
        """Mark the lost calls not yet marked in the store (``store.episodes.lose_call``), oldest first; stop at
        the first that the store cannot take now (kept for the writer's next try). An episode the store no longer
        has is logged and dropped. Whether every one is marked now."""
        with self._marking:
            return self._mark_each()

    def _mark_each(self) -> bool:
        while True:
            with self._queued:
                if not self._unmarked:
                    return True
                episode_id, reasons = next(iter(self._unmarked.items()))
                reason = reasons[0]
            try:
                with self.store.session() as s:
                    episodes.lose_call(s, episode_id, reason)
            except Exception as exc:
                if transient(exc):
                    log.warning(
                        "Cannot mark a lost call of episode %s in the store yet (%s): will retry", episode_id, exc
                    )
                    return False
                log.error("Cannot mark a lost call of episode %s in the store (%s): dropped", episode_id, exc)
            with self._queued:
                reasons.pop(0)
                if not reasons:
                    self._unmarked.pop(episode_id, None)

    def _splits_of(self, batch: list[_Pending]) -> dict[str, str]:
        """The splits of a batch's episodes: as this process read them when it prepared their calls, else (an
        episode it forgot meanwhile) from the store; one it cannot read is left out (and its calls redacted)."""
        splits = {p.episode_id: split for p in batch if (split := self.split_of(p.episode_id)) is not None}
        unknown = {p.episode_id for p in batch} - splits.keys()
        if unknown and self.redactor is not None:
            try:
                with self.store.session() as s:
                    splits |= episodes.splits_of(s, unknown)
            except Exception:  # the store unreachable: the commit that follows says so, call by call
                pass
        return splits

    def _resolved(self, fields: dict[str, Any], ids: dict[int, int]) -> dict[str, Any]:
        """A call's columns with its prefix's committed id (``ids``: those of this transaction): a provisional one
        (negative) names a call queued before it; one that was lost (or committed too long ago) is no prefix."""
        prefix = fields["prefix_call"]
        if prefix is None or prefix >= 0:
            return fields
        with self._lock:
            found = ids.get(-prefix, self._committed.get(-prefix))
        if found is None:
            return fields | {"prefix_call": None, "prefix_choice": None, "prefix_message": None}
        return fields | {"prefix_call": found}

    def _commit(self, batch: list[_Pending], deadline: float | None = None) -> list[CallRecord | BaseException]:
        """Write a batch of calls in one transaction, tried again with backoff while the database fails on its side
        (``transient``) until ``deadline`` (``limits.retry_s`` from now); if it fails otherwise, each call alone (so
        that one call's failure is that call's only)."""
        deadline = time.monotonic() + self.limits.retry_s if deadline is None else deadline
        pause = RETRY_PAUSE_S[0]
        while True:
            try:
                return self._commit_once(batch)
            except Exception as exc:
                if not transient(exc):
                    if len(batch) == 1:
                        return [exc]
                    return [outcome for p in batch for outcome in self._commit([p], deadline)]
                if time.monotonic() + pause > deadline:
                    log.error("Gave up writing %d calls after %.0f s: %s", len(batch), self.limits.retry_s, exc)
                    return [exc] * len(batch)
                log.warning("Writing %d calls failed (%s): retrying in %.2f s", len(batch), exc, pause)
            time.sleep(pause)
            pause = min(pause * 2, RETRY_PAUSE_S[1])

    def _commit_once(self, batch: list[_Pending]) -> list[CallRecord | BaseException]:
        ids: dict[int, int] = {}
        with self.store.session() as s:
            outcomes: list[CallRecord | BaseException] = []
            for part in _parts(batch):
                rows = [(p.episode_id, self._resolved(p.fields, ids)) for p in part]
                for p, outcome in zip(part, episodes.add_calls(s, rows), strict=True):
                    if isinstance(outcome, CallRecord):
                        ids[p.ticket] = outcome.id
                    outcomes.append(outcome)
        with self._lock:
            for ticket, call_id in ids.items():
                _remember(self._committed, ticket, call_id, COMMITTED_IDS)
        return outcomes

    def forget(self, episode: EpisodeRecord) -> None:
        """Drop a closed episode's outputs from memory."""
        with self._lock:
            self._outputs.pop(episode.id, None)


def _call_split(split: str | None, deployment: str | None) -> str | None:
    """The split a call is redacted as: its episode's, or none known (so: redacted) for one asked under an alias."""
    return None if deployment is not None else split


def _remember(cache: OrderedDict, key: Any, value: Any, size: int = CACHED_EPISODES) -> None:
    """Put ``key`` in a bounded cache, most recent last (the oldest go first)."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)

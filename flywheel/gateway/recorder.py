"""The gateway's side of a chat completion made in an episode: the prompt to feed (``prepare``) and the record of
what happened (``record``), written through the store."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Any

from transformers import PreTrainedTokenizerBase

from flywheel.gateway.splice import Output, Splice, output_key, splice_prompt
from flywheel.store import CallRecord, EpisodeRecord, Store
from flywheel.store import episodes as db

CACHED_EPISODES = 4096  # open episodes whose outputs stay in memory (others are read back from the store)


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


class Gateway:
    """Episodes in front of the engine: prepares each call's prompt from the episode's earlier outputs and
    records the call. Thread-safe; its store calls run off the event loop."""

    def __init__(self, store: Store):
        self.store = store
        self._outputs: OrderedDict[str, list[Output]] = OrderedDict()  # episode -> its outputs, most recent last
        self._lock = threading.Lock()

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
            db.check_open(s, episode_id)  # unknown: 404; finished or abandoned: 409, before any token is sampled
            found = [o for call in db.calls(s, episode_id) for o in outputs_of(call, eos_ids)]
        with self._lock:
            self._outputs[episode_id] = found
            while len(self._outputs) > CACHED_EPISODES:
                self._outputs.popitem(last=False)
        return splice_prompt(tokenizer, messages, tools, list(found))

    async def check_open(self, episode_id: str) -> None:
        """Raise unless calls may be recorded in the episode (unknown: ``UnknownEpisodeError``; closed:
        ``EpisodeConflictError``)."""
        await self.store.run(db.check_open, episode_id)

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

    def _record(self, episode_id: str, splice: Splice, eos_ids: set[int], **fields: Any) -> CallRecord:
        with self.store.session() as s:
            call = db.add_call(
                s,
                episode_id,
                prefix_call=splice.prefix_call,
                prefix_choice=splice.prefix_choice,
                prefix_message=splice.prefix_message,
                retokenized_turns=splice.retokenized_turns,
                reward=None,
                **fields,
            )
        with self._lock:
            if episode_id in self._outputs:
                self._outputs[episode_id] += outputs_of(call, eos_ids)
        return call

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
        none); ``upstream``: where the call was answered, if not by the local engine."""
        usage = response.get("usage") or {}
        return await asyncio.to_thread(
            self._record,
            episode_id,
            splice,
            eos_ids,
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

    def forget(self, episode: EpisodeRecord) -> None:
        """Drop a closed episode's outputs from memory."""
        with self._lock:
            self._outputs.pop(episode.id, None)

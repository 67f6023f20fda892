"""Reuse of the KV of prompts seen before (automatic prefix caching).

Agents send the same long system prompt with every rollout, and each turn of a multi-turn episode re-sends the
whole conversation so far. Keeping the KV of recent prompts (and of finished prompt+completion sequences) means
a new request only prefills what is new: for tool-calling rollouts, most of the prompt.
Entries are exact token sequences; a hit copies the matched rows into the request's slot. Cleared whenever the
weights may have changed (see ``InferenceEngine.exclusive``), which starts a new weights *generation*: every entry
was computed in the cache's current generation, as ``insert`` refuses KV from any other (a sequence that was still
decoding when the weights changed), so a hit never brings back keys and values of older weights.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from flywheel.inference.kv_attention import SlotKVCache

MIN_REUSE = 16  # shorter matches are not worth a copy


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, like: SlotKVCache, max_entries: int = 32):
        self.store = SlotKVCache(
            like.n_layers,
            like.kv_heads,
            like.head_dim,
            dtype=like.dtype,
            device=like.device,
            max_rows=max_entries,
            max_capacity=like.max_capacity,
        )
        self.max_entries = max_entries
        self.entries: OrderedDict[int, list[int]] = OrderedDict()  # store row -> tokens, least recent first
        self.logits: dict[int, torch.Tensor] = {}  # store row -> next-token logits, for entries that were prompts
        self.free: list[int] = []
        self.allocated = 0
        self.generation = 0  # the weights generation of every entry (see ``clear``)
        self.hits = self.reused_tokens = 0

    def peek(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` the cache could provide (no bookkeeping)."""
        return max((common_prefix(tokens, prompt) for tokens in self.entries.values()), default=0)

    def lookup(self, prompt: list[int]) -> tuple[int, int, torch.Tensor | None]:
        """(store row, tokens reusable, next-token logits if the whole prompt was seen) for the longest cached
        prefix of ``prompt``; (-1, 0, None) if none is worth it."""
        best_row, best = -1, 0
        for row, tokens in self.entries.items():
            n = common_prefix(tokens, prompt)
            if n > best or (n == best == len(prompt) and row in self.logits):
                best_row, best = row, n
        if best < MIN_REUSE:
            return -1, 0, None
        self.entries.move_to_end(best_row)
        self.hits += 1
        logits = self.logits.get(best_row) if best == len(prompt) == len(self.entries[best_row]) else None
        if logits is None:
            best = min(best, len(prompt) - 1)  # the last prompt token must run to give the next token's logits
        self.reused_tokens += best
        return best_row, best, logits

    def insert(
        self,
        tokens: list[int],
        cache: SlotKVCache,
        row: int,
        logits: torch.Tensor | None = None,
        *,
        generation: int = 0,
    ) -> None:
        """Remember the KV of ``tokens`` (in ``cache`` row ``row``) and, for a prompt, its next-token logits; KV of
        weights other than the current ones (``generation`` is not the cache's) is not kept."""
        if len(tokens) < MIN_REUSE or generation != self.generation:
            return
        for r, known in self.entries.items():
            if common_prefix(known, tokens) == len(tokens) and (
                logits is None or len(known) > len(tokens) or r in self.logits
            ):
                self.entries.move_to_end(r)  # already covered
                return
        # entries this one extends are redundant now (unless they hold a prompt's logits): their rows go first
        for r in [r for r, k in self.entries.items() if common_prefix(k, tokens) == len(k) and r not in self.logits]:
            del self.entries[r]
            self.logits.pop(r, None)
            self.free.append(r)
        if self.free:
            target = self.free.pop()
        elif self.allocated < self.max_entries:
            target, self.allocated = self.allocated, self.allocated + 1
        else:
            target, _ = self.entries.popitem(last=False)
            self.logits.pop(target, None)
        self.store.reserve(self.allocated, len(tokens))
        copy_rows(cache, row, self.store, target, len(tokens))
        self.entries[target] = list(tokens)
        if logits is not None:
            self.logits[target] = logits.clone()

    def restore(self, row: int, length: int, cache: SlotKVCache, dst_row: int) -> None:
        copy_rows(self.store, row, cache, dst_row, length)

    def clear(self, generation: int) -> None:
        """Forget every entry; from now on, only KV of weights ``generation`` is kept."""
        self.generation = generation
        self.entries.clear()
        self.logits.clear()
        self.free, self.allocated = [], 0
        self.store.empty()


def copy_rows(src: SlotKVCache, src_row: int, dst: SlotKVCache, dst_row: int, length: int) -> None:
    for s, d in ((src.k, dst.k), (src.v, dst.v)):
        for a, b in zip(s, d):
            b[dst_row, :, :length] = a[src_row, :, :length]

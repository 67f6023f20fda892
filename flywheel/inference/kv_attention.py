"""Slot KV cache and the attention function the engine plugs into any Hugging Face decoder.

Why not HF's DynamicCache: it grows with ``torch.cat`` every step (a third of CPU decode time for a 135M model)
and pads a batch to a common length. Here every sequence owns a *row* of pre-allocated per-layer K/V buffers and
its own length, so requests join and leave a running batch without copying anyone else's cache. Active rows are
kept compact (0..B-1) so a decode step reads the cache through views, never gathers.

The function is registered as the attention implementation ``"flywheel"``. When a forward call carries
``kv_batch=`` (the engine's calls) it reads and writes the slot cache; otherwise (training) it is plain SDPA.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from flywheel.inference.memory import trim_heap

ATTN_IMPLEMENTATION = "flywheel"
ROW_STEP, CAPACITY_STEP, CAPACITY_GROWTH = 8, 128, 1.25
WINDOW_STEP = 64  # a decoding cache's capacity stays within [need, need + 2 steps): see SlotKVCache.fit
KEEP_BYTES = 256 << 20  # a prefix store up to this size stays allocated across a training step (SlotKVCache.empty)
SMALL_SCORES = 1 << 22  # training attention with fewer scores than this per layer runs as plain matmuls (<= 24 MB held)


def _grown(current: int, needed: int, step: int, growth: float, limit: int | None) -> int:
    """A size of at least ``needed``: at least ``growth`` x ``current``, rounded up to ``step``, at most ``limit``
    (unless ``needed`` is more). Not doubling: a batch of 48 rows of 700 tokens would get 64 x 1024 slots, a
    KV cache twice its need and the largest part of a training run's peak memory."""
    size = max(needed, math.ceil(current * growth))
    size = -(-size // step) * step
    return max(needed, min(size, limit)) if limit else size


class SlotKVCache:
    """Per-layer K/V buffers of shape [rows, kv_heads, capacity, head_dim]; grown in steps when needed."""

    def __init__(
        self,
        n_layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_rows: int | None = None,
        max_capacity: int | None = None,
    ):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_rows, self.max_capacity = max_rows, max_capacity  # growth by doubling stops there
        self.rows, self.capacity = 0, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def reserve(self, rows: int, capacity: int) -> None:
        """Make room for ``rows`` sequences of up to ``capacity`` tokens, keeping what is stored."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        # rows double (a prefix store gains one at a time), up to max_rows
        new_rows = _grown(self.rows, rows, ROW_STEP, 2.0, self.max_rows) if rows > self.rows else self.rows
        new_cap = (
            _grown(self.capacity, capacity, CAPACITY_STEP, CAPACITY_GROWTH, self.max_capacity)
            if capacity > self.capacity else self.capacity
        )  # fmt: skip
        self._resize(new_rows, new_cap)

    def fit(self, rows: int, length: int) -> None:
        """Make room for ``rows`` sequences of up to ``length`` tokens with a capacity close to ``length``: grown
        in steps of WINDOW_STEP, shrunk once 2 steps are unused. Decoding attends over the whole capacity (masked
        past each row's length), which is then a contiguous block of the buffers: a slice of it would be copied
        inside every attention matmul, which at 500 cached tokens costs twice the matmuls themselves. A resize
        copies the cache once per WINDOW_STEP tokens instead of once per token."""
        if self.capacity - WINDOW_STEP * 2 < length <= self.capacity and rows <= self.rows:
            return
        new_rows = _grown(self.rows, rows, ROW_STEP, 1.0, self.max_rows) if rows > self.rows else self.rows
        new_cap = -(-length // WINDOW_STEP) * WINDOW_STEP
        self._resize(new_rows, max(length, min(new_cap, self.max_capacity or new_cap)))

    def _resize(self, new_rows: int, new_cap: int) -> None:
        shape = (new_rows, self.kv_heads, new_cap, self.head_dim)
        kept = min(self.capacity, new_cap)
        for store in (self.k, self.v):
            for layer in range(self.n_layers):
                # zeros, not empty: masked positions get probability 0, and 0 x NaN garbage would still be NaN
                fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if layer < len(store):
                    fresh[: self.rows, :, :kept] = store[layer][:, :, :kept]
                    store[layer] = fresh
                else:
                    store.append(fresh)
        self.rows, self.capacity = new_rows, new_cap
        trim_heap()  # the old buffers' memory, or it stays in the process (see flywheel/inference/memory.py)

    def release(self) -> None:
        """Give the buffers back (nothing stored survives); the next ``reserve`` allocates afresh. The caller trims
        the heap (``release_free_memory``) once it has released all it will: a trim has a cost of its own."""
        self.k, self.v = [], []
        self.rows, self.capacity = 0, 0

    def empty(self) -> None:
        """Forget what is stored: buffers of up to KEEP_BYTES are kept, zeroed (a prefix store grows one entry at
        a time, and growing it again after every training step cost time: fresh pages, zeroing, copies); larger
        ones are released, so that a training step's activations and a large cache never add up."""
        if sum(t.nbytes for t in self.k + self.v) > KEEP_BYTES:
            self.release()
            return
        with torch.inference_mode():  # the engine makes them in inference mode, and only there may they change
            for t in self.k + self.v:
                t.zero_()

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (prefix sharing, compaction)."""
        for store in (self.k, self.v):
            for buf in store:
                buf[dst, :, :length] = buf[src, :, :length]


@dataclass
class PrefillBatch:
    """Prompts packed into one [1, T] sequence (no padding). Segment i fills row ``rows[i]`` from ``starts[i]``."""

    cache: SlotKVCache
    rows: list[int]
    starts: list[int]  # positions already cached for that row (shared prefix), usually 0
    lengths: list[int]  # new tokens of each segment


@dataclass(frozen=True)
class PaddedGroup:
    """Segments attended in one call, each padded to the group's longest (n) and its context to the longest (c):
    ``index`` [S, n] of each segment's tokens in the row (0 where padded), ``context_index`` [S, c] of the tokens of
    the segment it continues (c = 0: none does), the boolean ``mask`` [S, 1, n, c + n] over that context and the
    segment itself (causal), and ``causal``: no context and no padding, so the mask is plain causal."""

    index: torch.Tensor
    context_index: torch.Tensor
    mask: torch.Tensor
    causal: bool


@dataclass(frozen=True)
class PackedLayout:
    """How one layer attends a PackedBatch: ``groups`` in turn, then ``back`` [T] of each row token in their outputs
    concatenated (each group's output in its padded [S * n] order)."""

    groups: list[PaddedGroup]
    back: torch.Tensor


def _group(
    lengths: list[int], starts: list[int], context_lengths: list[int], context_starts: list[int], device: torch.device
) -> PaddedGroup:
    """The PaddedGroup of segments of ``lengths`` at ``starts`` of the row, each continuing the context of
    ``context_lengths`` (0: none) at ``context_starts``."""
    length, first = torch.tensor(lengths, device=device), torch.tensor(starts, device=device)
    n = max(lengths)
    pos = torch.arange(n, device=device)
    valid = pos[None] < length[:, None]  # [S, n]
    index = torch.where(valid, first[:, None] + pos[None], 0)
    own = (pos[None, :] <= pos[:, None])[None] & valid[:, None, :]  # causal, real keys only
    c = max(context_lengths)
    cpos = torch.arange(c, device=device)
    seen = cpos[None] < torch.tensor(context_lengths, device=device)[:, None]  # [S, c]
    context_index = torch.where(seen, torch.tensor(context_starts, device=device)[:, None] + cpos[None], 0)
    mask = torch.cat([seen[:, None, :].expand(-1, n, -1), own], dim=2)[:, None]
    return PaddedGroup(index, context_index, mask, causal=c == 0 and min(lengths) == n)


def _scores(lengths: list[int], context_lengths: list[int], heads: int) -> int:
    """Attention scores of one padded call over these segments (what SDPA computes for a masked call)."""
    n = max(lengths)
    return len(lengths) * heads * n * (max(context_lengths) + n)


@dataclass
class PackedBatch:
    """Training: segments packed into one [1, T] row (no cache, no padding), each attending causally to itself
    and, if it continues another segment of the row, to all of that one: a prompt that a group of rollouts shares
    is stored and computed once, and each rollout's own tokens follow it as segments of their own."""

    lengths: list[int]  # of each segment, in row order
    context: list[int]  # per segment, the earlier segment it continues, or -1
    # one FlexAttention call over the whole row with a block mask (a fused kernel, compiled on GPUs) instead of the
    # padded calls of ``layout``; the same attention (tests/test_packed_attention.py)
    flex: bool = False
    _layout: PackedLayout | None = field(default=None, init=False, repr=False)
    _block_mask: BlockMask | None = field(default=None, init=False, repr=False)

    def visible(self, device: torch.device) -> Callable[..., torch.Tensor]:
        """FlexAttention's ``mask_mod`` of the row: a token sees the earlier tokens of its segment and all of the
        segment its segment continues."""
        segment = torch.repeat_interleave(
            torch.arange(len(self.lengths), device=device), torch.tensor(self.lengths, device=device)
        )
        continues = torch.tensor(self.context, device=device)

        def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            own, other = segment[q], segment[kv]
            return ((own == other) & (kv <= q)) | (continues[own] == other)

        return visible

    def block_mask(self, device: torch.device) -> BlockMask:
        """``visible`` as FlexAttention's block mask, computed once for all layers."""
        if self._block_mask is None:
            total = sum(self.lengths)
            self._block_mask = create_block_mask(self.visible(device), None, None, total, total, device=device)
        return self._block_mask

    def layout(self, device: torch.device, heads: int) -> PackedLayout:
        """The attention calls for ``heads`` query heads, computed once for all layers. A batch with few scores
        (at most SMALL_SCORES with every segment padded to the longest and every context to the longest) is one
        call. Otherwise a segment that continues nothing (a prompt, a lone sequence) attends only to itself:
        those of one length are one causal call (no mask: flash attention skips the upper triangle), or all of
        them one padded call where that is small; the continuing segments are one call, padded only among
        themselves, their keys their context and their own tokens. Padding them to the prompt they share (usually
        the longest segment), as one call would, computed 2-7x the scores needed: for a row [914 (prompt), 384,
        125, 125, 125, 210], 10.0M scores per head where 1.4M are needed (docs/benchmarks.md)."""
        if self._layout is None:
            starts = list(itertools.accumulate(self.lengths, initial=0))[:-1]
            context_lengths = [self.lengths[c] if c >= 0 else 0 for c in self.context]
            context_starts = [starts[c] if c >= 0 else 0 for c in self.context]

            def scores(ids: list[int]) -> int:
                return _scores([self.lengths[i] for i in ids], [context_lengths[i] for i in ids], heads)

            every = list(range(len(self.lengths)))
            roots = [i for i in every if self.context[i] < 0]
            continuing = [i for i in every if self.context[i] >= 0]
            if scores(every) <= SMALL_SCORES:
                parts = [every]
            else:
                if roots and scores(roots) <= SMALL_SCORES:
                    parts = [roots]
                else:  # one causal call per length
                    parts = [
                        [i for i in roots if self.lengths[i] == n] for n in sorted({self.lengths[i] for i in roots})
                    ]
                parts += [continuing] if continuing else []
            groups, back, offset = [], torch.empty(sum(self.lengths), dtype=torch.long, device=device), 0
            for ids in parts:
                groups.append(
                    _group(
                        [self.lengths[i] for i in ids],
                        [starts[i] for i in ids],
                        [context_lengths[i] for i in ids],
                        [context_starts[i] for i in ids],
                        device,
                    )
                )
                n = groups[-1].index.shape[1]
                for j, i in enumerate(ids):  # segment i's output is at offset + j * n of this group's [S * n]
                    first = offset + j * n
                    back[starts[i] : starts[i] + self.lengths[i]] = torch.arange(first, first + self.lengths[i])
                offset += len(ids) * n
            self._layout = PackedLayout(groups, back)
        return self._layout


@dataclass
class DecodeBatch:
    """One new token for each of rows 0..B-1; ``lengths[b]`` tokens are already cached for row b. Attention
    reads all ``cache.capacity`` positions of a row (see ``SlotKVCache.fit``), masked past its new token."""

    cache: SlotKVCache
    lengths: torch.Tensor  # [B] long
    _layout: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def layout(self, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(where each row's new K/V go in a layer's buffer seen as [rows * kv_heads * capacity, head_dim], [B *
        kv_heads]; the scores' additive mask [B * kv_heads, groups, capacity]: -inf past each row's new token, for
        ``groups`` query heads per K/V head), computed once for all layers."""
        if self._layout is None:
            cache, device = self.cache, self.lengths.device
            rows = torch.arange(len(self.lengths), device=device)
            slots = (rows[:, None] * cache.kv_heads + torch.arange(cache.kv_heads, device=device)) * cache.capacity
            past_end = torch.arange(cache.capacity, device=device)[None, :] > self.lengths[:, None]
            bias = torch.zeros(past_end.shape, dtype=cache.dtype, device=device).masked_fill_(past_end, float("-inf"))
            bias = bias[:, None, None].expand(-1, cache.kv_heads, groups, -1).reshape(-1, groups, cache.capacity)
            self._layout = ((slots + self.lengths[:, None]).view(-1), bias)  # the bias contiguous: faster baddbmm
        return self._layout


def _prefill(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PrefillBatch, scaling: float):
    cache, out, offset = batch.cache, [], 0
    for row, start, n in zip(batch.rows, batch.starts, batch.lengths):
        cache.k[layer][row, :, start : start + n] = k[0, :, offset : offset + n]
        cache.v[layer][row, :, start : start + n] = v[0, :, offset : offset + n]
        keys = cache.k[layer][row : row + 1, :, : start + n]
        values = cache.v[layer][row : row + 1, :, : start + n]
        query = q[:, :, offset : offset + n]
        if start == 0:
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling, enable_gqa=True)
        else:  # new tokens see the whole cached prefix plus the causal part of themselves
            mask = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(diagonal=start)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
        out.append(o)
        offset += n
    return torch.cat(out, dim=2).transpose(1, 2)  # [1, T, heads, head_dim]


def _decode(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DecodeBatch, scaling: float):
    slots, bias = batch.layout(q.shape[1] // k.shape[1])
    return decode_attention(q, k, v, batch.cache.k[layer], batch.cache.v[layer], slots, bias, scaling)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One decode step's attention in one layer: the new ``k``/``v`` [B, kv_heads, 1, d] stored at ``slots`` of the
    layer's buffers, then ``q`` [B, heads, 1, d] over rows 0..B-1 of them with the additive mask ``bias``
    (``DecodeBatch.layout``). Tensors only, so that a compiled decode step can trace it. [B, 1, heads, d]."""
    b, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    k_buffer.view(-1, dim).index_copy_(0, slots, k[:, :, 0].reshape(-1, dim))  # one copy, no index building
    v_buffer.view(-1, dim).index_copy_(0, slots, v[:, :, 0].reshape(-1, dim))
    keys, values = k_buffer[:b].flatten(0, 1), v_buffer[:b].flatten(0, 1)  # views, neither is copied
    grouped = q.reshape(b * kv_heads, heads // kv_heads, dim)
    if b == 1 and torch.compiler.is_compiling():
        # compiled, for one row: multiply-and-sum, which inductor fuses into two C++ loops over the cache, faster
        # than the two oneDNN calls below at this size; at more rows the matmuls win
        scores = (grouped[:, :, None] * keys[:, None]).sum(-1) * scaling + bias
        return (scores.softmax(dim=-1)[..., None] * values[:, None]).sum(-2).view(b, 1, heads, dim)
    # Grouped-query attention as two batched matmuls: [B * kvh, group, d] x [B * kvh, d, L]. For one query token
    # this is several times faster on CPU than SDPA's flash kernel, and never repeats K/V per head. The scaling and
    # the mask ride in the first (baddbmm); softmax of bf16 scores computes in fp32 inside.
    scores = torch.baddbmm(bias, grouped, keys.transpose(1, 2), alpha=scaling)
    out = torch.bmm(scores.softmax(dim=-1), values)  # [B * kvh, group, d]
    return out.view(b, 1, heads, dim)


def _segments(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The tokens ``index`` [S, m] of ``x`` [1, heads, T, d]: [S, heads, m, d]. ``index_select`` on the token
    dimension, whose backward (``index_add``) is several times faster on CPU than advanced indexing's
    (``index_put``)."""
    rows = x[0].transpose(0, 1).index_select(0, index.flatten())  # [S * m, heads, d]
    return rows.view(*index.shape, *rows.shape[1:]).transpose(1, 2)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch, scaling: float) -> torch.Tensor:
    """The packed row in one FlexAttention call: [1, T, heads, head_dim]. Compiled on a GPU (the fused kernel);
    elsewhere eager, which computes the masked scores in full and has no backward on CPU (a reference for tests,
    not a path to train on there)."""
    attend_flex = _compiled_flex() if q.is_cuda else flex_attention
    out = attend_flex(q, k, v, block_mask=batch.block_mask(q.device), scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=True)


def _packed(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch, scaling: float):
    if batch.flex:
        return _flex(q, k, v, batch, scaling)
    # A few attention calls (PackedBatch.layout), not one per segment: CPU flash attention's per-call cost dominates
    # at these sizes; nor always one for all segments, padded to the longest: that computes 2-7x the scores needed.
    layout = batch.layout(q.device, q.shape[1])
    outs = []
    for group in layout.groups:
        query, keys, values = _segments(q, group.index), _segments(k, group.index), _segments(v, group.index)
        if group.context_index.shape[1]:  # each segment also sees the one it continues
            keys = torch.cat([_segments(k, group.context_index), keys], dim=2)
            values = torch.cat([_segments(v, group.context_index), values], dim=2)
        if query.shape[0] * query.shape[1] * query.shape[2] * keys.shape[2] <= SMALL_SCORES:
            o = _small_attention(query, keys, values, group.mask, scaling)
        elif group.causal:
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=group.mask, scale=scaling, enable_gqa=True
            )
        outs.append(o.transpose(1, 2).flatten(0, 1))  # [S * n, heads, head_dim]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.index_select(0, layout.back)[None]  # back to row order: [1, T, heads, head_dim]


def _small_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of q [S, heads, n, d] over k, v [S, kv_heads, m, d] with a boolean mask [S, 1, n, m], as two
    matmuls that take all query heads of a K/V head at once. Where the scores are small, forward and backward are
    faster than CPU flash attention (e.g. a GRPO group of 8 completions of 64 tokens after a 70-token prompt);
    they are held for backward, hence only below SMALL_SCORES. The scores stay in the inputs' dtype: torch's CPU
    softmax of bf16 computes in fp32 inside (as flash attention does), without fp32 copies of the scores."""
    segments, heads, n, dim = q.shape
    kv_heads = k.shape[1]
    grouped = (q * scaling).reshape(segments, kv_heads, heads // kv_heads * n, dim)  # exact for 1/sqrt(64)
    scores = torch.matmul(grouped, k.transpose(-1, -2))  # [S, kv_heads, group * n, m]
    scores = scores.view(segments, kv_heads, heads // kv_heads, n, -1).masked_fill_(~mask[:, :, None], float("-inf"))
    probs = scores.softmax(dim=-1).view(segments, kv_heads, heads // kv_heads * n, -1)
    return torch.matmul(probs, v).view(segments, heads, n, dim)


def flywheel_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    batch = kwargs.pop("kv_batch", None)
    if batch is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attend(module.layer_idx, query, key, value, batch, scaling), None


def attend(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PrefillBatch | DecodeBatch | PackedBatch,
    scaling: float,
) -> torch.Tensor:
    """Attention of ``q``/``k``/``v`` [1 or B, heads, T, head_dim] for one layer of ``batch``: [1 or B, T, heads, head_dim]."""
    fn = _decode if isinstance(batch, DecodeBatch) else _packed if isinstance(batch, PackedBatch) else _prefill
    return fn(layer, q, k, v, batch, scaling)


AttentionInterface.register(ATTN_IMPLEMENTATION, flywheel_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)

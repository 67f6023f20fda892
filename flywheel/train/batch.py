"""From trajectories to packed token sequences with a mask of the positions that train.

Only tokens the model sampled train: every ``Choice`` of a trajectory, with the exact ids the engine returned
(``flywheel.types.sampled_tokens``), the sampler's log-probs of them and the temperature they were drawn at.
System, user and tool tokens, and assistant message dicts (context that was not sampled), are masked.

A constrained turn (a forced tool call, ``guided_choice``, a JSON ``response_format``) was drawn from a
grammar-masked distribution while the trainer scores the unmasked one; a turn whose log-probs are at another
temperature than it was drawn at (an upstream's raw log-probs) cannot be compared either. Their tokens train (as
if the policy had drawn them: an on-policy rollout's weight is 1) but carry no sampler log-probs, so truncated
importance sampling leaves them at weight 1 and its metrics leave them out (``tokens_without_sampler_logprobs``);
the loop's off-policy members exclude such episodes (``loop/offpolicy.py``).

Consecutive turns whose prompt extends the previous sequence token for token are merged into one sequence (the
shared prefix is processed once); a turn whose prompt does not (a template that re-renders history differently)
starts a sequence of its own, so nothing is ever trained on re-tokenised text.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from openai.types.chat.chat_completion import Choice
from transformers import PreTrainedTokenizerBase

from flywheel.inference.chat import render_prompt, to_default_format
from flywheel.inference.prefix_cache import common_prefix
from flywheel.types import History, Trajectory, choice_to_message, sampled_tokens

NO_LOGPROB = math.nan  # a sampled token whose sampler log-prob is unknown (or a context token)


@dataclass
class TrainingSequence:
    """One rendered token sequence of a trajectory (one turn, or consecutive turns that extend each other) with
    what trains on it: the trained-token mask, the sampler's log-probs and temperatures, the advantage(s)."""

    tokens: list[int]
    trained: list[bool]  # trained[t]: token t is a sampled token whose log-prob trains
    sampler_logprobs: list[float] = field(default_factory=list)  # per token, NaN where unknown; [] if none known
    temperature: list[float] = field(default_factory=list)  # per token, its turn's sampling temperature; []: all 1
    advantage: float = 0.0
    index: int = 0  # position in the optimizer batch (set by pack)
    trajectory: int = 0  # which trajectory of the optimizer batch it renders (part of): normalisation per trajectory
    turn: list[int] = field(default_factory=list)  # turn[t]: the sampled turn token t belongs to (-1: context)
    turn_advantages: list[float] | None = None  # one per sampled turn of the trajectory (credit="turn")


@dataclass
class MicroBatch:
    """Sequences packed into one row; ``targets`` are the trained tokens, predicted from ``positions``. The row
    holds segments: a prefix that several sequences share (stored once), then each of those sequences' own tokens
    as a segment that continues it (``context``), or a whole sequence alone."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    lengths: list[int]  # of each segment, in row order
    context: list[int]  # per segment, the shared-prefix segment it continues, or -1
    positions: torch.Tensor  # [K] index of the position whose logits predict each trained token
    targets: torch.Tensor  # [K]
    sampler_logprobs: torch.Tensor  # [K] fp32, NaN where unknown
    inverse_t: torch.Tensor | None  # [K] fp32, 1 / each token's sampling temperature; None when all are 1
    advantages: torch.Tensor  # [K]
    seq: torch.Tensor  # [K] sequence index within this micro-batch
    traj: torch.Tensor  # [K] trajectory index of each token (TrainingSequence.trajectory)
    n_seqs: int
    seq_ids: list[int] = field(default_factory=list)  # batch-level sequence indices
    flex: bool = False  # attention as one FlexAttention call (``attention="flex"``), not the padded calls


def _turn_tokens(
    tokenizer: PreTrainedTokenizerBase, choice: Choice, context: list[dict], tools: list[dict] | None
) -> tuple[list[int], list[int], list[float] | None, float]:
    """(prompt ids, completion ids, sampler log-probs, sampling temperature) of one sampled turn. The log-probs are
    those TIS may compare with the trainer's (``SampledTokens.importance_logprobs``): none for a guided turn or one
    whose log-probs are at another temperature; its tokens then train with weight 1 and are counted apart."""
    sampled = sampled_tokens(choice)
    if sampled is not None:
        return sampled.prompt_ids, sampled.completion_ids, sampled.importance_logprobs, sampled.temperature
    # A Choice built by hand (not sampled by our engine): render it the way the engine would have.
    return assistant_turn_tokens(tokenizer, context, choice_to_message(choice), tools) + (None, 1.0)


def assistant_turn_tokens(
    tokenizer: PreTrainedTokenizerBase, context: list[dict], message: dict, tools: list[dict] | None
) -> tuple[list[int], list[int]]:
    """Prompt ids and completion ids (ending with end-of-turn) for an assistant message given its context."""
    prompt = render_prompt(tokenizer, context, tools)
    text = to_default_format([message], None)[0]["content"]
    completion = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt, completion


def _append_turn(
    sequences: list[TrainingSequence],
    prompt: list[int],
    completion: list[int],
    logprobs: list[float] | None,
    temperature: float = 1.0,
    turn: int = -1,
):
    last = sequences[-1] if sequences else None
    if last is not None and prompt[: len(last.tokens)] == last.tokens:
        context = prompt[len(last.tokens) :]
    else:
        last, context = TrainingSequence(tokens=[], trained=[]), prompt
        sequences.append(last)
    last.tokens += context + completion
    last.trained += [False] * len(context) + [True] * len(completion)
    last.sampler_logprobs += [NO_LOGPROB] * len(context) + (logprobs or [NO_LOGPROB] * len(completion))
    last.temperature += [1.0] * len(context) + [temperature] * len(completion)
    last.turn += [-1] * len(context) + [turn] * len(completion)


def history_sequences(
    history: History, tokenizer: PreTrainedTokenizerBase, *, train_message_dicts: bool = False, first_turn: int = 0
) -> list[TrainingSequence]:
    """Sequences of one conversation. ``train_message_dicts`` (SFT) also trains assistant message dicts, except
    those with ``"weight": 0`` (OpenAI's fine-tuning files mark context-only replies so). Sampled turns are numbered
    from ``first_turn`` on."""
    sequences: list[TrainingSequence] = []
    context: list[dict] = []
    turn = first_turn
    for item in history.messages_and_choices:
        if isinstance(item, Choice):
            prompt, completion, logprobs, temperature = _turn_tokens(tokenizer, item, context, history.tools)
            _append_turn(sequences, prompt, completion, logprobs, temperature, turn)
            turn += 1
            context.append(choice_to_message(item))
        else:
            if train_message_dicts and item.get("role") == "assistant" and item.get("weight", 1) != 0:
                prompt, completion = assistant_turn_tokens(tokenizer, context, item, history.tools)
                _append_turn(sequences, prompt, completion, None)
            context.append(dict(item))
    return sequences


def trajectory_sequences(
    traj: Trajectory,
    tokenizer: PreTrainedTokenizerBase,
    advantage: float | list[float] = 0.0,
    *,
    train_message_dicts: bool = False,
) -> list[TrainingSequence]:
    """``advantage``: one for the whole trajectory, or one per sampled turn (main history, then additional ones)."""
    sequences: list[TrainingSequence] = []
    turns = 0
    for history in [traj, *traj.additional_histories]:
        sequences += history_sequences(history, tokenizer, train_message_dicts=train_message_dicts, first_turn=turns)
        turns += sum(isinstance(item, Choice) for item in history.messages_and_choices)
    if isinstance(advantage, list):
        if train_message_dicts:  # assistant message dicts are not sampled turns: they have no turn advantage
            raise ValueError("per-turn advantages apply to sampled turns only, not with train_message_dicts")
        if len(advantage) != turns:
            raise ValueError(f"trajectory {traj.id} has {turns} sampled turns but {len(advantage)} turn advantages")
    for s in sequences:
        if isinstance(advantage, list):
            s.turn_advantages = advantage
        else:
            s.advantage = advantage
    return sequences


MIN_SHARED_PREFIX = 32  # below this, sharing is not worth the extra segment

Family = tuple[int, list[TrainingSequence]]  # (shared prefix length, sequences starting with it); 0: none shared


def families(sequences: list[TrainingSequence]) -> list[Family]:
    """Sequences grouped by the prefix they share (the prompt of a group of rollouts), choosing the grouping that
    stores the fewest prefix tokens: sorted by tokens, sequences sharing a prefix are neighbours, and a dynamic
    programme splits that order where one long shared prompt per group saves more than a short one for all
    (e.g. a system prompt common to every group). Each sequence keeps at least one token of its own."""
    order = sorted(sequences, key=lambda s: s.tokens)
    # shared[j]: what order[j] and order[j + 1] share, leaving each at least one token
    shared = [
        min(common_prefix(a.tokens, b.tokens), len(a.tokens) - 1, len(b.tokens) - 1)
        for a, b in itertools.pairwise(order)
    ]
    saved, start = [0] * (len(order) + 1), [0] * (len(order) + 1)  # best over order[:i]; its last family's start
    for i in range(1, len(order) + 1):
        saved[i], start[i], prefix = saved[i - 1], i - 1, len(order[i - 1].tokens)
        for j in range(i - 2, -1, -1):  # order[j:i] as one family
            prefix = min(prefix, shared[j])
            if prefix < MIN_SHARED_PREFIX:
                break
            if saved[j] + (i - j - 1) * prefix > saved[i]:
                saved[i], start[i] = saved[j] + (i - j - 1) * prefix, j
    out: list[Family] = []
    i = len(order)
    while i > 0:
        members = order[start[i] : i]
        prefix = min(shared[start[i] : i - 1]) if len(members) > 1 else 0
        out.append((prefix, members))
        i = start[i]
    return out[::-1]


def _split(family: Family, max_tokens: int) -> list[Family]:
    """A family too long for one row as several, each repeating the prefix (a lone sequence is never split)."""
    prefix, members = family
    parts: list[Family] = [(prefix, [])]
    for s in members:
        if parts[-1][1] and _size(parts[-1]) + len(s.tokens) - prefix > max_tokens:
            parts.append((prefix, []))
        parts[-1][1].append(s)
    return [(p if len(m) > 1 else 0, m) for p, m in parts]


def _size(family: Family) -> int:
    prefix, members = family
    return prefix + sum(len(s.tokens) - prefix for s in members)


def pack(sequences: list[TrainingSequence], max_tokens: int, device: torch.device | str = "cpu") -> list[MicroBatch]:
    """First-fit-decreasing packing into rows of at most ``max_tokens`` (a longer sequence gets its own row).
    Sequences that share a prefix (the prompt of a group of rollouts) keep it once per row (``families``).
    The tensors are made on ``device`` (the model's)."""
    for i, s in enumerate(sequences):
        s.index = i
    items = [part for family in families(sequences) for part in _split(family, max_tokens)]
    bins: list[list[Family]] = []
    sizes: list[int] = []
    for item in sorted(items, key=_size, reverse=True):
        size = _size(item)
        for b, used in enumerate(sizes):
            if used + size <= max_tokens:
                bins[b].append(item)
                sizes[b] += size
                break
        else:
            bins.append([item])
            sizes.append(size)
    return [_micro_batch(b, device) for b in bins]


def _micro_batch(items: list[Family], device: torch.device | str = "cpu") -> MicroBatch:
    ids: list[int] = []
    pos: list[int] = []
    lengths, context, seq_ids = [], [], []
    positions, targets, sampler, inverse_t, adv, seq_of, traj = [], [], [], [], [], [], []
    for prefix, members in items:
        head = len(ids)  # row index of the shared prefix
        if prefix:
            ids += members[0].tokens[:prefix]
            pos += range(prefix)
            lengths.append(prefix)
            context.append(-1)
        parent = len(lengths) - 1 if prefix else -1
        for s in members:
            start = len(ids)  # row index of this sequence's token ``prefix``
            ids += s.tokens[prefix:]
            pos += range(prefix, len(s.tokens))
            lengths.append(len(s.tokens) - prefix)
            context.append(parent)
            for t in range(1, len(s.tokens)):  # token 0 has no prediction inside its sequence
                if s.trained[t]:
                    before = t - 1  # the position whose logits predict token t
                    positions.append(head + before if before < prefix else start + before - prefix)
                    targets.append(s.tokens[t])
                    sampler.append(s.sampler_logprobs[t] if s.sampler_logprobs else NO_LOGPROB)
                    inverse_t.append(1.0 / s.temperature[t] if s.temperature else 1.0)
                    adv.append(s.advantage if s.turn_advantages is None else s.turn_advantages[s.turn[t]])
                    seq_of.append(len(seq_ids))
                    traj.append(s.trajectory)
            seq_ids.append(s.index)
    return MicroBatch(
        input_ids=torch.tensor([ids], device=device),
        position_ids=torch.tensor([pos], device=device),
        lengths=lengths,
        context=context,
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        sampler_logprobs=torch.tensor(sampler, dtype=torch.float32, device=device),
        inverse_t=torch.tensor(inverse_t, dtype=torch.float32, device=device)
        if any(x != 1.0 for x in inverse_t)
        else None,
        advantages=torch.tensor(adv, dtype=torch.float32, device=device),
        seq=torch.tensor(seq_of, dtype=torch.long, device=device),
        traj=torch.tensor(traj, dtype=torch.long, device=device),
        n_seqs=len(seq_ids),
        seq_ids=seq_ids,
    )

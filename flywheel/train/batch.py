"""From trajectories to packed token sequences with a mask of the positions that train.

Only tokens the model sampled train: every ``Choice`` of a trajectory, with the exact ids the engine returned
(``prompt_token_ids`` + ``token_ids``). System, user and tool tokens, and assistant message dicts (context that was
not sampled), are masked. Consecutive turns whose prompt extends the previous sequence token for token are merged
into one sequence (the shared prefix is processed once); a turn whose prompt does not (a template that re-renders
history differently) starts a sequence of its own, so nothing is ever trained on re-tokenised text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from openai.types.chat.chat_completion import Choice
from transformers import PreTrainedTokenizerBase

from flywheel.inference.chat import render_prompt, to_default_format
from flywheel.inference.prefix_cache import common_prefix
from flywheel.types import History, Trajectory, choice_to_message


@dataclass
class Sequence:
    tokens: list[int]
    trained: list[bool]  # trained[t]: token t is a sampled token whose log-prob trains
    old_logprobs: list[float]  # per token; meaningful where trained
    advantage: float = 0.0
    index: int = 0  # position in the optimizer batch (set by pack)
    turn: list[int] = field(default_factory=list)  # turn[t]: the sampled turn token t belongs to (-1: context)
    turn_advantages: list[float] | None = None  # one per sampled turn of the trajectory (credit="turn")


@dataclass
class MicroBatch:
    """Sequences packed into one row; ``targets`` are the trained tokens, predicted from ``positions``."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    lengths: list[int]  # of each sequence after the shared prefix
    prefix: int  # tokens shared by all sequences, once at the start of the row
    positions: torch.Tensor  # [K] index of the position whose logits predict each trained token
    targets: torch.Tensor  # [K]
    old_logprobs: torch.Tensor  # [K]
    advantages: torch.Tensor  # [K]
    seq: torch.Tensor  # [K] sequence index within this micro-batch
    n_seqs: int
    seq_ids: list[int] = field(default_factory=list)  # batch-level sequence indices


def _turn_tokens(
    tokenizer: PreTrainedTokenizerBase, choice: Choice, context: list[dict], tools: list[dict] | None
) -> tuple[list[int], list[int], list[float] | None]:
    """(prompt ids, completion ids, sampler log-probs) of one sampled turn."""
    prompt, completion = getattr(choice, "prompt_token_ids", None), getattr(choice, "token_ids", None)
    if prompt is not None and completion is not None:
        content = choice.logprobs.content if choice.logprobs and choice.logprobs.content else None
        logprobs = [t.logprob for t in content] if content and len(content) == len(completion) else None
        return list(prompt), list(completion), logprobs
    # A Choice built by hand (not sampled by our engine): render it the way the engine would have.
    return assistant_turn_tokens(tokenizer, context, choice_to_message(choice), tools) + (None,)


def assistant_turn_tokens(
    tokenizer: PreTrainedTokenizerBase, context: list[dict], message: dict, tools: list[dict] | None
) -> tuple[list[int], list[int]]:
    """Prompt ids and completion ids (ending with end-of-turn) for an assistant message given its context."""
    prompt = render_prompt(tokenizer, context, tools)
    text = to_default_format([message], None)[0]["content"]
    completion = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt, completion


def _append_turn(
    sequences: list[Sequence], prompt: list[int], completion: list[int], logprobs: list[float] | None, turn: int = -1
):
    last = sequences[-1] if sequences else None
    if last is not None and prompt[: len(last.tokens)] == last.tokens:
        extra = prompt[len(last.tokens) :]
        last.tokens += extra + completion
        last.trained += [False] * len(extra) + [True] * len(completion)
        last.old_logprobs += [0.0] * len(extra) + (logprobs or [0.0] * len(completion))
        last.turn += [-1] * len(extra) + [turn] * len(completion)
    else:
        sequences.append(
            Sequence(
                tokens=prompt + completion,
                trained=[False] * len(prompt) + [True] * len(completion),
                old_logprobs=[0.0] * len(prompt) + (logprobs or [0.0] * len(completion)),
                turn=[-1] * len(prompt) + [turn] * len(completion),
            )
        )


def history_sequences(
    history: History, tokenizer: PreTrainedTokenizerBase, *, train_message_dicts: bool = False, first_turn: int = 0
) -> list[Sequence]:
    """Sequences of one conversation. ``train_message_dicts`` (SFT) also trains assistant message dicts.
    Sampled turns are numbered from ``first_turn`` on."""
    sequences: list[Sequence] = []
    context: list[dict] = []
    turn = first_turn
    for item in history.messages_and_choices:
        if isinstance(item, Choice):
            prompt, completion, logprobs = _turn_tokens(tokenizer, item, context, history.tools)
            _append_turn(sequences, prompt, completion, logprobs, turn)
            turn += 1
            context.append(choice_to_message(item))
        else:
            if train_message_dicts and item.get("role") == "assistant":
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
) -> list[Sequence]:
    """``advantage``: one for the whole trajectory, or one per sampled turn (main history, then additional ones)."""
    sequences: list[Sequence] = []
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


MIN_SHARED_PREFIX = 32  # below this, sharing is not worth the extra attention calls


def shared_prefix(sequences: list[Sequence]) -> int:
    """Tokens at the start of every sequence (each keeps at least one token of its own)."""
    if len(sequences) < 2:
        return 0
    first = sequences[0].tokens
    n = min(len(s.tokens) for s in sequences) - 1
    for s in sequences[1:]:
        n = min(n, common_prefix(first, s.tokens))
    return n if n >= MIN_SHARED_PREFIX else 0


def pack(sequences: list[Sequence], max_tokens: int, device: torch.device | str = "cpu") -> list[MicroBatch]:
    """First-fit-decreasing packing into rows of at most ``max_tokens`` (a longer sequence gets its own row).
    A prefix that all sequences share (the system prompt of a group of rollouts) is put once at the start of
    every row instead of once per sequence. The tensors are made on ``device`` (the model's)."""
    for i, s in enumerate(sequences):
        s.index = i
    prefix = shared_prefix(sequences)
    budget = max(max_tokens - prefix, 1)
    bins: list[list[Sequence]] = []
    sizes: list[int] = []
    for s in sorted(sequences, key=lambda s: len(s.tokens), reverse=True):
        size = len(s.tokens) - prefix
        for b, used in enumerate(sizes):
            if used + size <= budget:
                bins[b].append(s)
                sizes[b] += size
                break
        else:
            bins.append([s])
            sizes.append(size)
    return [_micro_batch(b, prefix, device) for b in bins]


def _micro_batch(seqs: list[Sequence], prefix: int, device: torch.device | str = "cpu") -> MicroBatch:
    ids, pos = list(seqs[0].tokens[:prefix]), list(range(prefix))
    positions, targets, old, adv, seq_of = [], [], [], [], []
    for j, s in enumerate(seqs):
        start = len(ids)  # row index of this sequence's token ``prefix``
        ids += s.tokens[prefix:]
        pos += range(prefix, len(s.tokens))
        for t in range(1, len(s.tokens)):  # token 0 has no prediction inside its sequence
            if s.trained[t]:
                before = t - 1  # the position whose logits predict token t
                positions.append(before if before < prefix else start + before - prefix)
                targets.append(s.tokens[t])
                old.append(s.old_logprobs[t])
                adv.append(s.advantage if s.turn_advantages is None else s.turn_advantages[s.turn[t]])
                seq_of.append(j)
    return MicroBatch(
        input_ids=torch.tensor([ids], device=device),
        position_ids=torch.tensor([pos], device=device),
        lengths=[len(s.tokens) - prefix for s in seqs],
        prefix=prefix,
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        old_logprobs=torch.tensor(old, dtype=torch.float32, device=device),
        advantages=torch.tensor(adv, dtype=torch.float32, device=device),
        seq=torch.tensor(seq_of, dtype=torch.long, device=device),
        n_seqs=len(seqs),
        seq_ids=[s.index for s in seqs],
    )

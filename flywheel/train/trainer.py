"""The trainer: LoRA (via peft) or full fine-tuning on the very model object the engine samples from, one optimizer
step per call."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import PreTrainedModel, get_scheduler

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.kv_attention import PackedBatch
from flywheel.inference.lora import fuse_lora_forward
from flywheel.train.batch import MicroBatch, TrainingSequence, pack, trajectory_sequences
from flywheel.train.checkpoint import Checkpoint, CheckpointState
from flywheel.train.config import Attention, SFTConfig, TrainConfig, TrainedWeights
from flywheel.train.credit import credit_advantages, has_reward_variance, has_signal
from flywheel.train.data_parallel import Replicas
from flywheel.train.logprobs import token_logprobs
from flywheel.train.loss import importance_weights, policy_loss, ratio_stats
from flywheel.train.staleness import answered_at, drop_stale
from flywheel.types import OFF_POLICY, Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)

# peft's PeftModel reads transformers' deprecated ``is_gradient_checkpointing`` (peft 0.21): a FutureWarning at every
# LoRA start about peft's code, not ours, which uses ``is_activation_checkpointing``
warnings.filterwarnings(
    "ignore", r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"
)


ENTROPY_CHUNK = 256  # rows per entropy chunk: [256, V] temporaries instead of [K, V]


# models whose logits are exactly ``lm_head(model(...).last_hidden_state)``: no logit scaling or soft-capping
PLAIN_HEAD_MODELS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def lr_multiplier(config: TrainConfig, rl_step: int) -> float:
    """The learning rate's factor at RL step ``rl_step`` (0-based), from transformers' schedules (as TRL uses them):
    linear warm-up over ``warmup_steps``, then constant, or linear or cosine decay to 0 at ``max_steps``."""
    name = "constant_with_warmup" if config.lr_scheduler_type == "constant" else config.lr_scheduler_type
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = get_scheduler(name, dummy, num_warmup_steps=config.warmup_steps, num_training_steps=config.max_steps)
    return float(schedule.lr_lambdas[0](rl_step))


def fuses_head(model: PreTrainedModel) -> bool:
    """Whether the trainer takes log-probs from hidden states and the output embedding (``token_logprobs``) rather
    than from the model's logits: a known plain head, an ``nn.Linear`` without bias (not, e.g., a LoRA layer)."""
    head = model.get_output_embeddings()
    return type(model).__name__ in PLAIN_HEAD_MODELS and type(head) is torch.nn.Linear and head.bias is None


def _lora_config(settings: TrainedWeights) -> LoraConfig:
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.targets,
        task_type="CAUSAL_LM",
    )


def load_for_serving(model: PreTrainedModel, checkpoint: Checkpoint) -> None:
    """Put a checkpoint's trained weights into a fresh copy of its base model, in place and in the model's dtype,
    exactly as the trainer's live model held them at that step (LoRA unmerged, as there)."""
    settings = checkpoint.state.trained_weights
    if settings.mode == "full":
        unexpected = model.load_state_dict(checkpoint.weights, strict=False).unexpected_keys
    else:
        peft = get_peft_model(model, _lora_config(settings))  # injects the adapter into ``model`` in place
        fuse_lora_forward(model)
        unexpected = set_peft_model_state_dict(peft, checkpoint.weights).unexpected_keys
    if unexpected:
        raise ValueError(
            f"checkpoint of step {checkpoint.state.step} does not match model {model.name_or_path}: {unexpected[:3]}"
        )
    for p in model.parameters():
        p.data = p.data.to(model.dtype)
    model.requires_grad_(False)


def rng_state() -> dict[str, Any]:
    """The process's random generators (torch, CUDA if in use, python's ``random``, numpy's global), for a
    checkpoint: a resumed run draws what the uninterrupted one would have drawn."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(keys), gauss],
        "numpy": [name, torch.from_numpy(np_keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _add_stats(total: dict[str, float], part: dict[str, float]) -> None:
    """``ratio_stats`` of one micro-batch added into the step's: sums, and the max of ``ratio_max``."""
    for k, v in part.items():
        total[k] = max(total[k], v) if k == "ratio_max" else total[k] + v


class Trainer:
    def __init__(self, engine: InferenceEngine, trained_weights: TrainedWeights | None = None):
        self.engine = engine
        self.trained_weights = trained_weights or TrainedWeights()
        self.peft: PeftModel | None = None  # None: full fine-tuning of the engine's model itself
        with engine.exclusive():
            if self.trained_weights.mode == "full":
                engine.model.requires_grad_(True)
            else:
                # peft swaps the target Linear layers in place, so the engine's forward uses the adapter too
                self.peft = get_peft_model(engine.model, _lora_config(self.trained_weights))
                fuse_lora_forward(engine.model)
                engine.model.eval()  # the new layers start in train mode: no adapter dropout while sampling
        trained = self.peft if self.peft is not None else engine.model
        named = [(n, p) for n, p in trained.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.master: list[torch.Tensor] = [torch.empty_like(p, dtype=torch.float32) for p in self.params]
        self.dtype = engine.model.dtype  # the sampler's (model.dtype reads the first parameter: fp32 in an update)
        self._adopt_params()
        self._reference: list[torch.Tensor] | None = None  # the KL reference's weights; None: the base (set_reference)
        self.reference_step: int | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0  # optimizer steps that changed the weights, SFT's included
        self.rl_steps = 0  # of them, RL steps: the learning-rate schedule's clock
        self.autocast = self.dtype == torch.bfloat16
        self.fused_head = fuses_head(engine.model)
        self.replicas: Replicas | None = None  # data-parallel: this rank's share of each step (``replicate``)

    # ---- mixed precision ---------------------------------------------------------------------------------------
    # The trained weights (adapters, or all weights) live in the model's dtype, so the sampler uses them without
    # casting activations to fp32 and back at every layer (a quarter of bf16 decode time on a CPU), and the trainer's
    # forward computes exactly as the sampler's does. The optimizer updates fp32 master copies: after each backward
    # pass (one micro-batch) its gradients, the bf16 GEMMs' outputs rounded once as in torch AMP, are added to the
    # masters' fp32 gradients, so nothing is summed in bf16 across micro-batches or epochs. (Holding the masters as
    # the parameters during an update was tried: it changes only a tied embedding's in-pass sum, runs the residual
    # stream in fp32, away from the sampler's numerics, and costs a cast of every weight per micro-batch.)

    def _adopt_params(self) -> None:
        """Masters <- the trained weights' current values; the trained weights -> the model's dtype."""
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                m.copy_(p)
                p.data = p.data.to(self.dtype)

    def _accumulate(self) -> None:
        """Move this backward pass's gradients into the masters' fp32 gradients."""
        for p, m in zip(self.params, self.master):
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None

    def _master_state(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.master))

    @contextlib.contextmanager
    def _training_mode(self, checkpointing: bool) -> Iterator[None]:
        """Train mode for one update; with ``checkpointing``, each decoder layer keeps only its
        input and recomputes the rest in the backward pass (a fraction of the activations' memory, for some more
        compute: docs/benchmarks.md). The engine samples in eval mode, where neither applies."""
        model = self.engine.model
        if checkpointing:
            model.activation_checkpointing_enable()  # non-reentrant by default
        model.train()
        try:
            yield
        finally:
            self._accumulate()  # a backward pass no optimizer step took: its gradients stay readable on the masters
            model.eval()
            if checkpointing:
                model.activation_checkpointing_disable()
                model.disable_input_require_grads()  # the embedding hook enable() added; one more per step otherwise

    # ---- forward pieces --------------------------------------------------------------------------------------

    def _token_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of the trained tokens (differentiable, fp32) under the distribution each was sampled
        from, softmax(logits / T), and the entropy there (a metric only)."""
        model = self.engine.model
        inputs = dict(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            use_cache=False,
            kv_batch=PackedBatch(mb.lengths, mb.context, flex=mb.flex),
        )
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.fused_head:  # hidden states only at the positions that predict trained tokens: [K, d]
                hidden = model.model(**inputs).last_hidden_state[0, mb.positions]
            else:
                logits = model(**inputs, logits_to_keep=mb.positions).logits[0].float()  # [K, V]
        if self.fused_head:
            weight = model.get_output_embeddings().weight  # the head fuses_head checked
            dtype = torch.bfloat16 if self.autocast else weight.dtype
            return token_logprobs(hidden.to(dtype), weight.to(dtype), mb.targets, mb.inverse_t)
        if mb.inverse_t is not None:
            logits = logits * mb.inverse_t[:, None]
        logp_all = torch.log_softmax(logits, dim=-1)
        with torch.no_grad():  # in chunks: [K, V] temporaries are ~0.4 GB each at K=2048
            entropy = torch.cat([-(c.exp() * c).sum(-1) for c in logp_all.detach().split(ENTROPY_CHUNK)])
        return logp_all.gather(-1, mb.targets[:, None])[:, 0], entropy

    def replicate(self, replicas: Replicas) -> None:
        """Train as one of ``replicas`` from now on (``flywheel.train.data_parallel``), starting from rank 0's
        trained weights (a LoRA adapter is initialised at random in each process), optimizer state and step."""
        with self.engine.exclusive():
            replicas.broadcast(self.master)
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
        optimizer = self.optimizer.state_dict() if self.optimizer is not None else None
        self.step, self.rl_steps, optimizer = replicas.broadcast_object((self.step, self.rl_steps, optimizer))
        if optimizer is not None and replicas.rank != 0:
            self.optimizer = None
            self._optimizer(1e-5, 0.0).load_state_dict(optimizer)
        self.replicas = replicas

    def _batches(
        self, sequences: list[TrainingSequence], max_tokens: int, attention: Attention = "padded"
    ) -> tuple[list[MicroBatch], int, int]:
        """The step's micro-batches this rank trains (all of them without replicas), and the whole step's trained
        tokens and micro-batch count."""
        device = self.engine.model.device
        if attention == "flex" and device.type == "cpu":
            raise ValueError(
                "attention='flex' trains on GPUs: FlexAttention has no backward on CPU (use attention='padded')"
            )
        batches = pack(sequences, max_tokens, device)
        for mb in batches:
            mb.flex = attention == "flex"
        n_tokens, n_batches = sum(len(mb.targets) for mb in batches), len(batches)
        if self.replicas is not None:
            batches = self.replicas.share(batches, [mb.input_ids.shape[1] for mb in batches])
        return batches, n_tokens, n_batches

    def _optimizer(self, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay)
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = lr, weight_decay
        return self.optimizer

    def _apply(self, max_grad_norm: float, optimizer: torch.optim.Optimizer) -> tuple[float, bool]:
        """One optimizer step on the gradients gathered since the last; (gradient norm, whether it stepped). A
        non-finite norm skips the step: the weights stay as they were."""
        if self.replicas is not None:  # every replica's share of the batch: the whole batch's gradients
            self.replicas.sum_gradients(self.master)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.master, max_grad_norm))
        stepped = math.isfinite(grad_norm)
        if stepped:
            optimizer.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
        else:
            log.warning("non-finite gradient norm (%s): optimizer step skipped, the weights are unchanged", grad_norm)
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    # ---- RL ----------------------------------------------------------------------------------------------------

    def rl_step(self, groups: list[TrajectoryGroup], config: TrainConfig) -> dict[str, float]:
        """One RL step on ``groups``. A group trains when the advantages it gets differ from zero (with
        ``credit="turn"`` a group whose total rewards tie may still have per-turn signal). ``step`` advances only
        when the weights changed; otherwise ``skipped`` is 1 and ``skip_reason`` says why (no signal: 1, non-finite
        gradients: 2). With ``config.max_staleness_steps``, groups answered by weights too far from these are
        dropped first (``train/staleness.py``: ``stale_groups``)."""
        if self.replicas is not None:
            self.replicas.lead("rl_step", groups, config)
        start = time.perf_counter()
        groups, staleness = drop_stale(groups, self.step, config.max_staleness_steps)
        rewards = [t.reward for g in groups for t in g.trajectories]
        candidates = [g for g in groups if len(g.trajectories) > 1]
        if config.credit == "uniform":  # equal totals give zero advantages; kept out of reinforce_pp's whitening
            candidates = [g for g in candidates if has_reward_variance(g)]
        advantages = {id(g): a for g, a in zip(candidates, credit_advantages(candidates, config))}
        usable = [g for g in candidates if any(has_signal(a) for a in advantages[id(g)])]
        metrics: dict[str, float] = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward_std": float(torch.tensor(rewards).std(unbiased=False)) if rewards else 0.0,
            "groups": len(groups),
            "groups_zero_variance": len(groups) - len(usable),
            "zero_variance_fraction": (len(groups) - len(usable)) / len(groups) if groups else 1.0,
        } | staleness
        # Normalisers, as published (flywheel/train/loss.py): GRPO-style means are over every trajectory given;
        # DAPO/CISPO's token mean over the groups that train (all of them when the KL term gives every token a
        # gradient). Trajectories whose advantage is zero are not computed unless the KL term needs them.
        counted = groups if config.beta > 0 else usable
        sequences: list[TrainingSequence] = []
        traj_tokens: list[int] = []
        off_policy: list[bool] = []  # per trained trajectory: an off-policy member (metadata OFF_POLICY)
        other_weights: list[bool] = []  # ... answered by other weights than these (off-policy, or stale)
        batch_tokens = 0
        for g in counted:
            for t, a in zip(g.trajectories, advantages.get(id(g), [0.0] * len(g.trajectories))):
                seqs = [s for s in trajectory_sequences(t, self.engine.tokenizer, a) if any(s.trained[1:])]
                tokens = sum(sum(s.trained[1:]) for s in seqs)
                batch_tokens += tokens
                if seqs and (has_signal(a) or config.beta > 0):
                    for s in seqs:
                        s.trajectory = len(traj_tokens)
                    sequences += seqs
                    traj_tokens.append(tokens)
                    off_policy.append(bool(t.metadata.get(OFF_POLICY)))
                    other_weights.append(off_policy[-1] or answered_at(t) not in (None, self.step))
        if not sequences:
            log.info("step skipped: no group has reward variance (%d groups), nothing to train", len(groups))
            return metrics | {"skipped": 1.0, "skip_reason": 1.0, "train_seconds": time.perf_counter() - start}
        n_trajectories = sum(len(g.trajectories) for g in groups)
        if members := sum(bool(t.metadata.get(OFF_POLICY)) for g in groups for t in g.trajectories):
            metrics["off_policy_members"] = members
        with self.engine.exclusive():
            metrics |= self._rl_update(
                sequences, config, traj_tokens, n_trajectories, batch_tokens, off_policy, other_weights
            )
        if metrics["optimizer_steps"] == 0:
            return metrics | {"skipped": 1.0, "skip_reason": 2.0, "train_seconds": time.perf_counter() - start}
        self.step += 1
        self.rl_steps += 1
        return metrics | {"skipped": 0.0, "train_seconds": time.perf_counter() - start}

    def _rl_update(
        self,
        sequences: list[TrainingSequence],
        config: TrainConfig,
        traj_tokens: list[int],
        n_trajectories: int,
        batch_tokens: int,
        off_policy: list[bool],
        other_weights: list[bool],
    ) -> dict[str, float]:
        """``off_policy``: per trajectory, whether it is an off-policy member; their tokens' importance ratios
        (pi_old / pi_sampler, before the cap) are also reported apart: ``off_policy_is_ratio_mean``, ...
        ``other_weights``: whether other weights than these answered it (an off-policy member, a stale rollout of
        the pipeline): left out of ``sampler_logprob_gap``, which checks that the served policy is the trained one."""
        batches, n_tokens, n_batches = self._batches(sequences, config.micro_batch_tokens, config.attention)
        tokens_of = torch.tensor(traj_tokens, dtype=torch.float32, device=self.engine.model.device)
        lr = config.learning_rate * lr_multiplier(config, self.rl_steps)
        optimizer = self._optimizer(lr, config.weight_decay)
        stats: dict[str, float] = {}
        cap = config.importance_sampling_cap
        tis = ratio_stats(torch.empty(0), cap)  # over every token with a sampler log-prob
        off = ratio_stats(torch.empty(0), cap)  # over off-policy members' such tokens
        gap_sum, gap_tokens, steps = 0.0, 0, 0  # the gap over the live weights' rollouts (others differ)
        flags = torch.tensor(off_policy, dtype=torch.bool, device=tokens_of.device)
        elsewhere = torch.tensor(other_weights, dtype=torch.bool, device=tokens_of.device)
        with self._training_mode(config.gradient_checkpointing):
            refs = [self._reference_logprobs(mb) for mb in batches] if config.beta > 0 else [None] * len(batches)
            # epoch 0 is on-policy for the PPO ratio: old log-probs = current ones (exact, immune to rounding);
            # later epochs compare against those, so their ratios and clipping are real. What the sampler did
            # differently (other weights, another numeric path) is corrected by TIS: pi_old / pi_sampler, capped.
            olds: list[torch.Tensor | None] = [None] * len(batches)
            is_weights: list[torch.Tensor | None] = [None] * len(batches)
            for _epoch in range(config.epochs):
                loss_sum, entropy_sum, clip_sum, kl_sum = 0.0, 0.0, 0.0, 0.0
                for i, mb in enumerate(batches):
                    logp, entropy = self._token_logprobs(mb)
                    if olds[i] is None:
                        olds[i] = logp.detach()
                        on_policy = ~torch.isnan(mb.sampler_logprobs) & ~elsewhere[mb.traj]
                        gap_sum += float((olds[i] - mb.sampler_logprobs)[on_policy].abs().sum())
                        gap_tokens += int(on_policy.sum())
                        is_weights[i], ratio = importance_weights(olds[i], mb.sampler_logprobs, cap)
                        _add_stats(tis, ratio_stats(ratio, cap))
                        _add_stats(off, ratio_stats(ratio[flags[mb.traj]], cap))
                    loss, s = policy_loss(
                        logp,
                        olds[i],
                        mb.advantages,
                        mb.seq,
                        mb.n_seqs,
                        config,
                        ref_logp=refs[i],
                        is_weight=is_weights[i],
                        traj_tokens=tokens_of[mb.traj],
                        n_trajectories=n_trajectories,
                        batch_tokens=batch_tokens,
                    )
                    loss.backward()
                    self._accumulate()
                    w = len(mb.targets) / n_tokens
                    loss_sum += float(loss.detach())
                    entropy_sum += float(entropy.mean()) * w
                    clip_sum += s["clip_fraction"] * w
                    kl_sum += s["kl"] * w
                if self.replicas is not None:
                    loss_sum, entropy_sum, clip_sum, kl_sum = self.replicas.sum(
                        [loss_sum, entropy_sum, clip_sum, kl_sum]
                    )
                grad_norm, stepped = self._apply(config.max_grad_norm, optimizer)
                steps += stepped
                stats = {
                    "loss": loss_sum,
                    "entropy": entropy_sum,
                    "clip_fraction": clip_sum,
                    "kl": kl_sum,
                    "grad_norm": grad_norm,
                }
        if self.replicas is not None:
            tis, off = self.replicas.reduce_stats(tis), self.replicas.reduce_stats(off)
            gap_sum, gap_tokens = self.replicas.sum([gap_sum, gap_tokens])
        out = stats | {
            "tokens_trained": n_tokens,
            "sequences": len(sequences),
            "micro_batches": n_batches,
            "optimizer_steps": steps,
            "learning_rate": lr,
            "tokens_without_sampler_logprobs": n_tokens - tis["tokens"],
        }
        if gap_tokens:  # how far the sampler's log-probs sit from the trainer's: a health signal (GapAlarm)
            out["sampler_logprob_gap"] = gap_sum / gap_tokens
        if tis["tokens"] and cap is not None:
            out |= {
                "is_ratio_mean": tis["ratio_sum"] / tis["tokens"],
                "is_ratio_max": tis["ratio_max"],
                "is_clipped_fraction": tis["clipped"] / tis["tokens"],
            }
        if off["tokens"]:
            out |= {
                "off_policy_tokens": off["tokens"],
                "off_policy_is_ratio_mean": off["ratio_sum"] / off["tokens"],
                "off_policy_is_clipped_fraction": off["clipped"] / off["tokens"],
            }
        return out

    # ---- KL reference ------------------------------------------------------------------------------------------

    def set_reference(self, weights: dict[str, torch.Tensor] | None, step: int | None = None) -> None:
        """The policy the KL term pulls towards: ``None``, the base model (LoRA: the adapter switched off; full
        fine-tuning: the base checkpoint's weights, read from disk when first needed); or trained weights keyed as
        this trainer saves them (a checkpoint's, e.g. the end of an SFT warm start, ``step``)."""
        if self.replicas is not None:
            self.replicas.lead("set_reference", weights, step)
        if weights is None:
            self._reference, self.reference_step = None, None
            return
        keys = {self._saved_key(n): n for n in self.names}
        missing = sorted(set(keys) - set(weights))
        if missing:
            raise ValueError(f"reference weights do not match this model's trained weights: missing {missing[:3]}")
        self._reference = [weights[k].to(self.dtype) for k in keys]  # as the policy's weights are in a forward
        self.reference_step = step

    def _saved_key(self, name: str) -> str:
        """A trained parameter's key in saved weights (peft drops the adapter's name from its keys)."""
        return name.replace(".default.", ".") if self.peft is not None else name

    @torch.no_grad()
    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        with self._reference_weights():
            return self._token_logprobs(mb)[0]

    @contextlib.contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """The reference policy's weights in the model, for the duration of the block."""
        if self._reference is None and self.peft is not None:
            with self.peft.disable_adapter():
                yield
            return
        if self._reference is None:  # full fine-tuning's base: the weights as loaded, not a clone kept all along
            self._reference = self._base_weights_from_disk()
        trained = [p.data for p in self.params]
        for p, reference in zip(self.params, self._reference):
            p.data = reference
        try:
            yield
        finally:
            for p, data in zip(self.params, trained):
                p.data = data

    def _base_weights_from_disk(self) -> list[torch.Tensor]:
        directory = Path(self.engine.model.name_or_path)
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("*.safetensors")):
            weights |= load_file(str(file))
        missing = [n for n in self.names if n not in weights]
        if missing:
            raise ValueError(
                f"the base weights in {directory} lack {missing[:3]}: cannot restore the base model from them"
            )
        return [weights[n].to(self.dtype) for n in self.names]  # as the engine loaded them

    # ---- SFT ---------------------------------------------------------------------------------------------------

    def sft(
        self,
        trajectories: list[Trajectory],
        config: SFTConfig,
        progress: Callable[[dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Cross-entropy on assistant turns (sampled choices and assistant message dicts); one entry per optimizer
        step that changed the weights (a non-finite gradient skips its step, logged), also handed to ``progress``
        as soon as the step is taken (on the engine's thread)."""
        if self.replicas is not None:
            self.replicas.lead("sft", trajectories, config)
        history = []
        for _ in range(config.epochs):
            for i in range(0, len(trajectories), config.batch_size):
                chunk = trajectories[i : i + config.batch_size]
                sequences = [
                    s
                    for t in chunk
                    for s in trajectory_sequences(t, self.engine.tokenizer, train_message_dicts=True)
                    if any(s.trained[1:])
                ]
                if not sequences:
                    continue
                start = time.perf_counter()
                with self.engine.exclusive():
                    metrics, stepped = self._sft_update(sequences, config)
                if stepped:
                    history.append(metrics | {"train_seconds": time.perf_counter() - start})
                    self.step += 1
                    if progress is not None:
                        progress(history[-1])
        return history

    def sft_loss(self, trajectories: list[Trajectory], micro_batch_tokens: int = 2048) -> dict[str, float]:
        """SFT's loss on ``trajectories`` without training on them (a validation set's): the mean negative
        log-likelihood per trained token (``loss``) over ``tokens`` of them."""
        tokenizer = self.engine.tokenizer
        sequences = [
            s for t in trajectories for s in trajectory_sequences(t, tokenizer, train_message_dicts=True)
            if any(s.trained[1:])
        ]  # fmt: skip
        for s in sequences:
            s.temperature = []
        total, tokens = 0.0, 0
        with self.engine.exclusive(), torch.no_grad():
            for mb in pack(sequences, micro_batch_tokens, self.engine.model.device):
                logp, _ = self._token_logprobs(mb)
                total -= float(logp.sum())
                tokens += len(mb.targets)
        return {"loss": total / tokens if tokens else math.nan, "tokens": tokens}

    def _sft_update(self, sequences: list[TrainingSequence], config: SFTConfig) -> tuple[dict[str, float], bool]:
        for s in sequences:  # SFT's targets are the model's own distribution (T = 1)
            s.temperature = []
        batches, n_tokens, _ = self._batches(sequences, config.micro_batch_tokens, config.attention)
        optimizer = self._optimizer(config.learning_rate, config.weight_decay)
        with self._training_mode(config.gradient_checkpointing):
            loss_sum = 0.0
            for mb in batches:
                logp, _ = self._token_logprobs(mb)
                loss = -logp.sum() / n_tokens
                loss.backward()
                self._accumulate()
                loss_sum += float(loss.detach())
            if self.replicas is not None:
                (loss_sum,) = self.replicas.sum([loss_sum])
            grad_norm, stepped = self._apply(config.max_grad_norm, optimizer)
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "tokens_trained": n_tokens,
            "sequences": len(sequences),
        }, stepped

    # ---- checkpoints -------------------------------------------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        """A snapshot to write (``RunStore.write``), taken on the engine's thread after a step: the fp32 masters
        (resuming is exact), the optimizer's state and the RNG states, by reference: no update may run until it
        is written (the backend holds the model's step lock)."""
        adapter_config = None
        if self.peft is not None:
            config = self.peft.peft_config["default"].to_dict()  # as peft's save_pretrained writes it
            adapter_config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
            adapter_config |= {"inference_mode": True, "base_model_name_or_path": self.engine.model.name_or_path}
        return Checkpoint(
            state=CheckpointState(step=self.step, rl_steps=self.rl_steps, trained_weights=self.trained_weights),
            weights=self.adapter_state(copy=False),
            optimizer=self.optimizer.state_dict() if self.optimizer is not None else None,
            rng=rng_state(),
            adapter_config=adapter_config,
        )

    def load(self, checkpoint: Checkpoint) -> None:
        """Continue from a checkpoint (``RunStore.read``): weights, optimizer (fresh if it has none), RNG states,
        step."""
        if self.replicas is not None:
            self.replicas.lead("load", checkpoint)
        weights = checkpoint.weights
        with self.engine.exclusive():
            if self.peft is not None:
                for p in self.params:  # load the fp32 values unrounded, then hand them to the masters
                    p.data = p.data.float()
                unexpected = set_peft_model_state_dict(self.peft, weights).unexpected_keys
                self._adopt_params()
            else:
                unexpected = sorted(set(weights) ^ set(self.names))
                if not unexpected:
                    with torch.no_grad():
                        for name, p, m in zip(self.names, self.params, self.master):
                            m.copy_(weights[name])
                            p.copy_(m)
            if unexpected:
                raise ValueError(
                    f"checkpoint of step {checkpoint.state.step} does not match this model's trained weights: {unexpected[:3]}"
                )
        self.optimizer = None
        if checkpoint.optimizer is not None:
            self._optimizer(1e-5, 0.0).load_state_dict(checkpoint.optimizer)
        if checkpoint.rng is not None:
            set_rng_state(checkpoint.rng)
        self.step, self.rl_steps = checkpoint.state.step, checkpoint.state.rl_steps

    def base_state(self) -> dict[str, torch.Tensor]:
        """The base model's trained weights keyed and typed as ``adapter_state`` gives them: a LoRA adapter whose B
        matrices are zero (it adds nothing), or with full fine-tuning the weights as the engine loaded them."""
        if self.peft is None:
            return {n: w.float() for n, w in zip(self.names, self._base_weights_from_disk(), strict=True)}
        state = self.adapter_state()
        return {k: torch.zeros_like(v) if ".lora_B." in k or ".lora_embedding_B" in k else v for k, v in state.items()}

    def adapter_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The trained weights as saved (fp32 masters): keyed like peft's adapter files, or like the model's own
        parameters with full fine-tuning; copies, or the masters themselves (``copy=False``)."""
        state = self._master_state()
        if self.peft is not None:
            state = get_peft_model_state_dict(self.peft, state_dict=state)
        return {k: v.detach().clone() if copy else v.detach() for k, v in state.items()}

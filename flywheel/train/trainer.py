"""The trainer: LoRA (via peft) or full fine-tuning on the very model object the engine samples from, one optimizer
step per call."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import PreTrainedModel

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.kv_attention import PackedBatch
from flywheel.inference.lora import fuse_lora_forward
from flywheel.runs import Checkpoint, CheckpointState
from flywheel.train.batch import MicroBatch, Sequence, pack, trajectory_sequences
from flywheel.train.config import LoraSettings, SFTConfig, TrainConfig
from flywheel.train.credit import credit_advantages, has_signal, total_reward
from flywheel.train.logprobs import token_logprobs
from flywheel.train.loss import policy_loss
from flywheel.types import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


ENTROPY_CHUNK = 256  # rows per entropy chunk: [256, V] temporaries instead of [K, V]


# models whose logits are exactly ``lm_head(model(...).last_hidden_state)``: no logit scaling or soft-capping
PLAIN_HEAD_MODELS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def fuses_head(model: PreTrainedModel) -> bool:
    """Whether the trainer takes log-probs from hidden states and the output embedding (``token_logprobs``) rather
    than from the model's logits: a known plain head, an ``nn.Linear`` without bias (not, e.g., a LoRA layer)."""
    head = model.get_output_embeddings()
    return type(model).__name__ in PLAIN_HEAD_MODELS and type(head) is torch.nn.Linear and head.bias is None


def _lora_config(settings: LoraSettings) -> LoraConfig:
    return LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=settings.targets, task_type="CAUSAL_LM",
    )


def load_for_serving(model: PreTrainedModel, checkpoint: Checkpoint) -> None:
    """Put a checkpoint's trained weights into a fresh copy of its base model, in place and in the model's dtype,
    exactly as the trainer's live model held them at that step (LoRA unmerged, as there)."""
    settings = checkpoint.state.lora
    if settings.full_finetune:
        unexpected = model.load_state_dict(checkpoint.weights, strict=False).unexpected_keys
    else:
        peft = get_peft_model(model, _lora_config(settings))  # injects the adapter into ``model`` in place
        fuse_lora_forward(model)
        unexpected = set_peft_model_state_dict(peft, checkpoint.weights).unexpected_keys
    if unexpected:
        raise ValueError(f"checkpoint of step {checkpoint.state.step} does not match model {model.name_or_path}: {unexpected[:3]}")
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


class Trainer:
    def __init__(self, engine: InferenceEngine, lora: LoraSettings | None = None):
        self.engine = engine
        self.lora = lora or LoraSettings()
        self.peft: PeftModel | None = None  # None: full fine-tuning of the engine's model itself
        with engine.exclusive():
            if self.lora.full_finetune:
                engine.model.requires_grad_(True)
            else:
                # peft swaps the target Linear layers in place, so the engine's forward uses the adapter too
                self.peft = get_peft_model(engine.model, _lora_config(self.lora))
                fuse_lora_forward(engine.model)
                engine.model.eval()  # the new layers start in train mode: no adapter dropout while sampling
        trained = self.peft if self.peft is not None else engine.model
        named = [(n, p) for n, p in trained.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.master: list[torch.Tensor] = [torch.empty_like(p, dtype=torch.float32) for p in self.params]
        self._adopt_params()
        # full fine-tuning's KL reference is the weights as they were (LoRA's: the adapter switched off)
        self._base = [p.detach().clone() for p in self.params] if self.peft is None else None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        self.autocast = engine.model.dtype == torch.bfloat16
        self.fused_head = fuses_head(engine.model)

    # ---- mixed precision ---------------------------------------------------------------------------------------
    # The trained weights (adapters, or all weights) live in the model's dtype, so the sampler uses them without
    # casting activations to fp32 and back at every layer (a quarter of bf16 decode time on a CPU); the optimizer
    # updates fp32 master copies, and gradients accumulate into those in fp32.

    def _adopt_params(self) -> None:
        """Masters <- the trained weights' current values; the trained weights -> the model's dtype."""
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                m.copy_(p)
                p.data = p.data.to(self.engine.model.dtype)

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
        """Train mode for one update; with ``checkpointing``, each decoder layer keeps only its input and recomputes
        the rest in the backward pass (activations of a 1024-token micro-batch: ~1.5 GB -> ~0.1 GB, ~30% more
        compute). The engine samples in eval mode, where neither applies."""
        model = self.engine.model
        if checkpointing:
            model.activation_checkpointing_enable()  # non-reentrant by default
        model.train()
        try:
            yield
        finally:
            model.eval()
            if checkpointing:
                model.activation_checkpointing_disable()
                model.disable_input_require_grads()  # the embedding hook enable() added; one more per step otherwise

    # ---- forward pieces --------------------------------------------------------------------------------------

    def _token_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities of the trained tokens (differentiable, fp32) and the entropy at each (a metric only)."""
        model = self.engine.model
        inputs = dict(
            input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, kv_batch=PackedBatch(mb.lengths, mb.context)
        )
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if self.fused_head:  # hidden states only at the positions that predict trained tokens: [K, d]
                hidden = model.model(**inputs).last_hidden_state[0, mb.positions]
            else:
                logits = model(**inputs, logits_to_keep=mb.positions).logits[0].float()  # [K, V]
        if self.fused_head:
            weight = model.get_output_embeddings().weight  # the head fuses_head checked
            dtype = torch.bfloat16 if self.autocast else weight.dtype
            return token_logprobs(hidden.to(dtype), weight.to(dtype), mb.targets)
        logp_all = torch.log_softmax(logits, dim=-1)
        with torch.no_grad():  # in chunks: [K, V] temporaries are ~0.4 GB each at K=2048
            entropy = torch.cat([-(c.exp() * c).sum(-1) for c in logp_all.detach().split(ENTROPY_CHUNK)])
        return logp_all.gather(-1, mb.targets[:, None])[:, 0], entropy

    def _optimizer(self, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay)
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = lr, weight_decay
        return self.optimizer

    def _apply(self, max_grad_norm: float, optimizer: torch.optim.Optimizer) -> float:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.master, max_grad_norm))
        if math.isfinite(grad_norm):
            optimizer.step()
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
        else:
            log.warning("non-finite gradient norm (%s): optimizer step skipped", grad_norm)
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # ---- RL ----------------------------------------------------------------------------------------------------

    def rl_step(self, groups: list[TrajectoryGroup], config: TrainConfig) -> dict[str, float]:
        start = time.perf_counter()
        rewards = [t.reward for g in groups for t in g.trajectories]
        # a group trains when its trajectories' total rewards (final + intermediate) differ
        usable = [g for g in groups if len(g.trajectories) > 1 and len({total_reward(t) for t in g.trajectories}) > 1]
        metrics: dict[str, float] = {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "reward_std": float(torch.tensor(rewards).std(unbiased=False)) if rewards else 0.0,
            "groups": len(groups),
            "groups_zero_variance": len(groups) - len(usable),
            "zero_variance_fraction": (len(groups) - len(usable)) / len(groups) if groups else 1.0,
        }
        advs = credit_advantages(usable, config)
        sequences = [
            s
            for g, group_adv in zip(usable, advs)
            for t, a in zip(g.trajectories, group_adv)
            if has_signal(a)  # no signal, no compute
            for s in trajectory_sequences(t, self.engine.tokenizer, a)
            if any(s.trained[1:])
        ]
        if not sequences:
            log.info("step skipped: no group has reward variance (%d groups), nothing to train", len(groups))
            return metrics | {"skipped": 1.0, "train_seconds": time.perf_counter() - start}
        with self.engine.exclusive():
            metrics |= self._rl_update(sequences, config)
        self.step += 1
        return metrics | {"skipped": 0.0, "train_seconds": time.perf_counter() - start}

    def _rl_update(self, sequences: list[Sequence], config: TrainConfig) -> dict[str, float]:
        batches = pack(sequences, config.micro_batch_tokens, self.engine.model.device)
        n_tokens = sum(len(mb.targets) for mb in batches)
        longest = max(sum(s.trained) for s in sequences)
        optimizer = self._optimizer(config.learning_rate, config.weight_decay)
        stats: dict[str, float] = {}
        with self._training_mode(config.gradient_checkpointing):
            refs = [self._reference(mb) for mb in batches] if config.beta > 0 else [None] * len(batches)
            # epoch 0 is on-policy: old log-probs = current ones (exact, immune to sampler/trainer rounding);
            # later epochs compare against those, so their ratios and clipping are real.
            olds: list[torch.Tensor | None] = [None] * len(batches)
            for epoch in range(config.epochs):
                loss_sum, entropy_sum, clip_sum, kl_sum = 0.0, 0.0, 0.0, 0.0
                for i, mb in enumerate(batches):
                    logp, entropy = self._token_logprobs(mb)
                    if olds[i] is None:
                        olds[i] = logp.detach()
                    loss, s = policy_loss(
                        logp, olds[i], mb.advantages, mb.seq, mb.n_seqs, config, ref_logp=refs[i],
                        batch_seqs=len(sequences), batch_tokens=n_tokens, max_tokens=longest,
                    )
                    loss.backward()
                    self._accumulate()
                    w = len(mb.targets) / n_tokens
                    loss_sum += float(loss.detach())
                    entropy_sum += float(entropy.mean()) * w
                    clip_sum += s["clip_fraction"] * w
                    kl_sum += s["kl"] * w
                grad_norm = self._apply(config.max_grad_norm, optimizer)
                stats = {"loss": loss_sum, "entropy": entropy_sum, "clip_fraction": clip_sum, "kl": kl_sum, "grad_norm": grad_norm}
        sampler_gap = [
            float((olds[i] - mb.old_logprobs).abs().mean()) for i, mb in enumerate(batches) if olds[i] is not None
        ]
        return stats | {
            "tokens_trained": n_tokens,
            "sequences": len(sequences),
            "micro_batches": len(batches),
            # how far the sampler's log-probs (bf16, cached decode) sit from the trainer's: a health signal
            "sampler_logprob_gap": sum(sampler_gap) / len(sampler_gap),
        }

    @torch.no_grad()
    def _reference(self, mb: MicroBatch) -> torch.Tensor:
        with self._base_weights():
            return self._token_logprobs(mb)[0]

    @contextlib.contextmanager
    def _base_weights(self) -> Iterator[None]:
        """The model as it was before training, for the duration of the block."""
        if self.peft is not None:
            with self.peft.disable_adapter():
                yield
            return
        trained = [p.data for p in self.params]
        for p, base in zip(self.params, self._base):
            p.data = base
        try:
            yield
        finally:
            for p, data in zip(self.params, trained):
                p.data = data

    # ---- SFT ---------------------------------------------------------------------------------------------------

    def sft(self, trajectories: list[Trajectory], config: SFTConfig) -> list[dict[str, float]]:
        """Cross-entropy on assistant turns (sampled choices and assistant message dicts); one entry per step."""
        history = []
        for _ in range(config.epochs):
            for i in range(0, len(trajectories), config.batch_size):
                chunk = trajectories[i : i + config.batch_size]
                sequences = [
                    s for t in chunk for s in trajectory_sequences(t, self.engine.tokenizer, train_message_dicts=True)
                    if any(s.trained[1:])
                ]
                if not sequences:
                    continue
                start = time.perf_counter()
                with self.engine.exclusive():
                    history.append(self._sft_update(sequences, config) | {"train_seconds": time.perf_counter() - start})
                self.step += 1
        return history

    def _sft_update(self, sequences: list[Sequence], config: SFTConfig) -> dict[str, float]:
        batches = pack(sequences, config.micro_batch_tokens, self.engine.model.device)
        n_tokens = sum(len(mb.targets) for mb in batches)
        optimizer = self._optimizer(config.learning_rate, config.weight_decay)
        with self._training_mode(config.gradient_checkpointing):
            loss_sum = 0.0
            for mb in batches:
                logp, _ = self._token_logprobs(mb)
                loss = -logp.sum() / n_tokens
                loss.backward()
                self._accumulate()
                loss_sum += float(loss.detach())
            grad_norm = self._apply(config.max_grad_norm, optimizer)
        return {"loss": loss_sum, "grad_norm": grad_norm, "tokens_trained": n_tokens, "sequences": len(sequences)}

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
            state=CheckpointState(step=self.step, lora=self.lora),
            weights=self.adapter_state(copy=False),
            optimizer=self.optimizer.state_dict() if self.optimizer is not None else None,
            rng=rng_state(),
            adapter_config=adapter_config,
        )

    def load(self, checkpoint: Checkpoint) -> None:
        """Continue from a checkpoint (``RunStore.read``): weights, optimizer (fresh if it has none), RNG states,
        step."""
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
                raise ValueError(f"checkpoint of step {checkpoint.state.step} does not match this model's trained weights: {unexpected[:3]}")
        self.optimizer = None
        if checkpoint.optimizer is not None:
            self._optimizer(1e-5, 0.0).load_state_dict(checkpoint.optimizer)
        if checkpoint.rng is not None:
            set_rng_state(checkpoint.rng)
        self.step = checkpoint.state.step

    def adapter_state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The trained weights as saved (fp32 masters): keyed like peft's adapter files, or like the model's own
        parameters with full fine-tuning; copies, or the masters themselves (``copy=False``)."""
        state = self._master_state()
        if self.peft is not None:
            state = get_peft_model_state_dict(self.peft, state_dict=state)
        return {k: v.detach().clone() if copy else v.detach() for k, v in state.items()}

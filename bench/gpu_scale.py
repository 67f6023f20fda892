"""The trainer and the local engine at real model shapes on one GPU (issue #40's G1 checks): random-weight Llama models
built from a config (no download), trained through Flywheel's own trainer (``Trainer.rl_step``: the same packing,
shared-prompt attention, chunked LM-head log-probs, loss and fp32 masters as every run), and sampled by the local
engine; TRL's GRPOTrainer on the same work where it can be imported.

    python3 bench/gpu_scale.py [--device cuda] [--shapes 0.5b,1.5b] [--out PATH] [--budget-s 300]
    .venv/bin/python bench/gpu_scale.py --quick --device cpu        # a tiny smoke run, seconds

Arms, each in its own try (a failing arm, an OOM or a missing package, is recorded and the next one runs), the
results JSON rewritten after each (a killed run still leaves what it measured):

- ``attention``: one layer's packed training attention (``kv_attention._packed``), forward + backward, on packed
  rows of the support job and of this work, with each shape's heads: the padded calls, and on a GPU the fused
  FlexAttention call (``attention="flex"``; compiled, its first run untimed).
- ``trainer <shape> <lora|full> mb=<tokens>``: ``rl_step`` on synthetic groups (P prompts x G completions of the
  given lengths, random ids, every group with reward variance): seconds per step, trained and packed tokens/s,
  model TFLOP/s, peak GPU memory, host syncs per step, a forward / backward / optimizer split and the top kernels
  from torch.profiler, and the time to write and read the trained weights as safetensors.
- ``rl step <shape> lora``: the RL step end to end in-process (no HTTP): the engine samples P prompts x G
  completions of exactly N tokens at 64 rows (decode tokens/s, GPU busy from NVML at 10 Hz), then ``rl_step``.
- ``trl <shape> lora``: TRL's GRPOTrainer on the same prompts, lengths, LoRA and loss (HF generate, no vLLM).
- ``fsdp2 world size 1``: "not built" (no FSDP2 trainer yet).

Model FLOPs per step: 2 x (decoder matmul parameters x packed tokens + LM-head parameters x trained tokens) per
pass; full fine-tuning counts 3 passes (forward, input gradients, weight gradients), LoRA 2 (the frozen base gets no
weight gradients; the adapter's own FLOPs, under 1%, are left out); attention scores are not counted.

Needs no network: the tokenizer (and the SmolLM2 config the shapes start from) is read from ``--tokenizer``
(default: .gpu/tokenizer if present, else the embedded model's converted checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from machine import describe  # bench/machine.py
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob
from safetensors.torch import load_file, save_file
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from trl_side import grpo_config, train_lora  # bench/trl_side.py

from flywheel.inference import kv_attention
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL, best_dtype, resolve_model
from flywheel.inference.sampling import SamplingParams
from flywheel.train.batch import pack, trajectory_sequences
from flywheel.train.config import TrainConfig, TrainedWeights
from flywheel.train.trainer import Trainer
from flywheel.types import Trajectory, TrajectoryGroup, completion_token_count, set_sampled_tokens

REPO = Path(__file__).resolve().parent.parent
LORA = TrainedWeights(rank=16, alpha=32)  # as bench/step_time.py: all seven projections
LEARNING_RATE = 5e-5

# Llama shapes over SmolLM2's config and tokenizer (vocab 49,152, tied embeddings): Qwen2.5-0.5B's and -1.5B's widths
# and depths (~0.40B and ~1.39B parameters with this vocabulary), and a tiny one for a CPU smoke run.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    ),
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
    ),
}

# Arms that slot in once their code exists: (name, why not now). An arm is added above them when it is built.
NOT_BUILT = [
    ("fsdp2 world size 1 vs plain", "an FSDP2 trainer host (torchrun)"),
]


# ---- results -----------------------------------------------------------------------------------------------------


class Results:
    """The run's JSON, rewritten (atomically) after every arm."""

    def __init__(self, path: Path, header: dict[str, Any], budget_s: float):
        self.path, self.data, self.start, self.budget_s = path, header | {"arms": []}, time.monotonic(), budget_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def arm(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Run one arm: its result, or its error, is recorded; nothing it raises stops the run."""
        entry: dict[str, Any] = {"arm": name}
        if self.elapsed() > self.budget_s:
            entry |= {"status": "skipped", "reason": f"time budget of {self.budget_s:.0f} s spent"}
        else:
            say(f"--- {name} (at {self.elapsed():.0f} s)")
            start = time.perf_counter()
            try:
                entry |= {"status": "ok"} | fn()
            except Exception as exc:  # an arm's failure (OOM, a missing package) is a result, not the end of the run
                entry |= {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:2000]}
                say(traceback.format_exc(limit=6))
            entry["arm_seconds"] = round(time.perf_counter() - start, 2)
            free_memory()
        return self.record(entry)

    def record(self, entry: dict[str, Any]) -> dict[str, Any]:
        say(f"    {entry['arm']}: {entry['status']} {compact(entry)}")
        self.data["arms"].append(entry)
        self.save()
        return entry


def say(text: str) -> None:
    print(text, flush=True)


def compact(entry: dict[str, Any]) -> str:
    keys = ("error", "reason", "step_s", "tokens_per_s", "tflops", "peak_gib", "decode_tokens_per_s", "gpu_busy")
    return ", ".join(f"{k}={entry[k]}" for k in keys if k in entry and not isinstance(entry[k], dict))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": sys.version.split()[0], "cuda": torch.version.cuda}
    for name in ("torch", "transformers", "peft", "accelerate", "trl", "datasets", "pyarrow", "openai", "pydantic"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def commit(given: str | None) -> str | None:
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # the device machine gets the working tree without .git: pass --commit


# ---- models and work ---------------------------------------------------------------------------------------------


def build_model(shape: str, tokenizer_dir: Path, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """A random-weight Llama of ``shape`` over SmolLM2's config (vocab, special ids, RoPE), made on ``device``."""
    config = AutoConfig.from_pretrained(tokenizer_dir)
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def matmul_params(model: PreTrainedModel) -> tuple[int, int]:
    """(decoder matmul parameters: every Linear weight in the layers, the LM head's parameters)."""
    decoder = sum(
        m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear) and m.weight.ndim == 2
    )
    return decoder, model.get_output_embeddings().weight.numel()


def as_choice(prompt: list[int], completion: list[int], logprobs: list[float], temperature: float) -> Choice:
    """A sampled turn as the server records it: exact ids, the sampler's log-probs and temperature."""
    content = [ChatCompletionTokenLogprob(token="", logprob=lp, top_logprobs=[]) for lp in logprobs]
    choice = Choice(
        index=0,
        finish_reason="length",
        message=ChatCompletionMessage(role="assistant", content=""),
        logprobs=ChoiceLogprobs(content=content),
    )
    set_sampled_tokens(choice, prompt, completion, temperature)
    return choice


def synthetic_groups(
    vocab: int, prompts: int, group: int, prompt_tokens: int, new_tokens: int, seed: int = 0
) -> list[TrajectoryGroup]:
    """P groups of G completions after a shared prompt, random ids; rewards 0..G-1 so every group trains, sampler
    log-probs those of a uniform distribution (what a random-weight model is close to)."""
    rng = random.Random(seed)
    uniform = -math.log(vocab)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(100, vocab) for _ in range(prompt_tokens)]
        trajectories = []
        for j in range(group):
            completion = [rng.randrange(100, vocab) for _ in range(new_tokens)]
            choice = as_choice(prompt, completion, [uniform] * new_tokens, 1.0)
            trajectories.append(
                Trajectory(messages_and_choices=[{"role": "user", "content": "synthetic"}, choice], reward=float(j))
            )
        out.append(TrajectoryGroup(trajectories))
    return out


def packed_tokens(groups: list[TrajectoryGroup], tokenizer: PreTrainedTokenizerBase, micro_batch_tokens: int) -> int:
    """Tokens the trainer's forward runs over: the groups packed as ``rl_step`` packs them (shared prompts once)."""
    sequences = [s for g in groups for t in g.trajectories for s in trajectory_sequences(t, tokenizer, 1.0)]
    return sum(mb.input_ids.shape[1] for mb in pack(sequences, micro_batch_tokens))


def word_prompts(tokenizer: PreTrainedTokenizerBase, n: int, tokens: int, seed: int = 1) -> list[str]:
    """``n`` prompts of random whole-word tokens, about ``tokens`` long once tokenized: text, so that TRL (which
    tokenizes prompts itself) and Flywheel's engine get the same ids."""
    rng = random.Random(seed)
    words = sorted(
        t for t in tokenizer.get_vocab() if t.startswith("Ġ") and t[1:].isascii() and t[1:].isalpha() and len(t) > 3
    )
    return [tokenizer.convert_tokens_to_string(rng.choices(words, k=tokens)).strip() for _ in range(n)]


def variety(text: str) -> float:
    """The reward on both sides: distinct characters over length (random-weight completions differ in it)."""
    return len(set(text)) / max(len(text), 1)


# ---- measurement helpers -------------------------------------------------------------------------------------------


class GpuBusy:
    """Mean NVML utilisation (% of time a kernel ran, as nvidia-smi shows) sampled at 10 Hz while the block runs."""

    def __init__(self, device: torch.device):
        self.device, self.samples, self.error = device, [], None
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.samples.append(torch.cuda.utilization(self.device))
            except Exception as exc:  # no NVML (pynvml) on the machine: reported, not fatal
                self.error = f"{type(exc).__name__}: {exc}"
                return

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        thread = threading.Thread(target=self._run, daemon=True) if self.device.type == "cuda" else None
        if thread:
            thread.start()
        try:
            yield
        finally:
            self._stop.set()
            if thread:
                thread.join()

    def result(self) -> float | str | None:
        return self.error or (round(statistics.mean(self.samples), 1) if self.samples else None)


KERNEL_KINDS = [  # first match wins: kernel name fragments -> what the time went to
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "sm90_", "wgmma")),
    ("softmax/norm/reduce", ("softmax", "norm", "reduce", "logsumexp")),
    ("copy/cast/fill", ("copy", "cast", "memcpy", "memset", "fill", "catarray")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
]


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in lower for p in parts)), "other")


def profile_split(prof: profile, wall_s: float, device: torch.device, top: int = 8) -> dict[str, Any]:
    """Where one profiled step's time went: GPU kernel time by kind and the top kernels (CPU ops on a CPU)."""
    if device.type == "cuda":
        kernels: Counter[str] = Counter()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name] += event.time_range.elapsed_us()
        total_us = sum(kernels.values())
        kinds: Counter[str] = Counter()
        for name, us in kernels.items():
            kinds[kernel_kind(name)] += us
        return {
            "kernel_seconds": round(total_us / 1e6, 4),
            "kernel_busy_of_wall": round(total_us / 1e6 / wall_s, 3),  # under the profiler: a lower bound
            "by_kind": {k: round(v / total_us, 3) for k, v in kinds.most_common()} if total_us else {},
            "top_kernels": [(name[:90], round(us / 1e3, 2)) for name, us in kernels.most_common(top)],
        }
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"top_cpu_ops_ms": [(e.key[:90], round(e.self_cpu_time_total / 1e3, 2)) for e in ops]}


@contextlib.contextmanager
def timed_methods(trainer: Trainer, device: torch.device, names: dict[str, str]) -> Iterator[dict[str, float]]:
    """Seconds spent in some of the trainer's methods, each wrapped (on this instance only) between device syncs."""
    spent = dict.fromkeys(names.values(), 0.0)

    def wrap(method: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            sync(device)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                sync(device)
                spent[label] += time.perf_counter() - start

        return timed

    for name, label in names.items():
        setattr(trainer, name, wrap(getattr(trainer, name), label))
    try:
        yield spent
    finally:
        for name in names:
            delattr(trainer, name)  # the class's method again


@contextlib.contextmanager
def counting_syncs(device: torch.device) -> Iterator[dict[str, int | None]]:
    """Host-device synchronisations torch flags (``set_sync_debug_mode``) inside the block (CUDA only)."""
    counts: dict[str, int | None] = {"syncs": None}
    if device.type != "cuda":
        yield counts
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
            counts["syncs"] = sum("synchroniz" in str(w.message) for w in caught)


# ---- arms ----------------------------------------------------------------------------------------------------------


def attention_arm(shapes: list[str], work: argparse.Namespace, device: torch.device, reps: int) -> dict[str, Any]:
    """One layer's ``kv_attention._packed`` forward + backward (best of ``reps``) on packed rows."""
    dtype = torch.bfloat16 if device.type == "cuda" else best_dtype()
    layouts = [
        ("support RL row [914, 384, 125 x 3, 210]", [914, 384, 125, 125, 125, 210], [-1, 0, 0, 0, 0, 0]),
        (
            f"this work's group [{work.prompt_tokens} + {work.group} x {work.new_tokens}]",
            [work.prompt_tokens] + [work.new_tokens] * work.group,
            [-1] + [0] * work.group,
        ),
        (
            f"[{work.prompt_tokens} + {work.group} x {2 * work.new_tokens}]",
            [work.prompt_tokens] + [2 * work.new_tokens] * work.group,
            [-1] + [0] * work.group,
        ),
    ]
    rows = []
    for shape in shapes:
        s = SHAPES[shape]
        for name, lengths, context in layouts:
            total = sum(lengths)
            q, k, v = (
                torch.randn(1, h, total, s["head_dim"], device=device, dtype=dtype, requires_grad=True)
                for h in (s["num_attention_heads"], s["num_key_value_heads"], s["num_key_value_heads"])
            )
            row = {"shape": shape, "layout": name, "tokens": total}
            # the padded calls; FlexAttention's one fused call (compiled; its first run compiles: not timed), where
            # it has a backward (GPUs)
            for key, flex in (("packed_fwd_bwd_ms", False), ("flex_fwd_bwd_ms", True)):
                if flex and device.type != "cuda":
                    row[key] = "no FlexAttention backward on CPU"
                    continue
                batch = kv_attention.PackedBatch(lengths, context, flex=flex)  # built once, as for a model's layers
                best = math.inf
                for _ in range(reps + 1):
                    q.grad = k.grad = v.grad = None
                    sync(device)
                    start = time.perf_counter()
                    out = kv_attention._packed(0, q, k, v, batch, s["head_dim"] ** -0.5)
                    out.float().sum().backward()
                    sync(device)
                    best = min(best, time.perf_counter() - start)
                row[key] = round(best * 1e3, 3)
            rows.append(row)
            say(f"    {shape} {name}: {row}")
    return {"rows": rows}


class TrainerArms:
    """One model of a shape and mode with its trainer; ``run(mb)`` measures ``rl_step`` at one micro-batch size."""

    def __init__(self, shape: str, mode: str, args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase):
        self.shape, self.mode, self.args, self.tokenizer = shape, mode, args, tokenizer
        self.device = torch.device(args.device)
        model = build_model(shape, args.tokenizer, self.device, args.dtype)
        self.decoder_params, self.head_params = matmul_params(model)
        self.params = sum(p.numel() for p in model.parameters())
        self.engine = InferenceEngine(model, tokenizer)
        weights = LORA if mode == "lora" else TrainedWeights(mode="full")
        self.trainer = Trainer(self.engine, weights)
        self.trained_params = sum(p.numel() for p in self.trainer.params)
        self.groups = synthetic_groups(
            model.config.vocab_size, args.prompts, args.group, args.prompt_tokens, args.new_tokens
        )

    def close(self) -> None:
        self.engine.close()
        del self.trainer, self.engine

    def step(self, config: TrainConfig) -> tuple[float, dict[str, float]]:
        sync(self.device)
        start = time.perf_counter()
        metrics = self.trainer.rl_step(self.groups, config)
        sync(self.device)
        if metrics.get("skipped"):
            raise RuntimeError(f"rl_step skipped the step: {metrics}")
        return time.perf_counter() - start, metrics

    def run(self, micro_batch_tokens: int) -> dict[str, Any]:
        args, device = self.args, self.device
        config = TrainConfig(learning_rate=LEARNING_RATE, loss="dapo", micro_batch_tokens=micro_batch_tokens)
        packed = packed_tokens(self.groups, self.tokenizer, micro_batch_tokens)
        for _ in range(args.warmup):
            self.step(config)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, metrics = [], {}
        for _ in range(args.steps):
            seconds, metrics = self.step(config)
            times.append(seconds)
        step_s = statistics.median(times)
        trained = int(metrics["tokens_trained"])
        passes = 3 if self.mode == "full" else 2
        flops = 2 * passes * (self.decoder_params * packed + self.head_params * trained)
        result: dict[str, Any] = {
            "shape": self.shape,
            "mode": self.mode,
            "micro_batch_tokens": micro_batch_tokens,
            "params": self.params,
            "trained_params": self.trained_params,
            "micro_batches": int(metrics["micro_batches"]),
            "packed_tokens": packed,
            "trained_tokens": trained,
            "step_s": round(step_s, 4),
            "step_s_all": [round(t, 4) for t in times],
            "tokens_per_s": round(trained / step_s),
            "packed_tokens_per_s": round(packed / step_s),
            "tflops": round(flops / step_s / 1e12, 1),
            "flops_per_step": flops,
        }
        if device.type == "cuda":
            result["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        say(f"    timed: {result['step_s_all']} s, {result['tokens_per_s']} trained tok/s, {result['tflops']} TFLOP/s")
        # one instrumented step: forward (the trainer's _token_logprobs) and optimizer (_apply) between syncs
        names = {"_token_logprobs": "forward", "_apply": "optimizer"}
        with timed_methods(self.trainer, device, names) as spent:
            total, _ = self.step(config)
        result["split_s"] = {k: round(v, 4) for k, v in spent.items()} | {
            "backward_and_rest": round(total - sum(spent.values()), 4),
            "total": round(total, 4),
        }
        # one profiled step, its host syncs counted
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof, counting_syncs(device) as counts:
            wall, _ = self.step(config)
        result["host_syncs_per_step"] = counts["syncs"]
        result["profile"] = profile_split(prof, wall, device) | {"wall_s": round(wall, 4)}
        say(f"    split {result['split_s']}, host syncs {counts['syncs']}")
        for name, ms in result["profile"].get("top_kernels") or result["profile"].get("top_cpu_ops_ms", []):
            say(f"      {ms:9.2f} ms  {name}")
        return result

    def weights_io(self) -> dict[str, Any]:
        """Seconds to write and read the trained weights (fp32, as a checkpoint holds them) as safetensors."""
        state = self.trainer.adapter_state()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "weights.safetensors"
            start = time.perf_counter()
            save_file(state, str(path))
            written = time.perf_counter() - start
            start = time.perf_counter()
            load_file(str(path))
            read = time.perf_counter() - start
            size = path.stat().st_size
        return {"bytes": size, "write_s": round(written, 3), "read_s": round(read, 3)}


def trainer_arms(shape: str, mode: str, args: argparse.Namespace, tokenizer, results: Results) -> None:
    holder: dict[str, TrainerArms] = {}

    def build() -> dict[str, Any]:
        start = time.perf_counter()
        arms = holder["arms"] = TrainerArms(shape, mode, args, tokenizer)
        return {
            "params": arms.params,
            "trained_params": arms.trained_params,
            "build_s": round(time.perf_counter() - start, 2),
        }

    if results.arm(f"build {shape} {mode}", build)["status"] != "ok":
        return
    arms = holder.pop("arms")
    try:
        for mb in args.micro_batch_tokens:
            results.arm(f"trainer {shape} {mode} mb={mb}", lambda mb=mb: arms.run(mb))
        results.arm(f"weights io {shape} {mode}", arms.weights_io)
    finally:
        arms.close()


def rl_step_arm(shape: str, args: argparse.Namespace, tokenizer, prompts: list[str]) -> dict[str, Any]:
    """The RL step in-process: the engine samples every group (P requests of n=G at once: P x G rows), then
    ``rl_step`` trains them. The first step is a short warm-up."""
    device = torch.device(args.device)
    model = build_model(shape, args.tokenizer, device, args.dtype)
    engine = InferenceEngine(model, tokenizer)
    try:
        trainer = Trainer(engine, LORA)
        config = TrainConfig(learning_rate=LEARNING_RATE, loss="dapo")
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]

        async def sample(new_tokens: int, seed: int) -> list[TrajectoryGroup]:
            def params(i: int) -> SamplingParams:
                return SamplingParams(
                    temperature=1.0, max_tokens=new_tokens, n=args.group, logprobs=True, ignore_eos=True, seed=seed + i
                )

            results = await asyncio.gather(*(engine.generate(p, params(i)) for i, p in enumerate(ids)))
            return [
                TrajectoryGroup(
                    Trajectory(
                        messages_and_choices=[
                            {"role": "user", "content": text},
                            as_choice(p, c.token_ids, c.logprobs, 1.0),
                        ],
                        reward=variety(c.text),
                    )
                    for c in completions
                )
                for text, p, completions in zip(prompts, ids, results)
            ]

        steps = []
        for i, new_tokens in enumerate([min(32, args.new_tokens)] + [args.new_tokens] * args.rl_steps):
            busy = GpuBusy(device)
            sync(device)
            start = time.perf_counter()
            with busy.measure():
                groups = asyncio.run(sample(new_tokens, seed=1000 * i))
                sync(device)
            sampled = time.perf_counter()
            metrics = trainer.rl_step(groups, config)
            sync(device)
            end = time.perf_counter()
            rows = sum(len(g.trajectories) for g in groups)
            drawn = sum(completion_token_count(t.messages_and_choices[-1]) for g in groups for t in g.trajectories)
            steps.append(
                {
                    "warmup": i == 0,
                    "rows": rows,
                    "new_tokens": new_tokens,
                    "sample_s": round(sampled - start, 3),
                    "train_s": round(end - sampled, 3),
                    "step_s": round(end - start, 3),
                    "decode_tokens_per_s": round(drawn / (sampled - start)),
                    "gpu_busy_sampling": busy.result(),
                    "sequences_trained": int(metrics.get("sequences", 0)),
                    "sampler_logprob_gap": metrics.get("sampler_logprob_gap"),
                }
            )
            say(f"    step {i}: {steps[-1]}")
        timed = [s for s in steps if not s["warmup"]]
        return {
            "shape": shape,
            "prompt_tokens_mean": round(statistics.mean(len(p) for p in ids), 1),
            "step_s": median([s["step_s"] for s in timed]),
            "sample_s": median([s["sample_s"] for s in timed]),
            "train_s": median([s["train_s"] for s in timed]),
            "decode_tokens_per_s": median([s["decode_tokens_per_s"] for s in timed]),
            "gpu_busy": [s["gpu_busy_sampling"] for s in timed],
            "steps": steps,
        }
    finally:
        engine.close()


def trl_arm(shape: str, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """TRL's GRPOTrainer on the rl-step arm's work: the same prompts (as text), G completions of exactly N tokens,
    the same reward, LoRA and DAPO loss, beta 0; HF generate (no vLLM), gradient checkpointing off. The first step
    is a warm-up."""
    if importlib.util.find_spec("trl") is None:
        return {"status": "skipped", "reason": "trl is not installed here (wheels: trl, datasets, dill, multiprocess)"}
    from transformers import TrainerCallback

    device = torch.device(args.device)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, a, state, control, **kwargs):
            sync(device)
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):
            sync(device)
            self.times.append(time.perf_counter() - self.start)

    def reward(completions, **_):
        return [variety(c) for c in completions]

    steps = 1 + args.rl_steps
    rows = [{"prompt": p} for _ in range(steps) for p in prompts]
    with tempfile.TemporaryDirectory() as out_dir:
        config = grpo_config(
            output_dir=out_dir,
            use_cpu=device.type != "cuda",
            bf16=args.dtype == torch.bfloat16,
            steps=steps,
            learning_rate=LEARNING_RATE,
            prompts=len(prompts),
            group=args.group,
            new_tokens=args.new_tokens,
        )
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        model = build_model(shape, args.tokenizer, device, args.dtype)
        timer = StepTimer()
        train_lora(model, tokenizer, reward, config, rows, LORA, timer)
        del model
    timed = timer.times[1:]
    return {
        "shape": shape,
        "step_s": median(timed),
        "step_s_all": [round(t, 3) for t in timer.times],
    }


# ---- driver ---------------------------------------------------------------------------------------------------------


def markdown(data: dict[str, Any]) -> str:
    lines = [
        f"device: {data['machine'].get('gpu') or data['machine'].get('cpu')}; torch {data['versions']['torch']}, "
        f"transformers {data['versions']['transformers']}, commit {data['commit']}",
        f"work: {data['work']}",
        "",
        "| arm | status | step s | trained tok/s | TFLOP/s | peak GiB | split (fwd / bwd+rest / opt s) | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in data["arms"]:
        split = a.get("split_s")
        split_text = f"{split['forward']} / {split['backward_and_rest']} / {split['optimizer']}" if split else ""
        notes = a.get("error") or a.get("reason") or ""
        if "profile" in a and "by_kind" in a["profile"]:
            kinds = ", ".join(f"{k} {v:.0%}" for k, v in list(a["profile"]["by_kind"].items())[:4])
            notes = f"kernels {a['profile']['kernel_busy_of_wall']:.0%} of wall: {kinds}; syncs {a.get('host_syncs_per_step')}"
        if "decode_tokens_per_s" in a:
            notes = (
                f"sample {a['sample_s']} s + train {a['train_s']} s; decode {a['decode_tokens_per_s']} tok/s at "
                f"{a['steps'][-1]['rows']} rows, GPU busy {a['gpu_busy']} %"
            )
        if "rows" in a and a["arm"] == "attention":
            notes = "; ".join(f"{r['shape']} {r['layout']}: {r['packed_fwd_bwd_ms']} ms" for r in a["rows"])
        if "write_s" in a:
            notes = f"{a['bytes'] / 2**20:.0f} MiB: write {a['write_s']} s, read {a['read_s']} s"
        lines.append(
            f"| {a['arm']} | {a['status']} | {a.get('step_s', '')} | {a.get('tokens_per_s', '')} | "
            f"{a.get('tflops', '')} | {a.get('peak_gib', '')} | {split_text} | {notes} |"
        )
    fly = next((a for a in data["arms"] if a["arm"].startswith("rl step") and a["status"] == "ok"), None)
    trl = next((a for a in data["arms"] if a["arm"].startswith("trl") and a["status"] == "ok"), None)
    if fly and trl:
        lines.append(f"\nTRL / Flywheel RL step time: {trl['step_s'] / fly['step_s']:.2f}x (goal >= 1.5x)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", help=f"comma-separated, of {sorted(SHAPES)} (default 0.5b,1.5b; --quick: tiny)")
    ap.add_argument("--quick", action="store_true", help="tiny shape and work: a smoke run in seconds on a CPU")
    ap.add_argument("--out", type=Path, help="results JSON (default bench/results/gpu_scale-<time>.json)")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer + config dir (default .gpu/tokenizer or the embedded)")
    ap.add_argument("--commit", help="the tree's commit, recorded in the results (default: git rev-parse HEAD)")
    ap.add_argument("--budget-s", type=float, default=300, help="arms starting after this many seconds are skipped")
    ap.add_argument("--prompts", type=int, help="prompts per step (default 8; --quick 2)")
    ap.add_argument("--group", type=int, help="completions per prompt (default 8; --quick 4)")
    ap.add_argument("--prompt-tokens", type=int, help="default 256; --quick 32")
    ap.add_argument("--new-tokens", type=int, help="tokens per completion (default 256; --quick 16)")
    ap.add_argument("--micro-batch-tokens", help="comma-separated (default 2048,16384; --quick 256,2048)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed trainer steps per arm")
    ap.add_argument("--steps", type=int, help="timed trainer steps per arm (default 3; --quick 2)")
    ap.add_argument("--rl-steps", type=int, default=2, help="timed RL steps (after a short warm-up), ours and TRL's")
    ap.add_argument("--skip", default="", help="comma-separated arm kinds to leave out: attention,trainer,rl,trl")
    args = ap.parse_args()
    quick = args.quick
    shapes = (args.shapes or ("tiny" if quick else "0.5b,1.5b")).split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"--shapes: unknown {unknown}; known: {sorted(SHAPES)}")
    args.prompts = args.prompts or (2 if quick else 8)
    args.group = args.group or (4 if quick else 8)
    args.prompt_tokens = args.prompt_tokens or (32 if quick else 256)
    args.new_tokens = args.new_tokens or (16 if quick else 256)
    args.steps = args.steps or (2 if quick else 3)
    args.micro_batch_tokens = [
        int(x) for x in (args.micro_batch_tokens or ("256,2048" if quick else "2048,16384")).split(",")
    ]
    skip = set(filter(None, args.skip.split(",")))
    if unknown := skip - {"attention", "trainer", "rl", "trl"}:
        ap.error(f"--skip: unknown {sorted(unknown)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device here")
    args.dtype = torch.bfloat16 if device.type == "cuda" else best_dtype()
    default_tokenizer = REPO / ".gpu" / "tokenizer"
    args.tokenizer = args.tokenizer or (
        default_tokenizer if default_tokenizer.exists() else resolve_model(EMBEDDED_MODEL).path
    )
    out = args.out or REPO / "bench" / "results" / time.strftime("gpu_scale-%Y%m%d-%H%M%S.json")
    warnings.filterwarnings("ignore", category=FutureWarning)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    header = {
        "script": "bench/gpu_scale.py",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv[1:],
        "machine": describe(),
        "versions": versions(),
        "commit": commit(args.commit),
        "work": {
            "shapes": {s: SHAPES[s] for s in shapes},
            "vocab": len(tokenizer),
            "prompts": args.prompts,
            "group": args.group,
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "micro_batch_tokens": args.micro_batch_tokens,
            "dtype": str(args.dtype),
            "lora": LORA.model_dump(),
            "loss": "dapo",
            "warmup": args.warmup,
            "steps": args.steps,
            "rl_steps": args.rl_steps,
            "flops": "2 x passes x (decoder matmul params x packed tokens + head params x trained tokens); "
            "passes: full 3, LoRA 2; attention scores not counted",
        },
    }
    results = Results(out, header, args.budget_s)
    say(f"gpu_scale: {header['machine']}\n{header['versions']}\nwork: {header['work']}\nresults: {out}")

    if "attention" not in skip:
        results.arm("attention", lambda: attention_arm(shapes, args, device, reps=3))
    prompts = word_prompts(tokenizer, args.prompts, args.prompt_tokens)
    first, rest = shapes[0], shapes[1:]
    if "trainer" not in skip:
        for mode in ("lora", "full"):
            trainer_arms(first, mode, args, tokenizer, results)
    if "rl" not in skip:
        results.arm(f"rl step {first} lora", lambda: rl_step_arm(first, args, tokenizer, prompts))
    if "trl" not in skip:
        results.arm(f"trl {first} lora", lambda: trl_arm(first, args, prompts))
    if "trainer" not in skip:
        for shape in rest:
            for mode in ("lora", "full"):
                trainer_arms(shape, mode, args, tokenizer, results)
    for name, missing in NOT_BUILT:
        results.record({"arm": name, "status": "not built", "reason": f"needs {missing}"})

    results.data["finished_s"] = round(results.elapsed(), 1)
    results.save()
    say("\n" + markdown(results.data) + f"\n\nraw: {out}")


if __name__ == "__main__":
    main()

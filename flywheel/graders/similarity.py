"""Text similarity metrics of the ``text_similarity`` grader, each a score in [0, 1], from well-kept libraries.

- ``fuzzy_match``: rapidfuzz ``WRatio`` on normalised text (lower case, no punctuation) / 100.
- ``bleu``: sacrebleu sentence BLEU (13a tokenizer, exponential smoothing) / 100.
- ``gleu``: nltk's sentence GLEU (Google BLEU) on 13a tokens.
- ``meteor``: nltk's METEOR on 13a tokens with exact and Porter-stem matching. Its third stage, WordNet synonyms,
  is used when NLTK's WordNet data is installed (``nltk.download("wordnet")`` where a network allows); the data is
  not on PyPI, so without it METEOR matches exact words and stems only and scores synonyms lower than OpenAI's.
- ``rouge_1`` .. ``rouge_5``, ``rouge_l``: Google's rouge-score F-measure (its tokenizer: lower case, alphanumerics).
- ``cosine``: see flywheel/graders/embedding.py (a model, so it is async and lives there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def fuzzy_match(text: str, reference: str) -> float:
    from rapidfuzz import fuzz, utils

    return fuzz.WRatio(text, reference, processor=utils.default_process) / 100.0


def bleu(text: str, reference: str) -> float:
    import sacrebleu

    return sacrebleu.sentence_bleu(text, [reference]).score / 100.0


@functools.cache
def _tokenizer() -> Callable[[str], str]:
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()


def _tokens(text: str) -> list[str]:
    return _tokenizer()(text).split()


def gleu(text: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    hypothesis, ref = _tokens(text), _tokens(reference)
    if not hypothesis or not ref:  # nltk divides by zero on empty input
        return float(hypothesis == ref)
    return float(sentence_gleu([ref], hypothesis))


class _NoSynonyms:
    """Stands in for NLTK's WordNet reader when its data is absent: no synonym matches."""

    def synsets(self, word: str, *args: Any, **kwargs: Any) -> list[Any]:
        return []


@functools.cache
def _wordnet() -> Any:
    try:
        from nltk.corpus import wordnet

        wordnet.ensure_loaded()
        return wordnet
    except LookupError:
        return _NoSynonyms()


def meteor_uses_synonyms() -> bool:
    """Whether METEOR has WordNet synonyms here (else exact and stem matches only)."""
    return not isinstance(_wordnet(), _NoSynonyms)


def meteor(text: str, reference: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    hypothesis, ref = _tokens(text), _tokens(reference)
    if not hypothesis or not ref:
        return float(hypothesis == ref)
    return float(meteor_score([ref], hypothesis, wordnet=_wordnet()))


@functools.cache
def _rouge_scorer() -> Any:
    from rouge_score.rouge_scorer import RougeScorer

    return RougeScorer(["rouge1", "rouge2", "rouge3", "rouge4", "rouge5", "rougeL"])


def rouge(kind: str, text: str, reference: str) -> float:
    """``kind``: "1".."5" or "l"."""
    key = f"rouge{kind.upper()}"
    return float(_rouge_scorer().score(reference, text)[key].fmeasure)


def similarity(metric: str, text: str, reference: str) -> float:
    """Any metric but cosine, by its OpenAI name; clipped to [0, 1] (BLEU of identical texts is 1 + 4e-16)."""
    if metric.startswith("rouge_"):
        score = rouge(metric.removeprefix("rouge_"), text, reference)
    else:
        functions: dict[str, Callable[[str, str], float]] = {
            "fuzzy_match": fuzzy_match, "bleu": bleu, "gleu": gleu, "meteor": meteor,
        }  # fmt: skip
        score = functions[metric](text, reference)
    return min(1.0, max(0.0, score))

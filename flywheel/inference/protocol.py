"""What the server and the gateway need from an engine that samples (``SamplingEngine``): token ids in, token events
with their log-probs out, the tokenizer the gateway splices turns with, and the context it must fit. The embedded
``InferenceEngine`` is one, ``VLLMEngine`` (vllm_engine.py, over vLLM servers) another, so that the server, the
gateway and the registry never know which one answers. An engine that samples elsewhere reports the other side's
faults as ``SamplerUnavailableError`` (a 502). Light: no torch (its types are named for checkers only)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from flywheel.inference.engine import Completion, TokenEvent
    from flywheel.inference.sampling import SamplingParams


class SamplerUnavailableError(RuntimeError):
    """A sampler this engine relies on failed: a server answering 5xx, a timeout, a dropped stream, a refused
    connection. The message names the server; the API answers 502 (the fault is not the client's)."""

    def __init__(self, url: str, problem: str):
        self.url = url
        super().__init__(f"The sampling server at {url} failed: {problem}")


@runtime_checkable
class SamplingEngine(Protocol):
    tokenizer: PreTrainedTokenizerBase  # the gateway renders and splices turns with it: the engine's own
    eos_ids: frozenset[int]
    context_length: int

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """A ``ContextOverflowError`` (a 400 naming the numbers) when the prompt and ``max_tokens`` cannot fit."""
        ...

    def stream(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """Token events for all ``params.n`` choices as they are sampled, with their log-probs."""
        ...

    async def generate(self, prompt: list[int], params: SamplingParams) -> list[Completion]:
        """The ``params.n`` completions, whole."""
        ...

    def close(self, *, drain: bool = False, timeout: float = 10.0) -> None:
        """Stop sampling (after the requests in flight, with ``drain``); later requests get ``EngineClosedError``."""
        ...

"""What the server and the gateway need from an engine that samples (``SamplingEngine``): token ids in, token events
with their log-probs out, the tokenizer the gateway splices turns with, and the context it must fit. The embedded
``InferenceEngine`` is one; an engine over vLLM servers (issue #40) is to be another, so that the server, the
gateway and the registry never know which one answers. Light: no torch (its types are named for checkers only)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from flywheel.inference.engine import Completion, TokenEvent
    from flywheel.inference.sampling import SamplingParams


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

"""The rollout of an RFT row: the model answers the row's messages once (with its tools, if any)."""

from __future__ import annotations

from typing import Any

from flywheel.graders.data import RFTRow
from flywheel.model import Model
from flywheel.types import Trajectory


async def rft_rollout(model: Model, row: RFTRow, **sampling: Any) -> Trajectory:
    """One answer to ``row.messages`` as a trajectory (``metadata["rft_row"]`` = the row's index, which
    ``scoring.after_each`` uses to find the row's item; ``metrics["completion_tokens"]``, the answer's length when
    the server says it). ``sampling``: chat completion parameters (``temperature``, ``max_tokens``, ``seed``...)."""
    client = model.openai_client()
    extra = {"tools": row.tools} if row.tools else {}
    completion = await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=row.messages,
        **extra,
        **sampling,  # type: ignore[arg-type]
    )
    metrics = {"completion_tokens": float(completion.usage.completion_tokens)} if completion.usage else {}
    return Trajectory(
        messages_and_choices=[*row.messages, completion.choices[0]],
        tools=row.tools,
        metadata={"rft_row": row.index},
        metrics=metrics,
    )

"""What an episode's calls cost: their recorded token counts times a configured price per 1M prompt and completion
tokens (issue #25, item 3: "latency, tokens and cost").

Prices are per model or deployment: a call is priced by the first entry of ``models`` that names its alias
(``calc@production``: what a deployment costs to serve), else the name it asked for (``calc@3``, an upstream's
``gpt-4o-mini``), else that name's model (``calc``), else ``default``, which is 0: the local engine has no price
per token. They come from a JSON or YAML file (``FLYWHEEL_PRICES``, ``Prices.load``), for example
``{"currency": "USD", "models": {"gpt-4o-mini": {"prompt": 0.15, "completion": 0.6}}}``.

A cost is computed when it is read, at the prices configured then (nothing about a price is stored with a call):
a report states the prices it used, not the prices of the day a call was made.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from flywheel.store.db import in_chunks
from flywheel.store.schema import Call
from flywheel.types import Usage

PRICES_ENV = "FLYWHEEL_PRICES"  # the path of the prices file a gateway reads when it starts
PER_TOKENS = 1_000_000  # prices are per this many tokens


class Price(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: float = Field(0.0, ge=0, allow_inf_nan=False)  # per 1M prompt tokens
    completion: float = Field(0.0, ge=0, allow_inf_nan=False)  # per 1M completion tokens


class Prices(BaseModel):
    model_config = ConfigDict(extra="forbid")

    currency: str = Field("USD", min_length=1, max_length=16)
    default: Price = Field(default_factory=Price)  # whatever ``models`` does not name: the local engine, free
    models: dict[str, Price] = {}  # by deployment alias, served name or model name

    def price(self, model: str, deployment: str | None = None) -> Price:
        """The price of a call asked for ``model`` (answered as ``deployment``, when it was asked by an alias)."""
        for name in (deployment, model, model.partition("@")[0]):
            if name is not None and name in self.models:
                return self.models[name]
        return self.default

    def cost(self, model: str, deployment: str | None, prompt_tokens: int, completion_tokens: int) -> float:
        price = self.price(model, deployment)
        return (prompt_tokens * price.prompt + completion_tokens * price.completion) / PER_TOKENS

    @classmethod
    def load(cls, path: str | Path) -> Prices:
        """Prices from a JSON or YAML file; a ``ValueError`` naming the file and what is wrong where."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"prices file {path}: cannot read it ({exc})") from None
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors(include_url=False)
            )
            raise ValueError(f"prices file {path}: {problems}") from None

    @classmethod
    def from_env(cls) -> Prices:
        """``FLYWHEEL_PRICES``'s file, or no prices (every call costs 0)."""
        path = os.environ.get(PRICES_ENV)
        return cls.load(path) if path else cls()


def usage(s: Session, episode_ids: Iterable[str], prices: Prices) -> dict[str, Usage]:
    """The usage of each of these episodes (those without calls: zeros), in one query per 500 ids."""
    ids = list(dict.fromkeys(episode_ids))
    out = {i: Usage(currency=prices.currency) for i in ids}
    for chunk in in_chunks(ids):
        query = (
            select(
                Call.episode_id, Call.model, Call.deployment, func.count(), func.sum(Call.prompt_tokens),
                func.sum(Call.completion_tokens), func.sum(Call.latency_ms),
            )
            .where(Call.episode_id.in_(chunk))
            .group_by(Call.episode_id, Call.model, Call.deployment)
        )  # fmt: skip
        for episode_id, model, deployment, calls, prompt, completion, latency in s.execute(query):
            u = out[episode_id]
            u.calls += calls
            u.prompt_tokens += int(prompt or 0)
            u.completion_tokens += int(completion or 0)
            u.latency_ms += float(latency or 0.0)
            u.cost += prices.cost(model, deployment, int(prompt or 0), int(completion or 0))
    return out

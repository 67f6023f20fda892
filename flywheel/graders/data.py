"""Datasets in OpenAI's reinforcement fine-tuning form: JSONL rows ``{"messages": [...], "tools": [...], ...}``.

``messages`` is the prompt the model answers, ``tools`` (optional) the tools it may call, and every other key goes
into ``item``, the namespace graders read (``{{item.reference_answer}}``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from flywheel.openai_api import ChatMessage
from flywheel.types import Message

_MAX_PROBLEMS = 20  # listed per file; more only repeat the same mistake


class RFTRow(BaseModel):
    """One row of an RFT dataset; ``index`` is its 0-based position among the file's rows."""

    index: int
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    item: dict[str, Any] = {}


def _problems(row: Any) -> list[str]:
    if not isinstance(row, dict):
        return [f"a row must be a JSON object, got {type(row).__name__}"]
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        return ["'messages' must be a non-empty list of chat messages"]
    problems = []
    for i, message in enumerate(messages):
        try:
            ChatMessage.model_validate(message)
        except ValidationError as exc:
            for error in exc.errors(include_url=False):
                where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
                problems.append(f"messages[{i}]{where}: {error['msg'].removeprefix('Value error, ')}")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        problems.append("'tools' must be a list of tool objects")
    return problems


def load_rft_jsonl(path: str | Path) -> list[RFTRow]:
    """Read an RFT JSONL file; ValueError listing each bad line (``file:line: what``) if any is malformed."""
    path = Path(path)
    rows: list[RFTRow] = []
    problems: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{number}: invalid JSON at column {exc.colno}: {exc.msg}")
            continue
        found = _problems(row)
        problems += [f"{path}:{number}: {problem}" for problem in found]
        if not found:
            item = {key: value for key, value in row.items() if key not in ("messages", "tools")}
            rows.append(RFTRow(index=len(rows), messages=row["messages"], tools=row.get("tools"), item=item))
    if problems:
        shown = "\n  ".join(problems[:_MAX_PROBLEMS])
        more = f"\n  ... and {len(problems) - _MAX_PROBLEMS} more" if len(problems) > _MAX_PROBLEMS else ""
        raise ValueError(f"{path}: {len(problems)} problem(s) in the RFT data:\n  {shown}{more}")
    if not rows:
        raise ValueError(f'{path}: no rows (expected JSONL lines like {{"messages": [...], ...}})')
    return rows

"""Uploaded files (``/v1/files``, purpose ``fine-tune``): checked on upload, their bytes kept under the home's
``files/`` (one file per id, written whole before its record commits), their records in the store.

A fine-tuning file is JSONL: one JSON object per line, each a chat example (``messages``: a list of messages with a
``role`` and, except an assistant's tool call, a ``content``), with any other fields an RFT grader reads (``{{item.
answer}}``), or a preference example (``input``, ``preferred_output``, ``non_preferred_output``). A file that is not
is refused at upload with the line and the field that are wrong, as OpenAI's checks name them."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

from flywheel.server.limits import UPLOAD_MAX_BYTES
from flywheel.store import Store, finetuning
from flywheel.store.schema import FineTuningFile

PURPOSES = ("fine-tune",)  # what may be uploaded
RESULTS = "fine-tune-results"  # a job's step metrics (``Files.create_results``)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class FileError(ValueError):
    """An upload or a file a job names that cannot be used: a 400 with ``param`` and ``code``."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_file"):
        super().__init__(message)
        self.param, self.code = param, code


def _message_problem(message: Any, where: str) -> str | None:
    if not isinstance(message, dict):
        return f"{where} is not an object"
    role = message.get("role")
    if role not in ROLES:
        return f"{where}.role is {role!r}: it must be one of {', '.join(ROLES)}"
    content = message.get("content")
    if content is None and not (role == "assistant" and (message.get("tool_calls") or message.get("function_call"))):
        return f"{where} has no content"
    if content is not None and not isinstance(content, str | list):
        return f"{where}.content must be a string or a list of parts"
    if "weight" in message and message["weight"] not in (0, 1):
        return f"{where}.weight must be 0 or 1"
    return None


def row_problem(row: Any) -> str | None:
    """What is wrong with one line's object as a fine-tuning example (None: nothing)."""
    if not isinstance(row, dict):
        return "the line is not a JSON object"
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list"
        for i, message in enumerate(messages):
            if problem := _message_problem(message, f"messages[{i}]"):
                return problem
        return None
    if "input" in row:
        missing = [k for k in ("preferred_output", "non_preferred_output") if k not in row]
        return f"a preference example needs {' and '.join(missing)}" if missing else None
    return "it has no 'messages' (a chat example) and no 'input' (a preference example)"


def check_jsonl(data: bytes) -> int:
    """The number of examples in ``data``; a FileError naming the first line that is not one."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileError(f"Invalid file format: the file is not UTF-8 (byte {exc.start}).", "file") from None
    count = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise FileError(f"Invalid file format: line {number} is not JSON ({exc}).", "file") from None
        if problem := row_problem(row):
            raise FileError(f"Invalid file format: line {number}: {problem}.", "file")
        count += 1
    if count == 0:
        raise FileError("Invalid file format: the file has no examples (one JSON object per line).", "file")
    return count


class Files:
    """The uploaded files: records in ``store``, bytes under ``root``."""

    def __init__(self, store: Store, root: Path):
        self.store, self.root = store, root

    def path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"

    def create(self, filename: str, purpose: str, data: bytes) -> FineTuningFile:
        """An upload, checked (``check_jsonl``) and kept."""
        if purpose not in PURPOSES:
            raise FileError(
                f"Invalid purpose {purpose!r}: this server keeps files for fine-tuning only ({', '.join(PURPOSES)}).",
                "purpose", "invalid_value",
            )  # fmt: skip
        if len(data) > UPLOAD_MAX_BYTES:
            raise FileError(f"The file is {len(data)} bytes: at most {UPLOAD_MAX_BYTES} are allowed.", "file", "file_too_large")  # fmt: skip
        return self._keep(filename, purpose, data, check_jsonl(data))

    def create_results(self, rows: list[dict[str, float]]) -> FineTuningFile:
        """A job's step metrics as OpenAI gives them (``step_metrics.csv``, purpose ``fine-tune-results``, the CSV
        base64-encoded), one row per step, a column per metric (empty where a step has none)."""
        columns = list(dict.fromkeys(key for row in rows for key in row))
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return self._keep("step_metrics.csv", RESULTS, base64.b64encode(text.getvalue().encode()), len(rows))

    def _keep(self, filename: str, purpose: str, data: bytes, lines: int) -> FineTuningFile:
        file_id = finetuning.new_id("file")
        self.root.mkdir(parents=True, exist_ok=True)
        partial = self.path(file_id).with_suffix(".partial")
        with partial.open("wb") as out:  # whole and synced before the record points at it
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        partial.replace(self.path(file_id))
        with self.store.session() as s:
            row = finetuning.add_file(
                s, file_id=file_id, filename=filename, purpose=purpose, size=len(data), lines=lines,
                sha256=hashlib.sha256(data).hexdigest(),
            )  # fmt: skip
            s.expunge(row)
        return row

    def content(self, file_id: str) -> bytes:
        with self.store.session() as s:
            finetuning.get_file(s, file_id)
        return self.path(file_id).read_bytes()

    def examples(self, file_id: str, param: str) -> int:
        """How many examples a file has (a FileError if it does not exist: ``param`` names the request's field)."""
        with self.store.session() as s:
            try:
                row = finetuning.get_file(s, file_id, param)
            except finetuning.UnknownObjectError:
                raise FileError(f"The file '{file_id}' ({param}) does not exist.", param, "invalid_file_id") from None
            if row.purpose not in PURPOSES:
                raise FileError(f"The file '{file_id}' ({param}) is a job's {row.purpose} file, not examples.", param, "invalid_file_id")  # fmt: skip
            return row.lines

    def rows(self, file_id: str, param: str) -> list[dict[str, Any]]:
        """A file's examples (a FileError if it does not exist)."""
        self.examples(file_id, param)
        text = self.path(file_id).read_text("utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def delete(self, file_id: str) -> None:
        with self.store.session() as s:
            finetuning.delete_file(s, file_id)
        self.path(file_id).unlink(missing_ok=True)

"""Weights & Biases logging (flywheel/local/wandb_log.py), as ART does it: a training step's and ``model.log``'s metrics
and trajectory tables reach a W&B run named after the model, in W&B's offline mode (no network), read back from the
run's own ``.wandb`` file and its table files;
a restarted backend logs to the same run id; without wandb installed, one warning and no error."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest

import flywheel as art
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.wandb_log import WandbLog, run_id

from helpers import train_a_step_and_log


def require_wandb() -> None:
    try:
        import wandb  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("wandb is not installed: CI installs the dev extra (./dev setup), which has it")
        pytest.skip("wandb is not installed (pip install flywheel-rl[wandb]): W&B logging was not tested")


def offline_runs(wandb_dir: Path) -> list[Path]:
    """The offline runs' ``.wandb`` files, oldest first."""
    return sorted((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def history(path: Path) -> tuple[str, dict[int, dict[str, float]]]:
    """A ``.wandb`` file's run id and its history rows by step. The file is W&B's record log (a 7-byte header, then
    LevelDB log records in 32 KiB blocks, each record a protobuf ``Record``), read with W&B's own protobuf types."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, rows, ident = 7, 32768, b"", {}, ""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            if record.HasField("run"):
                ident = record.run.run_id
            elif record.HasField("history"):
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                rows[record.history.step.num] = items
    return ident, rows


async def test_a_training_step_and_model_log_reach_an_offline_wandb_run_resumed_by_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    require_wandb()
    import wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    (tmp_path / "wb").mkdir()
    model = art.TrainableModel(name="wandb/agent", project="tests", base_model=EMBEDDED_MODEL)
    backend = art.LocalBackend(path=tmp_path / "home")
    try:
        await train_a_step_and_log(backend, model)
    finally:
        await backend.close()  # finishes the run
    rows = backend.run(model).history()  # our own files, as before
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (1, "val")]

    (first,) = offline_runs(tmp_path / "wb")
    ident, logged = history(first)
    assert ident == run_id("tests", "wandb/agent") and "/" not in ident
    assert logged[1]["train/loss"] == pytest.approx(rows[0]["loss"])
    assert logged[1]["val/reward"] == pytest.approx(0.5) and logged[1]["val/accuracy"] == 0.5
    trained = backend.run(model).trajectories("train", 1)
    for split in ("train", "val"):  # the step's two trajectories, one group; model.log's val split the same two
        assert logged[1][f"{split}/trajectories/_type"] == "table-file"  # a table's fields are nested keys
        table = json.loads((first.parent / "files" / logged[1][f"{split}/trajectories/path"]).read_text())
        assert table["columns"] == ["step", "group", "reward", "messages"]
        assert table["data"] == [
            [1, 0, t.reward, f"user: Name a fruit.\nassistant: {t.messages()[-1]['content']}"] for t in trained
        ]

    # a restarted process continues the same run (offline, W&B writes a new directory under the same id)
    again = art.LocalBackend(path=tmp_path / "home", serve_http=False)
    await again.log(model, [], "val", {"accuracy": 0.75}, step=2)
    await again.close()
    second = next(p for p in offline_runs(tmp_path / "wb") if p != first)
    ident_again, logged_again = history(second)
    assert ident_again == ident and logged_again[2]["val/accuracy"] == 0.75
    wandb.teardown()  # W&B's service process, started by the runs above


def test_without_wandb_installed_a_key_is_one_warning_never_an_error(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WANDB_API_KEY", "unused")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    log = WandbLog()
    with pytest.warns(UserWarning, match=r"pip install flywheel-rl\[wandb\]"):
        log.log("tests", "a", [{"step": 1, "split": "train", "loss": 0.5}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.log("tests", "a", [{"step": 2, "split": "train", "loss": 0.4}])
        WandbLog().log("tests", "b", [{"step": 1, "split": "val", "val/reward": 1.0}])
    log.finish()

"""One model's directory (``RunStore``; its layout: ``flywheel.checkpoints.layout``): history, trajectories,
checkpoints (their format, durable atomic writes, listing, pruning), recovery after a crash, and the lock that gives
it one owner.

History rows and trajectories live in the store (``$FLYWHEEL_DB``, else SQLite in the home: ``<home>/flywheel.db``,
the database the gateway records episodes in; ``flywheel.store.history``), keyed by project, model name and the
directory's run id: two machines that train one name into a shared store keep their rows apart, and a directory
made anew (deleted and trained again, or pulled: checkpoint sync leaves dot-names) is a run of its own. A directory
from before run ids adopts the rows of its name stored without one. ``history.jsonl`` and ``trajectories/`` are
their export, rewritten or appended after each change, for people, scripts and checkpoint sync. Files the store
has nothing of (written before the store kept them, or pulled) are imported once, when first read;
``import_history`` makes pulled files the store's.

Crash safety (a kill at any instant; fsync also covers a power loss): a checkpoint is written into a temporary
directory, its files and the directory fsynced, then renamed into place (one already there is renamed aside first,
then removed); only then are the history rows it commits appended. The checkpoint carries those rows too, so
``recover`` re-appends them if the kill came in between. ``recover`` (at registration, under the lock) also
removes temporaries, finishes an interrupted swap or deletion, drops the rows and trajectory files of steps
above the latest checkpoint (a run resumes at that checkpoint and redoes those steps, so none is ever recorded
twice), and exports the rows, and the last saved trajectories, again if their files fall short (a kill between
the store's commit and the export).
Training on from an earlier checkpoint moves the later ones and their files to ``abandoned/``, and their rows and
trajectories in the store to a branch of that name (``abandon_after``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from sqlalchemy.orm import Session

from flywheel.checkpoints import layout
from flywheel.checkpoints.layout import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ASIDE,
    DELETING,
    FULL_WEIGHTS,
    HISTORY,
    LOCK,
    OPTIMIZER,
    RNG,
    RUN,
    STATE,
    TMP,
)
from flywheel.store import Store, deployments, history
from flywheel.store.db import default_url
from flywheel.store.history import RunKey
from flywheel.train.checkpoint import Checkpoint, CheckpointState
from flywheel.types import Trajectory

Row = dict[str, Any]
# The stores of the databases this process used last, one per URL (opening one checks its migrations); one evicted
# is closed: its pooled connections (a session in use keeps its own until it ends, and a closed store opens anew)
_stores: OrderedDict[str, Store] = OrderedDict()
_stores_lock = threading.Lock()
OPEN_STORES = 4


def _store(url: str) -> Store:
    with _stores_lock:
        if url not in _stores:
            _stores[url] = Store(url)
            while len(_stores) > OPEN_STORES:
                _stores.popitem(last=False)[1].close()
        _stores.move_to_end(url)
        return _stores[url]


class ModelInUseError(RuntimeError):
    """Another backend (this process or another) has the model registered."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, most often): nothing of it is left, the latest is the one
    before."""


class RunStore:
    """One model's directory (``<home>/<project>/models/<name>``) and its history rows and trajectories in the store
    (``db``: a database URL; default ``$FLYWHEEL_DB``, else ``<home>/flywheel.db``). Writers (a registered backend) hold
    ``lock``; reading needs no lock."""

    def __init__(self, path: Path, db: str | None = None):
        self.path = Path(path)
        self.checkpoints = layout.checkpoints_dir(self.path)
        self._history = self.path / HISTORY
        self._lock_fd: int | None = None
        home, self.project, self.name = layout.home_project_name(self.path)
        self.db = db or default_url(home)
        self._key: RunKey | None = None
        # whether the files are known to be in the store (imported, or written through this instance): looked up
        # once, not at every step; this class empties the store's line only together with its files
        self._rows_imported = self._trajectories_imported = False

    # ---- lock --------------------------------------------------------------------------------------------------

    def lock(self) -> None:
        """Take the directory for this process (an OS lock, released on ``unlock`` or when the process dies)."""
        if self._lock_fd is not None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ModelInUseError(
                f"{self.path} is in use: a backend in process {holder} has this model registered"
                f"{' (this process)' if holder == str(os.getpid()) else ''}. One backend trains a model at a time: "
                "close that one first (backend.close()), or use another model name."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    # ---- checkpoints -------------------------------------------------------------------------------------------

    def checkpoint_dir(self, step: int) -> Path:
        return layout.checkpoint_dir(self.path, step)

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        return layout.steps(self.path)

    def latest(self) -> int | None:
        return layout.latest(self.path)

    def state(self, step: int) -> CheckpointState:
        path = self.checkpoint_dir(step) / STATE
        if not path.is_file():
            raise FileNotFoundError(
                f"No checkpoint for step {step} at {path.parent} (checkpoints: {self.steps() or 'none'})."
            )
        return CheckpointState.model_validate(json.loads(path.read_text()))

    def read(self, step: int, *, mode: Literal["lora", "full"] | None = None, optimizer: bool = True) -> Checkpoint:
        """Checkpoint ``step`` (without its optimizer state if not ``optimizer``). ``mode``: what the reader trains
        (``TrainedWeights.mode``); a checkpoint of the other kind is refused with a clear error."""
        state = self.state(step)
        directory = self.checkpoint_dir(step)
        if mode is not None and mode != state.trained_weights.mode:
            wanted = FULL_WEIGHTS if mode == "full" else ADAPTER_WEIGHTS
            kind = "full fine-tuning" if mode == "full" else "a LoRA adapter"
            raise ValueError(
                f"checkpoint {directory} has no {wanted}: it was not written by {kind}, as this model trains"
            )
        weights = load_file(
            str(directory / (FULL_WEIGHTS if state.trained_weights.mode == "full" else ADAPTER_WEIGHTS))
        )
        opt = directory / OPTIMIZER
        rng = directory / RNG
        return Checkpoint(
            state=state,
            weights=weights,
            optimizer=torch.load(opt, weights_only=True) if optimizer and opt.exists() else None,
            rng=torch.load(rng, weights_only=True) if rng.exists() else None,
        )

    def write(self, checkpoint: Checkpoint) -> Path:
        """Write a checkpoint durably and atomically, then append the history rows it commits."""
        step = checkpoint.state.step
        final = self.checkpoint_dir(step)
        if not self.checkpoints.is_dir():
            self.checkpoints.mkdir(parents=True)
            _fsync_dir(self.path)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP}{layout.checkpoint_name(step)}-", dir=self.checkpoints))
        aside = self.checkpoints / f"{ASIDE}{tmp.name[len(TMP) :]}"
        try:
            try:
                _write_files(tmp, checkpoint)
                for f in tmp.iterdir():
                    _fsync_file(f)
                _fsync_dir(tmp)
            except Exception as exc:  # a full disk: torch.save says "[enforce fail at ...] unexpected pos N vs M"
                shutil.rmtree(tmp, ignore_errors=True)  # first: the free space read next includes what it held
                raise CheckpointWriteError(self._unwritten(checkpoint, final, exc)) from exc
            if final.exists():
                final.rename(aside)  # a kill from here to the next rename: recover() moves it back
            tmp.rename(final)
            _fsync_dir(self.checkpoints)
        except BaseException:
            if aside.exists() and not final.exists():
                aside.rename(final)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        self.append(checkpoint.state.rows)
        return final

    def _unwritten(self, checkpoint: Checkpoint, final: Path, exc: Exception) -> str:
        """What a failed checkpoint write says: where, why, the space it needs and the space there is."""
        need = _tensor_bytes([checkpoint.weights, checkpoint.optimizer, checkpoint.rng])
        disk = shutil.disk_usage(self.checkpoints)
        full = disk.free < need or getattr(exc, "errno", None) == errno.ENOSPC or "unexpected pos" in str(exc)
        latest = self.latest()
        said = (str(exc).strip().splitlines() or [""])[0][:300]  # torch's C++ frames follow its first line
        return (
            f"Could not write checkpoint step {checkpoint.state.step} to {final}: {type(exc).__name__}: {said}. "
            + ("The disk looks full: " if full else "")
            + f"the checkpoint needs about {_size(need)} (its tensors); {_size(disk.free)} is free there (of "
            f"{_size(disk.total)}). The half-written checkpoint was removed: the latest checkpoint is still "
            + (f"step {latest}" if latest is not None else "none (no step saved yet)")
            + ", where a restart resumes. Free some space (e.g. delete_checkpoints, or the loop's prune: true) and "
            "train again."
        )

    def delete(self, step: int) -> None:
        """Remove checkpoint ``step`` (renamed out of the listing first, so a kill never leaves half of one)."""
        directory = self.checkpoint_dir(step)
        doomed = Path(tempfile.mkdtemp(prefix=f"{DELETING}{layout.checkpoint_name(step)}-", dir=self.checkpoints))
        directory.rename(doomed / directory.name)
        _fsync_dir(self.checkpoints)
        shutil.rmtree(doomed)

    def prune(self, metric: str, maximize: bool = True) -> list[int]:
        """Keep the latest checkpoint and the best existing one by ``metric`` (a NaN never wins; ties: the later
        step), and what this model's deployments need (``prune_deployed``: a step being served is never deleted
        by a pruning that knows nothing of it); delete the others and return their steps."""
        steps = self.steps()
        sign = 1.0 if maximize else -1.0
        scored = [
            (sign * float(r[metric]), r["step"])
            for r in self.history()
            if r.get("step") in steps and isinstance(r.get(metric), (int, float)) and not math.isnan(r[metric])
        ]
        return self.prune_deployed(keep={max(scored)[1]} if scored else ())

    def prune_deployed(self, keep: Iterable[int] = (), rollback: int = 1) -> list[int]:
        """Keep what deployments and training need: the latest checkpoint and the steps in ``keep`` whole (training
        goes on from them: with their optimizer state); each step a deployment of this model points at, and the
        ``rollback`` steps before it that a rollback would go back to (the store's deployments and their audit
        history), with their weights alone (the optimizer state deleted: they are served, not trained on); delete
        the others and return their steps."""
        steps = self.steps()
        if not steps:
            return []
        deployed = self.deployed_steps(rollback)
        whole = {steps[-1], *keep}
        deleted = []
        for step in steps:
            if step in whole:
                continue
            if step in deployed:
                (self.checkpoint_dir(step) / OPTIMIZER).unlink(missing_ok=True)
            else:
                self.delete(step)
                deleted.append(step)
        return deleted

    def deployed_steps(self, rollback: int = 1) -> set[int]:
        """The steps this model's deployments point at, and the ``rollback`` steps before each that a rollback
        would go back to (the store's deployments and their audit history)."""
        with _store(self.db).session() as s:
            return deployments.steps_in_use(s, self.name, rollback=rollback)

    # ---- history and trajectories ------------------------------------------------------------------------------

    @property
    def key(self) -> RunKey:
        """The run in the store: project, model name and the id in ``.run`` (made when first needed)."""
        if self._key is None:
            self._key = RunKey(self.project, self.name, self._run_id())
        return self._key

    def _run_id(self) -> str:
        """The directory's run id; a new one when it has none (made once: a process that races this one to it gets
        the same). A directory from before run ids adopts its name's rows stored without one."""
        path = self.path / RUN
        if path.exists():
            return path.read_text().strip()
        older = self._history.exists() or self.checkpoints.is_dir() or (self.path / layout.TRAJECTORIES).is_dir()
        self.path.mkdir(parents=True, exist_ok=True)
        while True:
            fd, tmp = tempfile.mkstemp(prefix=f"{RUN}-", dir=self.path)
            try:
                os.write(fd, f"{uuid.uuid4().hex}\n".encode())
                os.fsync(fd)
                os.link(tmp, path)  # fails if another process made it first: then it is theirs
                made = True
            except FileExistsError:
                made = False
            except FileNotFoundError:  # the owner's recover() took it for a kill's leftover meanwhile: again
                continue
            finally:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            break
        run = path.read_text().strip()
        if made:
            _fsync_dir(self.path)
            if older:
                with _store(self.db).session() as s:
                    history.adopt(s, RunKey(self.project, self.name, run))
        return run

    def history(self) -> list[Row]:
        """The rows, in order (none for a directory that does not exist)."""
        if not self.path.is_dir():
            return []
        with _store(self.db).session() as s:
            return self._rows(s)

    def _rows(self, s: Session) -> list[Row]:
        """The store's rows (``history.jsonl``'s imported first if it has none)."""
        self._import_rows(s)
        return history.rows(s, self.key)

    def _import_rows(self, s: Session) -> None:
        """``history.jsonl``'s rows, when the store has none of the run's (written before it kept them, or pulled)."""
        if self._rows_imported:
            return
        if history.has_rows(s, self.key):
            self._rows_imported = True  # committed before this unit of work
        else:
            history.add(s, self.key, self._exported())

    def _exported(self) -> list[Row]:
        """The rows of ``history.jsonl`` (a last line cut short by a kill is not a row)."""
        return [json.loads(line) for line in _complete_lines(self._history)]

    def import_history(self) -> None:
        """Make the store's rows and trajectories those of the files (after a pull brought another machine's)."""
        with _store(self.db).session() as s:
            history.replace(s, self.key, self._exported())
            history.drop_trajectories_above(s, self.key, -1)
            self._trajectories_imported = False  # none left: the files go in again
            self._import_trajectories(s)

    def append(self, rows: list[Row]) -> None:
        """Append rows: to the store (committed), then to the export (fsynced before this returns)."""
        if not rows:
            return
        with _store(self.db).session() as s:
            self._import_rows(s)  # a file not imported yet goes in first
            history.add(s, self.key, rows)
        self._rows_imported = True  # committed
        created = not self._history.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        with self._history.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
        if created:
            _fsync_dir(self.path)

    def save_trajectories(self, split: str, step: int, trajectories: list[Trajectory]) -> None:
        """Save a step's trajectories: to the store (committed), then to their export (``trajectories/``)."""
        texts = [t.model_dump_json() for t in trajectories]
        with _store(self.db).session() as s:
            self._import_trajectories(s)
            history.add_trajectories(s, self.key, split, step, texts)
        self._trajectories_imported = True  # committed
        path = self._trajectory_file(split, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write("".join(text + "\n" for text in texts))

    def trajectories(self, split: str, step: int | None = None) -> list[Trajectory]:
        """The trajectories saved with ``split`` (at ``step``), in the order saved."""
        return [Trajectory.model_validate_json(text) for _, text in self.trajectory_texts(split, step)]

    def trajectory_texts(self, split: str, step: int | None = None) -> list[tuple[int, str]]:
        """``(step, JSON text)`` of the trajectories saved with ``split`` (at ``step``), in the order saved: for a
        reader that says which one it cannot read."""
        if not self.path.is_dir():
            return []
        with _store(self.db).session() as s:
            self._import_trajectories(s)
            return history.trajectories(s, self.key, split, step)

    def trajectory_splits(self) -> list[str]:
        """The splits trajectories were saved with, sorted."""
        if not self.path.is_dir():
            return []
        with _store(self.db).session() as s:
            self._import_trajectories(s)
            return history.trajectory_splits(s, self.key)

    def _trajectory_file(self, split: str, step: int) -> Path:
        return layout.trajectory_file(self.path, split, step)

    def _import_trajectories(self, s: Session) -> None:
        """Trajectory files, when the store has none of the run's (written before it kept them, or pulled)."""
        if self._trajectories_imported:
            return
        if history.has_trajectories(s, self.key):
            self._trajectories_imported = True  # committed before this unit of work
            return
        for f in sorted(layout.trajectory_files(self.path, above=-1)):
            history.add_trajectories(s, self.key, f.parent.name, int(f.stem), _complete_lines(f))

    # ---- recovery and branches ---------------------------------------------------------------------------------

    def recover(self) -> None:
        """Bring the directory back to its latest checkpoint after a crash (see the module's docstring)."""
        if self.checkpoints.is_dir():
            for entry in sorted(self.checkpoints.iterdir()):
                if not entry.name.startswith("."):
                    continue
                original = (
                    self.checkpoint_dir(int(entry.name[len(ASIDE) :].split("-")[0]))
                    if entry.name.startswith(ASIDE)
                    else None
                )
                if original is not None and not original.exists():
                    entry.rename(original)  # the kill came between the two renames of a swap
                else:
                    shutil.rmtree(entry, ignore_errors=True)
            _fsync_dir(self.checkpoints)
        self._history.with_name(f".{HISTORY}.tmp").unlink(missing_ok=True)
        for leftover in self.path.glob(f"{RUN}-*"):  # a kill between _run_id's mkstemp and its unlink
            leftover.unlink(missing_ok=True)
        latest = self.latest()
        top = latest or 0
        rows = self.history()
        kept = [r for r in rows if r.get("step", 0) <= top]
        if latest is not None:  # rows the latest checkpoint commits, if the kill came before they were appended
            present = {(r.get("step"), r.get("split"), r.get("time")) for r in kept}
            kept += [
                r for r in self.state(latest).rows if (r.get("step"), r.get("split"), r.get("time")) not in present
            ]
        if kept != rows:
            self._rewrite_history(kept)
        else:
            self._export(kept)  # a kill between the store's commit and the export, or a torn last line
        with _store(self.db).session() as s:
            self._import_trajectories(s)
            history.drop_trajectories_above(s, self.key, top)
            last = history.last_saved(s, self.key)
        for f in layout.trajectory_files(self.path, above=top):
            f.unlink()
        if last is not None:  # a kill between the store's commit of the last trajectories and their export
            split, step, count = last
            path = self._trajectory_file(split, step)
            text = path.read_text() if path.exists() else ""
            if len(_complete_lines(path)) != count or (text and not text.endswith("\n")):
                with _store(self.db).session() as s:
                    found = history.trajectories(s, self.key, split, step)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(line + "\n" for _, line in found))

    def abandon_after(self, step: int) -> Path | None:
        """Move the checkpoints, history rows and trajectory files of steps above ``step`` to ``abandoned/``
        (training goes on from ``step``: they are another branch). Returns where they went, or None if none."""
        later = [p for s, p in reversed(layout.checkpoint_dirs(self.path)) if s > step]
        rows = self.history()
        dropped = [r for r in rows if r.get("step", 0) > step]
        files = layout.trajectory_files(self.path, above=step)
        if not (later or dropped or files):
            return None
        archive = layout.abandoned_dir(self.path, step)
        (archive / layout.CHECKPOINTS).mkdir(parents=True)
        for p in later:  # highest first: a kill part-way leaves a consistent run at a lower step (recover)
            p.rename(archive / layout.CHECKPOINTS / p.name)
        if later:
            _fsync_dir(self.checkpoints)
        (archive / HISTORY).write_text("".join(json.dumps(r) + "\n" for r in dropped))
        with _store(self.db).session() as s:
            history.abandon_above(s, self.key, step, f"{archive.parent.name}/{archive.name}")
        self._export([r for r in rows if r.get("step", 0) <= step])
        for f in files:
            (archive / layout.TRAJECTORIES / f.parent.name).mkdir(parents=True, exist_ok=True)
            f.rename(archive / layout.TRAJECTORIES / f.parent.name / f.name)
        return archive

    def _rewrite_history(self, rows: list[Row]) -> None:
        """Make the run's rows exactly ``rows``, in the store and its export."""
        with _store(self.db).session() as s:
            history.replace(s, self.key, rows)
        self._export(rows)

    def _export(self, rows: list[Row]) -> None:
        """Write ``history.jsonl`` as ``rows`` (atomically, fsynced), unless it already is."""
        text = "".join(json.dumps(r) + "\n" for r in rows)
        if (self._history.read_text() if self._history.exists() else "") == text:
            return
        tmp = self._history.with_name(f".{HISTORY}.tmp")
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self._history)
        _fsync_dir(self.path)


def _complete_lines(path: Path) -> list[str]:
    """A JSONL file's lines, without a last one cut short by a kill, nor empty ones."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    return [line for line in (lines if text.endswith("\n") else lines[:-1]) if line.strip()]


def write_weights(directory: Path, checkpoint: Checkpoint) -> None:
    """A checkpoint's weights alone, as peft and vLLM load them: a LoRA adapter directory
    (``adapter_model.safetensors`` and, when the checkpoint has it, ``adapter_config.json``), or every weight of the
    model under its Hugging Face names (``model.safetensors``)."""
    weights = {k: v.detach().cpu().contiguous() for k, v in checkpoint.weights.items()}
    if checkpoint.state.trained_weights.mode == "full":
        save_file(weights, str(directory / FULL_WEIGHTS))
        return
    save_file(weights, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if checkpoint.adapter_config is not None:
        (directory / ADAPTER_CONFIG).write_text(json.dumps(checkpoint.adapter_config, indent=2, sort_keys=True))


def _write_files(directory: Path, checkpoint: Checkpoint) -> None:
    """The checkpoint format; the state file goes last."""
    write_weights(directory, checkpoint)
    if checkpoint.optimizer is not None:
        torch.save(checkpoint.optimizer, directory / OPTIMIZER)
    if checkpoint.rng is not None:
        torch.save(checkpoint.rng, directory / RNG)
    (directory / STATE).write_text(json.dumps(checkpoint.state.model_dump(mode="python"), indent=2))


def _tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a nest of dicts, lists and tuples (a checkpoint's weights, optimizer state, RNG)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} bytes"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

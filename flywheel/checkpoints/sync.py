"""A model's directory copied to or from storage elsewhere: ART's ``_experimental_push_to_s3`` / ``_pull_from_s3``.

Any fsspec URL works: ``s3://bucket`` (with the ``s3fs`` package), ``gs://``, ``file:///mnt/share``... A bucket name
without a scheme is S3's, as in ART, and ``$BACKUP_BUCKET`` is the default. The remote layout is ART's:
``<bucket>/<prefix>/<project>/models/<name>/``, the same files as the local directory (checkpoints, history,
trajectories), never its lock, its run id or its temporaries (dot-names: a pulled copy is a run of its own). A file
is copied when the other side lacks it or has another size (checkpoint files never change once written; the history
only grows). A push copies the history last, so a reader never sees a row whose checkpoint is not there yet; a pull
copies it first, so the rows of checkpoints it copies are there (``recover`` at ``register`` drops rows past the
latest checkpoint). ``pull_run`` pulls into a run's directory under its lock and makes the pulled history the
store's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from flywheel.checkpoints import layout
from flywheel.checkpoints.layout import HISTORY

if TYPE_CHECKING:
    from flywheel.checkpoints.run import RunStore


def remote_url(project: str, name: str, s3_bucket: str | None, prefix: str | None) -> str:
    """Where a model's directory goes: ``<bucket>/<prefix>/<project>/models/<name>``."""
    bucket = s3_bucket or os.environ.get("BACKUP_BUCKET")
    if not bucket:
        raise ValueError(
            "checkpoint sync needs a place: pass s3_bucket= (a bucket name or any fsspec URL) or set BACKUP_BUCKET"
        )
    root = bucket.rstrip("/") if "://" in bucket else f"s3://{bucket}"
    parts = [p.strip("/") for p in (prefix, project, layout.MODELS, name) if p and p.strip("/")]
    return "/".join([root, *parts])


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as exc:  # a dependency of torch and huggingface_hub, so normally there
        raise ImportError("checkpoint sync needs the fsspec package: pip install fsspec") from exc
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:  # fsspec names the package a protocol needs, e.g. "Install s3fs to access S3"
        raise ImportError(f"checkpoint sync to {url}: {exc}") from exc


def _local_files(directory: Path) -> dict[str, int]:
    """Relative path -> size of the directory's files, without dot-names (the lock, temporaries)."""
    files = {}
    for path in directory.rglob("*"):
        relative = path.relative_to(directory).as_posix()
        if path.is_file() and not layout.is_private(relative):
            files[relative] = path.stat().st_size
    return files


def _remote_files(fs: Any, root: str) -> dict[str, int]:
    if not fs.exists(root):
        return {}
    files = {}
    for path, info in fs.find(root, detail=True).items():
        relative = path[len(root.rstrip("/")) :].lstrip("/")
        if info.get("type", "file") == "file" and not layout.is_private(relative):
            files[relative] = int(info.get("size") or 0)
    return files


def _history_last(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: (n == HISTORY, n))


def push(directory: Path, url: str, *, delete: bool = False, verbose: bool = False) -> list[str]:
    """Copies the model directory to ``url``; ``delete``: remove remote files it no longer has. Returns the files
    copied."""
    if not directory.is_dir():
        raise FileNotFoundError(f"nothing to push: {directory} does not exist (no step was trained or logged)")
    fs, root = _filesystem(url)
    local, remote = _local_files(directory), _remote_files(fs, root)
    copied = [name for name in _history_last(list(local)) if remote.get(name) != local[name]]
    for name in copied:
        fs.makedirs(f"{root}/{name}".rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(directory / name), f"{root}/{name}")
        if verbose:
            print(f"pushed {name} -> {url}/{name}")
    if delete:
        for name in sorted(remote.keys() - local.keys()):
            fs.rm_file(f"{root}/{name}")
    return copied


def pull(
    url: str,
    directory: Path,
    *,
    only_step: int | Literal["latest"] | None = None,
    delete: bool = False,
    verbose: bool = False,
) -> list[str]:
    """Copies the model directory at ``url`` here: all of it, or with ``only_step`` one checkpoint (a step, or
    ``"latest"``) and the files outside ``checkpoints/``. ``delete`` (without ``only_step``): remove local files the
    remote does not have. Nothing at ``url`` yet (a first run) copies nothing, as ART's ``aws s3 sync`` does.
    Returns the files copied."""
    fs, root = _filesystem(url)
    remote = _remote_files(fs, root)
    if not remote and verbose:
        print(f"nothing to pull yet: {url} has no model directory")
    steps = sorted({step for step in map(layout.checkpoint_step, remote) if step is not None})
    if only_step is not None:
        step = steps[-1] if only_step == "latest" and steps else only_step
        if step not in steps:
            raise FileNotFoundError(f"{url} has no checkpoint {only_step!r} (it has {steps or 'none'})")
        remote = {
            n: s
            for n, s in remote.items()
            if not n.startswith(f"{layout.CHECKPOINTS}/") or layout.checkpoint_step(n) == step
        }
    local = _local_files(directory) if directory.is_dir() else {}
    copied = [name for name in sorted(remote, key=lambda n: (n != HISTORY, n)) if local.get(name) != remote[name]]
    for name in copied:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{root}/{name}", str(directory / name))
        if verbose:
            print(f"pulled {url}/{name} -> {directory / name}")
    if delete and only_step is None:
        for name in sorted(local.keys() - remote.keys()):
            (directory / name).unlink()
    return copied


def pull_run(
    run: RunStore,
    url: str,
    *,
    only_step: int | Literal["latest"] | None = None,
    delete: bool = False,
    verbose: bool = False,
) -> list[str]:
    """``pull`` into a run's directory under its lock (no backend has it registered while its files change); pulled
    history rows or trajectories become the run's history in the store too (``RunStore.import_history``). Returns the
    files copied."""
    run.lock()
    try:
        copied = pull(url, run.path, only_step=only_step, delete=delete, verbose=verbose)
        if any(layout.is_history(name) for name in copied):
            run.import_history()  # the pulled files are the run's history now: the store's copy follows them
    finally:
        run.unlock()
    return copied

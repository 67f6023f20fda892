"""Python graders run here: one short-lived, locked-down process per grade.

Threat model. A python grader is code from a grader file: possibly careless (an infinite loop, a memory blow-up),
possibly hostile (reading secrets, phoning home, attacking the training process). What must hold whatever it
does: the training process survives and keeps its secrets, nothing outside the grader's temporary directory
changes, no network traffic leaves, and the grade counts as 0 with an error kind. The layers, outermost first:

1. A separate process (``python -I -B``: no PYTHON* variables, no user site, no bytecode written), in its own
   session so that it and anything it starts can be killed together; the parent only reads its capped output.
2. Kernel isolation when this machine allows it: new network namespace (no interface but a down loopback),
   PID namespace (the parent's processes and their /proc entries are invisible; killing the namespace's first
   process kills everything in it) and mount namespace, via util-linux ``unshare``. Run as root, the grader
   process also drops to user ``nobody`` with no capabilities (``setpriv``), so the kernel refuses it other
   users' files, signals to our processes, and new processes or threads (RLIMIT_NPROC, enforced for non-root).
   When Python is installed below a directory ``nobody`` cannot enter (e.g. /root, mode 0700), that directory
   is covered by an empty tmpfs in the grader's mount namespace and only Python's own directories are bound
   back into it: the grader can import Python and sees nothing else of /root. (Only if a Python directory itself
   is closed to others does it keep one capability, CAP_DAC_READ_SEARCH, leaving reads to layer 4.)
   Unprivileged, a user namespace provides the same namespaces, but the grader keeps the user's own rights, so
   file reads are limited by layer 4. If neither works, a warning is logged and layers 1, 3, 4 remain.
3. Resource limits: wall-clock timeout (default 2 min, the process group is killed), CPU seconds (same),
   address space (default 2 GiB), file size (1 GiB), 64 open files, no core dumps.
4. A ``sys.addaudithook`` hook installed before the grader's code runs refuses sockets, process creation and
   signals, ctypes native calls, interpreter introspection that could reach the hook, file writes outside the
   temporary directory, and file reads outside Python's own directories, /usr, /lib, /etc and that directory.
   A refused attempt fails the grade (``python_grader_forbidden``) even if the grader catches the error.
5. The environment is replaced: only PATH, LANG, HOME and TMPDIR (the temporary directory, deleted afterwards).

Audit hooks are not a security boundary on their own (CPython says so): native code in an installed extension
module can do what it likes. Layers 2 and 3 are what a hostile grader runs into when it gets past layer 4, so
run untrusted graders where layer 2 is available (Linux, as root in a container or with user namespaces).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import weakref
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from flywheel.graders.errors import (
    PYTHON_GRADER_FORBIDDEN,
    PYTHON_GRADER_MEMORY,
    PYTHON_GRADER_RUNTIME,
    PYTHON_GRADER_SERVER,
    PYTHON_GRADER_TIMEOUT,
    GraderError,
)

logger = logging.getLogger(__name__)

_RUNNER = Path(__file__).with_name("sandbox_runner.py")
_KINDS = {PYTHON_GRADER_RUNTIME, PYTHON_GRADER_MEMORY, PYTHON_GRADER_FORBIDDEN, PYTHON_GRADER_SERVER}
_OUTPUT_CAP = 1 << 20  # bytes kept of each of the grader's stdout and stderr; the rest is read and dropped


class SandboxLimits(BaseModel):
    """Per-grade limits (OpenAI's sandbox: 2 minutes, 2 GB of memory, 1 GB of disk)."""

    timeout_s: float = Field(120.0, gt=0)
    memory_mb: int = Field(2048, ge=64)
    file_size_mb: int = Field(1024, ge=1)


@functools.cache
def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _searchable_by_others(path: Path) -> bool:
    try:
        return bool(path.stat().st_mode & stat.S_IXOTH)
    except OSError:
        return False


def _python_dirs() -> list[Path]:
    """What the grader process must reach: the interpreter, its libraries, site-packages and the runner."""
    paths = {Path(sys.base_prefix), Path(sys.prefix), _RUNNER.parent}
    paths |= {Path(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    resolved = {path.resolve() for path in paths}
    return sorted(path for path in resolved if not any(other in path.parents for other in resolved))


def _closed_tops(python_dirs: list[Path]) -> set[Path] | None:
    """The outermost directories closed to others on the way to Python's directories (empty: none), or None if
    a Python directory itself is closed to others, which hiding cannot help."""
    hidden: set[Path] = set()
    for path in python_dirs:
        closed = [d for d in [*reversed(path.parents), path] if not _searchable_by_others(d)]
        if closed and closed[0] == path:
            return None
        hidden.update(closed[:1])
    return {d for d in hidden if not any(other in d.parents for other in hidden)}


def _hiding_script(python_dirs: list[Path], hidden: set[Path]) -> str:
    """A shell script, run as root in the grader's mount namespace, that covers each ``hidden`` directory with an
    empty tmpfs and binds Python's directories back (staged in $TMPDIR, which is mounted nowhere else)."""
    rebound = [path for path in python_dirs if any(d in path.parents for d in hidden)]
    q = shlex.quote
    lines = ["set -e", "umask 022", 'stage="$TMPDIR/.flywheel-binds"', 'mkdir "$stage"']
    lines += [f'mkdir "$stage/{i}"; mount --rbind {q(str(path))} "$stage/{i}"' for i, path in enumerate(rebound)]
    lines += [f"mount -t tmpfs -o mode=0755,size=1m flywheel-hidden {q(str(d))}" for d in sorted(hidden)]
    lines += [f'mkdir -p {q(str(path))}; mount --rbind "$stage/{i}" {q(str(path))}; umount -l "$stage/{i}"'
              for i, path in enumerate(rebound)]  # fmt: skip
    lines += ['rm -r "$stage"', "unset PWD OLDPWD", 'exec "$@"']  # the grader's environment stays as given
    return "\n".join(lines)


def _isolation_candidates() -> list[tuple[list[str], str]]:
    unshare, setpriv, sh = shutil.which("unshare"), shutil.which("setpriv"), shutil.which("sh")
    namespaces = ["--net", "--pid", "--fork", "--mount-proc", "--kill-child"]
    candidates: list[tuple[list[str], str]] = []
    if unshare and setpriv and sh and os.geteuid() == 0:
        uid, gid = _nobody()
        python_dirs = _python_dirs()
        hidden = _closed_tops(python_dirs)
        hide = [sh, "-c", _hiding_script(python_dirs, hidden), "sh"] if hidden else []
        # Read-search is the one capability kept, only where hiding cannot make Python reachable (see docstring).
        keep = ",+dac_read_search" if hidden is None else ""
        drop = [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs",
                f"--inh-caps=-all{keep}", f"--bounding-set=-all{keep}"]  # fmt: skip
        if keep:
            drop.append(f"--ambient-caps=-all{keep}")
        what = "network, PID and mount namespaces; user nobody" + (", closed directories hidden" if hidden else "")
        candidates.append(([unshare, *namespaces, "--", *hide, *drop, "--"], what))
    if unshare and os.geteuid() != 0:
        candidates.append(
            ([unshare, "--user", "--map-root-user", *namespaces, "--"], "user, network, PID and mount namespaces")
        )
    return candidates


@functools.cache
def isolation() -> tuple[tuple[str, ...], str]:
    """The command prefix that isolates grader processes on this machine, and what it provides (probed once)."""
    for prefix, description in _isolation_candidates():
        try:
            with tempfile.TemporaryDirectory(prefix="flywheel-grader-probe-") as tmpdir:
                probe = subprocess.run([*prefix, sys.executable, "-I", "-c", "import json"], capture_output=True,
                                       timeout=30, env={**os.environ, "TMPDIR": tmpdir})  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return tuple(prefix), description
    logger.warning(
        "python graders run without kernel isolation (no usable unshare/setpriv here): they are limited by "
        "resource limits and an audit hook only; see flywheel/graders/sandbox.py"
    )
    return (), "none (resource limits and audit hook only)"


async def _read_capped(stream: asyncio.StreamReader) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        if len(kept) < _OUTPUT_CAP:
            kept += chunk[: _OUTPUT_CAP - len(kept)]
    return bytes(kept)


def _failure(returncode: int, stderr: bytes, limits: SandboxLimits) -> GraderError:
    """Why a grader process ended without writing a result."""
    tail = stderr.decode(errors="replace")[-1500:]
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return GraderError(PYTHON_GRADER_TIMEOUT, f"used more than {math.ceil(limits.timeout_s)} s of CPU")
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return GraderError(PYTHON_GRADER_MEMORY, f"killed (SIGKILL), most likely out of memory; {tail}")
    return GraderError(PYTHON_GRADER_RUNTIME, f"the grader process exited with status {returncode}: {tail}")


class PythonSandbox:
    """Runs python graders, at most ``max_concurrency`` at a time (default: the number of CPUs)."""

    def __init__(self, limits: SandboxLimits | None = None, max_concurrency: int | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.max_concurrency = max_concurrency or os.cpu_count() or 1
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        # A semaphore belongs to one event loop; a sandbox may be used from several (one asyncio.run each).
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.max_concurrency)
        return self._slots[loop]

    async def run(self, source: str, sample: dict[str, Any], item: Any) -> float:
        """``grade(sample, item)`` of ``source``, or GraderError(python_grader_*) saying why there is none."""
        async with self._slot():
            prefix, _ = await asyncio.to_thread(isolation)
            tmpdir = tempfile.mkdtemp(prefix="flywheel-grader-")
            try:
                if prefix and os.geteuid() == 0:
                    os.chown(tmpdir, *_nobody())  # the grader runs as nobody: its one writable directory
                return await self._run(prefix, tmpdir, source, sample, item)
            finally:
                shutil.rmtree(tmpdir, ignore_errors=True)

    async def _run(self, prefix: tuple[str, ...], tmpdir: str, source: str, sample: dict[str, Any], item: Any) -> float:
        limits = self.limits
        job = {"source": source, "sample": sample, "item": item, "tmpdir": tmpdir,
               "limits": {"cpu_s": limits.timeout_s, "memory_mb": limits.memory_mb, "file_size_mb": limits.file_size_mb}}  # fmt: skip
        payload = json.dumps(job, default=str).encode()
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmpdir, "TMPDIR": tmpdir,
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # fmt: skip
        try:
            process = await asyncio.create_subprocess_exec(
                *prefix, sys.executable, "-I", "-B", str(_RUNNER),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                cwd=tmpdir, env=env, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            raise GraderError(PYTHON_GRADER_SERVER, f"could not start the grader process: {exc}") from None
        try:
            async with asyncio.timeout(limits.timeout_s):
                assert process.stdin and process.stdout and process.stderr
                try:
                    process.stdin.write(payload)
                    await process.stdin.drain()
                    process.stdin.close()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it died before reading: its status says why
                stdout, stderr = await asyncio.gather(_read_capped(process.stdout), _read_capped(process.stderr))
                returncode = await process.wait()
        except TimeoutError:
            raise GraderError(PYTHON_GRADER_TIMEOUT, f"ran longer than {limits.timeout_s:g} s") from None
        finally:
            if process.returncode is None:  # timed out or cancelled: kill it and whatever it started, then reap
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await process.wait()
        lines = stdout.decode(errors="replace").strip().splitlines()
        try:
            result = json.loads(lines[-1]) if lines else None
        except ValueError:
            result = None
        if not isinstance(result, dict):
            raise _failure(returncode, stderr, limits)
        if "score" in result:
            return float(result["score"])
        kind = result.get("error")
        raise GraderError(kind if kind in _KINDS else PYTHON_GRADER_RUNTIME, str(result.get("detail", ""))[:2000])

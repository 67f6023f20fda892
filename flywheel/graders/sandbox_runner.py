"""The program a python grader runs in: started by flywheel/graders/sandbox.py as ``python -I -B <this file>``.

Standard library only (it must not import flywheel, torch or anything of the parent's). It reads the job
(``source``, ``sample``, ``item``, ``tmpdir``, ``limits``) as JSON from stdin, lowers its resource limits,
installs an audit hook, runs ``grade(sample, item)`` and writes one JSON line, ``{"score": x}`` or
``{"error": kind, "detail": text}``, to the stdout it was given. The grader's own prints go to stderr.
"""

from __future__ import annotations

import ctypes  # noqa: F401  # imported before the hook: ctypes dlopen()s on import, and numpy imports ctypes
import json
import linecache
import math
import os
import resource
import sys
import traceback

_MIB = 1024 * 1024
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

# Audit events a grader may not raise, with the reason given to it.
_DENIED = {
    **dict.fromkeys(
        ["socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
         "socket.gethostbyname_ex", "socket.gethostbyaddr", "socket.getnameinfo", "socket.sendto", "socket.sendmsg"],
        "network access",
    ),
    **dict.fromkeys(
        ["os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "subprocess.Popen",
         "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill"],
        "starting or signalling processes",
    ),
    **dict.fromkeys(
        ["ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
         "ctypes.cdata/buffer", "ctypes.string_at", "ctypes.wstring_at"],
        "calling native code through ctypes",
    ),
    # Would let the grader reach (and rewrite) this hook's own state.
    **dict.fromkeys(
        ["gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace", "sys.setprofile",
         "sys._current_frames"],
        "introspecting the interpreter",
    ),
}  # fmt: skip
_DENIED_MODULES = {"_posixsubprocess": "starting processes"}  # no audit event guards its fork_exec
# Events that change the file system: (indexes of path arguments, indexes of dir_fd arguments).
_PATH_EVENTS = {
    "os.mkdir": ((0,), (2,)), "os.rmdir": ((0,), (1,)), "os.remove": ((0,), (1,)),
    "os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)), "os.symlink": ((1,), (2,)),
    "os.truncate": ((0,), ()), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)),
    "os.mknod": ((0,), (3,)), "os.mkfifo": ((0,), (2,)), "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
    "shutil.rmtree": ((0,), (1,)),
}  # fmt: skip


class SandboxViolation(PermissionError):
    """Raised into the grader when it tries something the sandbox forbids."""


def _lower(which: int, soft: int, hard: int) -> None:
    """Set a limit, never above the hard limit this process inherited (raising one needs a privilege the parent
    may lack: under ``ulimit -f 100000`` a grader gets 100000 blocks, not the sandbox's larger default)."""
    _, inherited = resource.getrlimit(which)
    if inherited != resource.RLIM_INFINITY:
        soft, hard = min(soft, inherited), min(hard, inherited)
    resource.setrlimit(which, (soft, hard))


def _limit(limits: dict[str, float]) -> None:
    cpu = math.ceil(limits["cpu_s"])
    _lower(resource.RLIMIT_CPU, cpu, cpu + 1)  # SIGXCPU at the soft limit, SIGKILL one second later
    _lower(resource.RLIMIT_AS, *(int(limits["memory_mb"] * _MIB),) * 2)
    _lower(resource.RLIMIT_FSIZE, *(int(limits["file_size_mb"] * _MIB),) * 2)
    _lower(resource.RLIMIT_NOFILE, 64, 64)
    _lower(resource.RLIMIT_CORE, 0, 0)
    # No new processes or threads. The kernel enforces this for any user but root; the audit hook covers root.
    _lower(resource.RLIMIT_NPROC, 0, 0)


def _within(path: str, roots: tuple[str, ...]) -> bool:
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def _install_hook(tmpdir: str) -> list[str]:
    """Install the audit hook; return the list it appends each refused attempt to."""
    writable = (os.path.realpath(tmpdir), "/dev/null")
    readable = (
        tuple(
            {
                os.path.realpath(p)
                for p in [*sys.path, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
                if p
            }
            | {"/usr", "/lib", "/lib64", "/etc", "/dev/urandom", "/dev/zero", os.path.realpath("/proc/self")}
            | {os.path.realpath(__file__)}  # tracebacks quote this file's lines
        )
        + writable
    )
    violations: list[str] = []

    def deny(what: str) -> None:
        violations.append(what)
        raise SandboxViolation(f"python graders may not do this: {what}")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            path = os.fsdecode(path)
            writing = any(c in mode for c in "wax+") if mode else bool(flags & _WRITE_FLAGS)
            if writing and (not _within(path, writable) or (mode is None and not os.path.isabs(path))):
                # os.open() may be relative to a dir_fd the event does not show: only absolute paths are checked.
                deny(f"writing {path} (only the grader's temporary directory {tmpdir} is writable)")
            elif not writing and not _within(path, readable):
                deny(f"reading {path} (outside Python's own directories and the temporary directory)")
        elif event in _DENIED:
            deny(f"{_DENIED[event]} ({event})")
        elif event == "import" and args[0] in _DENIED_MODULES:
            deny(f"{_DENIED_MODULES[args[0]]} (import {args[0]})")
        elif event in _PATH_EVENTS:
            paths, dir_fds = _PATH_EVENTS[event]
            if any(i < len(args) and args[i] not in (None, -1) for i in dir_fds):
                deny(f"{event} relative to a directory descriptor")
            for i in paths:
                if i < len(args) and isinstance(args[i], (str, bytes, os.PathLike)):
                    path = os.fsdecode(args[i])
                    if not _within(path, writable):
                        deny(f"{event} on {path} (only the temporary directory {tmpdir} may change)")

    sys.addaudithook(hook)
    return violations


def _grade(job: dict, violations: list[str]) -> dict[str, object]:
    source = job["source"]
    linecache.cache["<grader>"] = (len(source), None, source.splitlines(True), "<grader>")  # source in tracebacks
    try:
        namespace: dict[str, object] = {"__name__": "grader"}
        exec(compile(source, "<grader>", "exec"), namespace)
        score = namespace["grade"](job["sample"], job["item"])  # type: ignore[operator]
    except MemoryError:
        return {
            "error": "python_grader_memory",
            "detail": f"ran out of memory (limit {job['limits']['memory_mb']:g} MiB)",
        }
    except BaseException:  # SystemExit and KeyboardInterrupt included: any way out of grade() is a failure
        detail = "".join(traceback.format_exc())[-2000:]
        return {"error": "python_grader_runtime_error", "detail": detail}
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return {
            "error": "python_grader_runtime_error",
            "detail": f"grade() returned {score!r:.200}, not a finite number",
        }
    return {"score": float(score)}


def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    result_fd = os.dup(1)
    os.dup2(2, 1)  # whatever the grader prints goes to stderr, not into the result
    sys.dont_write_bytecode = True
    try:
        _limit(job["limits"])
    except (OSError, ValueError) as exc:  # the sandbox could not be set up: not the grader's fault
        os.write(
            result_fd, (json.dumps({"error": "python_grader_server_error", "detail": f"limits: {exc}"}) + "\n").encode()
        )
        return
    violations = _install_hook(job["tmpdir"])
    result = _grade(job, violations)
    if violations:  # even if the grader caught the refusal, it tried: the grade does not count
        result = {"error": "python_grader_forbidden", "detail": "; ".join(dict.fromkeys(violations))[:2000]}
    os.write(result_fd, (json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()

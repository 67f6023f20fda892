"""Running a benchmark's sides in fresh processes, and summarising repeated runs.

Each side of a comparison runs in a child process of its own (the same script, with internal arguments): two
torch workloads in one process each get an OpenMP team, and on a small machine more OpenMP threads than cores make
libgomp stop spinning between parallel regions, which slows both sides; memory one side left behind would also
count against the other."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

RESULT = "block result: "


def run_child(script: str, args: list[str], what: str, python: str | Path = sys.executable) -> dict:
    """Run ``script`` with ``args`` in a child process (of ``python``: another virtualenv's, for a side whose
    dependencies conflict with Flywheel's) and return the JSON it printed after ``RESULT``."""
    out = subprocess.run([str(python), script, *args], capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(RESULT))


def report(result: dict) -> None:
    """What a child prints for ``run_child``."""
    print(RESULT + json.dumps(result), flush=True)


def summary(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "runs": xs}

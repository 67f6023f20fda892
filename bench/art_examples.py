"""ART's own example scripts run on Flywheel with only the package name and the base model changed (issue #26).

Given an ART checkout (a work tree or a bare git directory, e.g. a mirror), each chosen example is copied into a
temporary directory, and its Python files are rewritten in exactly these ways, each substitution printed:

1. the package name: ``import art`` -> ``import flywheel as art``, ``from art import`` / ``from art.X import`` ->
   ``from flywheel import`` / ``from flywheel.X import``;
2. the base model: a ``base_model="..."`` argument and a ``BASE_MODEL = "..."`` constant -> the embedded model
   (``--base-model``);
3. sizes, because a CPU cannot run ART's (dozens of rollouts, hundreds of steps): the substitutions listed per
   example in ``EXAMPLES`` below (steps, groups, rollouts per group, validation set), each one exact text that must
   still be found in the script (a script that changed upstream is an error here, not a silent skip).

Nothing else in their code changes. Each script then runs in a subprocess (its own directory as the working
directory, ``BACKUP_BUCKET`` a ``file://`` directory for ART's checkpoint sync, ``--deps`` prepended to
``PYTHONPATH`` for packages their scripts import that Flywheel does not need) with a timeout, one at a time, and
the result is ``ran`` (exit 0), ``failed`` with the first error (the exception line of the first traceback, or the
last line printed), ``timeout``, or ``not run`` (the checkout lacks a file's contents). The scripts' own imports
(``python-dotenv``, ``openpipe``, ``weave``...) are not Flywheel's dependencies: install them into a separate
directory so that their pins (``openpipe`` pins an old ``openai``) do not change the environment::

    pip install --no-deps --target /tmp/art-example-deps openpipe weave gql graphql-core polyfile-weave \\
        diskcache-weave sentry-sdk abnf cint fickling graphviz intervaltree kaitaistruct pdfminer.six chardet \\
        sortedcontainers cachetools datasets dill multiprocess pandas pyarrow polars polars-runtime-32 panza
    pip install --no-deps --target /tmp/art-e-deps litellm==1.65.0.post1  # ART-E's lock (newer: no DISK cache)

ART-E runs with ``--deps /tmp/art-e-deps --deps /tmp/art-example-deps`` (the first wins), the others with
``--deps /tmp/art-example-deps``. A file the ART copy lacks (a mirror without its large files: temporal-clue's
``examples/data/temporal-clue/puzzles.json``) can be given with ``--data ART_PATH=FILE``, reported beside the
overrides; ``bench/temporal_clue_puzzles.py`` builds temporal-clue's from its generator.

Usage: ``python bench/art_examples.py ART_DIR [--commit HEAD] [--only tic-tac-toe 2048 ...] [--timeout 300]
[--deps /tmp/art-example-deps] [--data ART_PATH=FILE] [--keep]``; prints a Markdown table and writes
bench/results/art-examples-<time>.json. Waits while ``/tmp/QUIET`` exists (a benchmark that must run alone).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

EMBEDDED_MODEL = "smollm2-135m-instruct"  # flywheel.inference.loading.EMBEDDED_MODEL, without importing torch here
QUIET = Path("/tmp/QUIET")

IMPORT_REWRITES = (
    (re.compile(r"^(\s*)import art\s*$", re.MULTILINE), r"\1import flywheel as art"),
    (re.compile(r"^(\s*)from art((?:\.\w+)*) import ", re.MULTILINE), r"\1from flywheel\2 import "),
)
BASE_MODEL_REWRITES = (
    re.compile(r"(\bbase_model\s*=\s*)(['\"])[^'\"\n]*\2"),
    re.compile(r"^(BASE_MODEL\s*=\s*)(['\"])[^'\"\n]*\2", re.MULTILINE),
)


@dataclass(frozen=True)
class Override:
    """One size substitution: ``old`` (exact text, found at least once) -> ``new`` in ``file``."""

    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Example:
    """An ART example: the paths copied from ART's tree, the script run (relative to the copy), its size overrides,
    the environment it is given, and what it needs that no CPU-only machine has (said in the report)."""

    name: str
    paths: tuple[str, ...]
    script: str
    overrides: tuple[Override, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    python_path: tuple[str, ...] = ()
    needs: str = ""


EXAMPLES = (
    Example(
        name="tic-tac-toe",
        paths=("examples/tic_tac_toe",),
        script="examples/tic_tac_toe/tic-tac-toe.py",
        overrides=(
            Override("examples/tic_tac_toe/tic-tac-toe.py", "STEP = 50", "STEP = 2"),
            Override("examples/tic_tac_toe/tic-tac-toe.py", "for _ in range(96)", "for _ in range(4)"),
        ),
    ),
    Example(
        name="2048",
        paths=("examples/2048",),
        script="examples/2048/2048.py",
        overrides=(
            Override("examples/2048/2048.py", "range(await model.get_step(), 100)", "range(await model.get_step(), 1)"),
            Override("examples/2048/2048.py", "for _ in range(48)", "for _ in range(2)"),
        ),
    ),
    Example(
        name="temporal-clue",
        paths=("examples/temporal_clue", "examples/data/temporal-clue"),
        script="examples/temporal_clue/temporal-clue.py",
        overrides=(
            Override("examples/temporal_clue/temporal-clue.py", "puzzles[:64]", "puzzles[:1]"),
            Override("examples/temporal_clue/temporal-clue.py", "range(50)", "range(3)"),
            Override("examples/temporal_clue/temporal-clue.py", "stride = 4", "stride = 1"),
            Override(
                "examples/temporal_clue/temporal-clue.py",
                "range(await model.get_step(), 1_000)",
                "range(await model.get_step(), 2)",
            ),
        ),
    ),
    Example(
        name="benchmarking-comparison-models",
        paths=("examples/benchmarking_comparison_models.py",),
        script="examples/benchmarking_comparison_models.py",
        overrides=(Override("examples/benchmarking_comparison_models.py", "range(6)", "range(2)"),),
        needs="OpenAI and OpenRouter for its prompted baselines (their rollouts fail in place: max_exceptions=100)",
    ),
    Example(
        name="tic-tac-toe-self-play",
        paths=("examples/tic_tac_toe_self_play",),
        script="examples/tic_tac_toe_self_play/train.py",
        overrides=(
            Override("examples/tic_tac_toe_self_play/train.py", "STEP = 300", "STEP = 1"),
            Override("examples/tic_tac_toe_self_play/train.py", "for j in range(96)", "for j in range(2)"),
        ),
        needs="OpenAI (o4-mini is the teacher and the validation opponent): OPENAI_API_KEY (any value reaches the call)",
    ),
    Example(
        name="hn-title-generator",
        paths=("examples/hn_title_generator",),
        script="examples/hn_title_generator/train.py",
        needs="its data set and the base model's tokenizer from the Hugging Face hub: a network",
    ),
    Example(
        name="art-e",
        paths=("examples/art-e",),
        script="examples/art-e/art_e/train.py",
        env={"RUN_ID": "002"},
        python_path=("examples/art-e",),
        needs="its data sets from the Hugging Face hub (corbt/enron-emails and the synthetic queries): a network",
    ),
)


@dataclass
class Result:
    name: str
    commit: str
    overrides: list[str]
    supplied: list[str]  # files the ART copy lacked, given with --data
    result: str  # ran | failed | timeout | not run
    error: str
    seconds: float
    log: str
    needs: str


def art_commit(art_dir: Path, commit: str) -> str:
    return subprocess.run(
        ["git", "-C", str(art_dir), "rev-parse", commit], check=True, capture_output=True, text=True
    ).stdout.strip()


def copy_from_art(
    art_dir: Path, commit: str, paths: tuple[str, ...], into: Path, supplied: dict[str, Path]
) -> list[str]:
    """``paths`` of ART's tree at ``commit`` under ``into``, file by file (a bare directory works too); a file whose
    contents the copy does not hold (a mirror without its large files) is taken from ``supplied`` (``--data``), else
    an error naming it. Returns what was supplied, as ``path <- file``."""
    listing = subprocess.run(
        ["git", "-C", str(art_dir), "ls-tree", "-r", "--name-only", commit, "--", *paths],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    if not listing:
        raise FileNotFoundError(f"ART {commit[:12]} has none of {', '.join(paths)}")
    used = []
    for name in listing:
        blob = subprocess.run(["git", "-C", str(art_dir), "show", f"{commit}:{name}"], capture_output=True)
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        if blob.returncode == 0:
            (into / name).write_bytes(blob.stdout)
        elif name in supplied:
            shutil.copyfile(supplied[name], into / name)
            used.append(f"{name} <- {supplied[name]}")
            print(f"  {name}: not in this ART copy, supplied: {supplied[name]}")
        else:
            raise FileNotFoundError(
                f"this ART copy lacks the contents of {name} ({blob.stderr.decode().strip()}): "
                f"give it with --data {name}=FILE"
            )
    return used


def substitute(path: Path, pattern: re.Pattern[str] | str, new: str, *, required: bool) -> None:
    """Replace in ``path`` (a regex, or exact text) and print each substitution."""
    text = path.read_text()
    if isinstance(pattern, str):
        if required and pattern not in text:
            raise ValueError(f"{path}: the size override {pattern!r} no longer matches (ART changed the script?)")
        pattern, new = re.compile(re.escape(pattern)), new.replace("\\", "\\\\")
    matches = list(pattern.finditer(text))
    for match in matches:
        print(f"  {path.name}: {match.group().strip()!r} -> {match.expand(new).strip()!r}")
    if matches:
        path.write_text(pattern.sub(new, text))


def prepare(example: Example, root: Path, base_model: str) -> list[str]:
    """Rewrite the copied example: package name and base model in every .py file, then its size overrides."""
    for path in sorted(root.rglob("*.py")):
        for pattern, new in IMPORT_REWRITES:
            substitute(path, pattern, new, required=False)
        for pattern in BASE_MODEL_REWRITES:
            substitute(path, pattern, rf'\1"{base_model}"', required=False)
    for override in example.overrides:
        substitute(root / override.file, override.old, override.new, required=True)
    return [f"{o.old} -> {o.new}" for o in example.overrides]


CHAINED = ("The above exception was the direct cause", "During handling of the above exception")


def first_error(output: str) -> str:
    """The exception line of the first traceback (e.g. ``AttributeError: ...``), followed to the last exception of
    its chain (``raise ... from``) with the notes printed under it, else the last line printed."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), None)
    if start is None:
        return next((line.strip() for line in reversed(lines) if line.strip()), "")
    error: list[str] = []
    ended = False  # the exception's message and notes are over: only a chained traceback goes on
    for line in lines[start + 1 :]:
        if line.startswith(CHAINED):
            error, ended = [], False
        elif not line.strip() or line.startswith(("Traceback", " ", "\t")) or "%|" in line:  # "%|": a progress bar
            ended = ended or bool(error)
        elif ended:
            break
        else:
            error.append(line.strip())
    return " ".join(error)


def run(example: Example, art_dir: Path, commit: str, args: argparse.Namespace, work: Path) -> Result:
    while QUIET.exists():  # a benchmark that must run alone
        time.sleep(15)
    root = work / example.name
    root.mkdir()
    print(f"{example.name}: ART {commit[:12]}, {', '.join(example.paths)} -> {root}")
    try:
        supplied = copy_from_art(art_dir, commit, example.paths, root, args.data)
    except FileNotFoundError as exc:  # e.g. a mirror without the large files (their data sets)
        error = f"not copied: {exc}"
        print(f"  {error}")
        return Result(example.name, commit, [], [], "not run", error, 0.0, "", example.needs)
    overrides = prepare(example, root, args.base_model)
    script = root / example.script
    python_path = [str(root / p) for p in example.python_path] + [str(d) for d in args.deps]
    env = {
        **os.environ,
        "BACKUP_BUCKET": f"file://{work / 'bucket'}",
        "PYTHONPATH": os.pathsep.join([*python_path, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep),
        **example.env,
    }
    log = work / f"{example.name}.log"
    start = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, script.name],
            cwd=script.parent,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its process group: a timeout ends it and whatever it started
        )
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    seconds = time.monotonic() - start
    output = log.read_text(errors="replace")
    result = "ran" if code == 0 else "timeout" if code is None else "failed"
    if code is None:
        error = f"still running after {args.timeout}s"
    elif code != 0 or "Traceback (most recent call last)" in output:  # a traceback printed on the way counts too
        error = first_error(output)
    else:
        error = ""
    print(f"  {result} in {seconds:.0f}s{': ' + error if error else ''} (log: {log})")
    return Result(example.name, commit, overrides, supplied, result, error, round(seconds, 1), str(log), example.needs)


def cpu() -> str:
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return f"{value.strip()}, {os.cpu_count()} cores"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def data_file(value: str) -> tuple[str, Path]:
    """``--data ART_PATH=FILE``: FILE must exist."""
    name, sep, file = value.partition("=")
    if not sep or not name or not Path(file).is_file():
        raise argparse.ArgumentTypeError(f"expected ART_PATH=FILE with an existing FILE, got {value!r}")
    return name, Path(file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("art", type=Path, help="an ART checkout or bare git directory")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--only", nargs="+", choices=[e.name for e in EXAMPLES], help="these examples, in order")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per script")
    parser.add_argument(
        "--deps",
        type=Path,
        action="append",
        default=[],
        help="a directory of the scripts' own imports (pip install --target); repeat for several, first wins",
    )
    parser.add_argument(
        "--data",
        type=data_file,
        action="append",
        default=[],
        metavar="ART_PATH=FILE",
        help="the contents of a file this ART copy lacks (e.g. temporal-clue's puzzles.json); repeat for several",
    )
    parser.add_argument("--base-model", default=EMBEDDED_MODEL)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (the copies, logs)")
    args = parser.parse_args()
    args.data = dict(args.data)
    commit = art_commit(args.art, args.commit)
    chosen = [e for name in args.only for e in EXAMPLES if e.name == name] if args.only else list(EXAMPLES)
    work = Path(tempfile.mkdtemp(prefix="art-examples-"))
    try:
        results = [run(example, args.art, commit, args, work) for example in chosen]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    machine = cpu()
    print("\n| script | ART commit | overrides | result | time | CPU |\n|---|---|---|---|---|---|")
    for r in results:
        outcome = r.result + (f": `{r.error}`" if r.error else "")
        print(
            f"| {r.name} | {r.commit[:12]} | {'; '.join(f'`{o}`' for o in r.overrides + r.supplied) or 'none'} | "
            f"{outcome} | "
            f"{r.seconds:.0f} s | {machine} |"
        )
    out = Path(__file__).parent / "results" / f"art-examples-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"cpu": machine, "results": [asdict(r) for r in results]}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

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

A notebook (ART's MCP example is one) is first made a script: its code cells in order, in a ``.py`` file beside it;
a line for IPython's shell (``!uv pip install ...``) is commented out, printed; the script then runs with top-level
``await`` allowed, as in a notebook. Settings its configuration cell asks the user to fill in (an API key) are
overrides too, listed beside the sizes.

Nothing else in their code changes. Each script then runs in a subprocess (its own directory as the working
directory, ``BACKUP_BUCKET`` a ``file://`` directory for ART's checkpoint sync, ``--deps`` prepended to
``PYTHONPATH`` for packages their scripts import that Flywheel does not need) with a timeout, one at a time, and
the result is ``ran`` (exit 0), ``failed`` with the first error (the exception line of the first traceback, or the
last line printed; an HTTP client's error adds the URL it called), ``timeout``, or ``not run`` (the checkout lacks a
file's contents, or a module the example needs is not installed: ``fastmcp`` for the MCP example, the optional
extra ``pip install 'flywheel-rl[art-examples]'``). The scripts' own imports
(``python-dotenv``, ``openpipe``, ``weave``...) are not Flywheel's dependencies: install them into a separate
directory so that their pins (``openpipe`` pins an old ``openai``) do not change the environment::

    pip install --no-deps --target /tmp/art-example-deps openpipe weave gql graphql-core polyfile-weave \\
        diskcache-weave sentry-sdk abnf cint fickling graphviz intervaltree kaitaistruct pdfminer.six chardet \\
        sortedcontainers cachetools datasets dill multiprocess pandas pyarrow polars polars-runtime-32 panza
    pip install --no-deps --target /tmp/art-e-deps litellm==1.65.0.post1  # ART-E's lock (newer: no DISK cache)

ART-E runs with ``--deps /tmp/art-e-deps --deps /tmp/art-example-deps`` (the first wins), the others with
``--deps /tmp/art-example-deps``. A file the ART copy lacks (a mirror without its large files: temporal-clue's
``examples/data/temporal-clue/puzzles.json``; the MCP notebook, newer than the mirror) can be given with ``--data
ART_PATH=FILE``, which also replaces a file the copy has (easier puzzles), reported beside the overrides;
``bench/temporal_clue_puzzles.py`` builds temporal-clue's from its generator. Each result also says what the
``history.jsonl`` of the models a script made records: steps trained, steps skipped for want of signal (every reward
of every group the same), the train reward.

Usage: ``python bench/art_examples.py ART_DIR [--commit HEAD] [--only tic-tac-toe 2048 ...] [--timeout 300]
[--deps /tmp/art-example-deps] [--data ART_PATH=FILE] [--keep]``; prints a Markdown table and writes
bench/results/art-examples-<time>.json. Waits while ``/tmp/QUIET`` exists (a benchmark that must run alone).
"""

from __future__ import annotations

import argparse
import importlib.util
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
SHELL_LINE = re.compile(r"^(\s*)([!%].*)$", re.MULTILINE)  # IPython's ``!command`` and ``%magic`` lines
# A notebook made a script runs as a notebook does: top-level ``await`` allowed; an HTTP client's error (openai's
# APIConnectionError, httpx's) says which URL it called, so that a stop for want of a network names the service.
NOTEBOOK_RUNNER = """
import ast, asyncio, inspect, sys, types
path = sys.argv[1]
sys.argv = [path]
module = types.ModuleType("__main__")
module.__file__ = path
sys.modules["__main__"] = module
code = compile(open(path).read(), path, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
try:
    result = eval(code, module.__dict__)
    if inspect.iscoroutine(result):
        asyncio.run(result)
except Exception as exc:
    request = getattr(exc, "request", None)
    if request is not None and hasattr(request, "url"):
        exc.add_note(f"the notebook failed calling {request.method} {request.url}")
    raise
"""


@dataclass(frozen=True)
class Override:
    """One size substitution: ``old`` (exact text, found at least once) -> ``new`` in ``file``."""

    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Example:
    """An ART example: the paths copied from ART's tree, the script run (relative to the copy; a notebook is made a
    script first), its size overrides, the environment it is given, the modules it imports that Flywheel does not
    need (checked before it runs), and what it needs that no CPU-only machine has (said in the report)."""

    name: str
    paths: tuple[str, ...]
    script: str
    overrides: tuple[Override, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    python_path: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    needs: str = ""


MCP_RL = "examples/mcp-rl/mcp-rl-alphavantage.py"  # the notebook made a script
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
            Override("examples/temporal_clue/temporal-clue.py", "range(50)", "range(32)"),
            Override("examples/temporal_clue/temporal-clue.py", "stride = 4", "stride = 1"),
            Override(
                "examples/temporal_clue/temporal-clue.py",
                "range(await model.get_step(), 1_000)",
                "range(await model.get_step(), 1)",
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
    Example(
        name="mcp-rl",
        paths=("examples/mcp-rl/mcp-rl-alphavantage.ipynb",),
        script="examples/mcp-rl/mcp-rl-alphavantage.ipynb",
        overrides=(
            Override(MCP_RL, 'OPENROUTER_API_KEY = ""', 'OPENROUTER_API_KEY = "sk-no-network"'),
            Override(MCP_RL, '"num_training_inputs": 16', '"num_training_inputs": 2'),
            Override(MCP_RL, '"num_epochs": 3', '"num_epochs": 1'),
            Override(MCP_RL, '"rollouts_per_group": 3', '"rollouts_per_group": 2'),
            Override(MCP_RL, "MAX_TURNS = 10", "MAX_TURNS = 2"),
            Override(MCP_RL, "NUM_TEST_INPUTS = 8", "NUM_TEST_INPUTS = 1"),
        ),
        requires=("fastmcp", "aiohttp", "tenacity", "dotenv"),
        needs="OpenRouter (o4-mini writes its scenarios, at a hard-coded https://openrouter.ai/api/v1, and is its "
        "RULER judge) and the Alpha Vantage API behind its MCP tools: a network",
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
    training: str = ""  # what its models' history says: steps trained, skipped for want of signal, train reward


def training_summary(root: Path) -> str:
    """The train rows of every model directory's ``history.jsonl`` under the example's copy (not the bucket):
    ``<project>/<model>: N trained, M skipped (no signal), train reward mean ... (max ...)``; empty if none."""
    summaries = []
    for history in sorted(root.rglob("history.jsonl")):
        rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
        train = [row for row in rows if row.get("split") == "train" and "skipped" in row]
        if not train:
            continue
        skipped = sum(1 for row in train if row["skipped"] and row.get("skip_reason") == 1.0)
        empty = sum(1 for row in train if row["skipped"] and row.get("skip_reason") != 1.0)
        rewards = [row.get("reward_mean", 0.0) for row in train]
        summaries.append(
            f"{history.parent.parent.parent.name}/{history.parent.name}: {len(train) - skipped - empty} trained, "
            f"{skipped} skipped (no signal){f', {empty} with no optimizer step' if empty else ''}, "
            f"train reward mean {sum(rewards) / len(rewards):.3f} "
            f"(max {max(rewards):.3f})"
        )
    return "; ".join(summaries)


def art_commit(art_dir: Path, commit: str) -> str:
    return subprocess.run(
        ["git", "-C", str(art_dir), "rev-parse", commit], check=True, capture_output=True, text=True
    ).stdout.strip()


def copy_from_art(
    art_dir: Path, commit: str, paths: tuple[str, ...], into: Path, supplied: dict[str, Path]
) -> list[str]:
    """``paths`` of ART's tree at ``commit`` under ``into``, file by file (a bare directory works too); a file whose
    contents the copy does not hold (a mirror without its large files), or that is not in its tree at all (a file
    newer than the copy), is taken from ``supplied`` (``--data``, which also replaces a file the copy has), else an
    error naming it. Returns what was supplied, as ``path <- file``."""
    listing = subprocess.run(
        ["git", "-C", str(art_dir), "ls-tree", "-r", "--name-only", commit, "--", *paths],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    listing += [
        name
        for name in supplied
        if name not in listing and any(name == p or name.startswith(p.rstrip("/") + "/") for p in paths)
    ]
    if not listing:
        raise FileNotFoundError(f"ART {commit[:12]} has none of {', '.join(paths)}")
    used = []
    for name in listing:
        blob = subprocess.run(["git", "-C", str(art_dir), "show", f"{commit}:{name}"], capture_output=True)
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        if name in supplied:
            shutil.copyfile(supplied[name], into / name)
            used.append(f"{name} <- {supplied[name]}")
            print(f"  {name}: {'not in this ART copy' if blob.returncode else 'replaced'}, supplied: {supplied[name]}")
        elif blob.returncode == 0:
            (into / name).write_bytes(blob.stdout)
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


def notebook_script(notebook: Path) -> Path:
    """The notebook's code cells, in order, as a script beside it (``<name>.py``), each cell after a comment naming
    it; IPython's shell and magic lines commented out, each printed."""
    cells = json.loads(notebook.read_text())["cells"]
    parts = []
    for number, cell in enumerate(cells, 1):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        for match in SHELL_LINE.finditer(source):
            print(f"  {notebook.name}: cell {number}: {match.group(2)!r} not run (an IPython shell line)")
        parts.append(f"# %% cell {number}\n" + SHELL_LINE.sub(r"\1# (not run) \2", source).rstrip() + "\n")
    script = notebook.with_suffix(".py")
    script.write_text("\n\n".join(parts))
    print(f"  {notebook.name}: {len(parts)} code cells -> {script.name}")
    return script


def prepare(example: Example, root: Path, base_model: str) -> list[str]:
    """Rewrite the copied example (a notebook made a script first): package name and base model in every .py file,
    then its size overrides."""
    if example.script.endswith(".ipynb"):
        notebook_script(root / example.script)
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
    missing = [name for name in example.requires if importlib.util.find_spec(name) is None]
    if missing:
        error = f"needs {', '.join(missing)}: pip install 'flywheel-rl[art-examples]'"
        print(f"  not run: {error}")
        return Result(example.name, commit, [], supplied, "not run", error, 0.0, "", example.needs)
    overrides = prepare(example, root, args.base_model)
    script = root / example.script
    command = [sys.executable, script.name]
    if script.suffix == ".ipynb":
        script = script.with_suffix(".py")
        command = [sys.executable, "-c", NOTEBOOK_RUNNER, script.name]
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
            command,
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
    training = training_summary(root)
    print(
        f"  {result} in {seconds:.0f}s{': ' + error if error else ''} (log: {log}){'; ' + training if training else ''}"
    )
    return Result(
        example.name, commit, overrides, supplied, result, error, round(seconds, 1), str(log), example.needs, training
    )


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
        help="the contents of a file this ART copy lacks or that is to be replaced (e.g. temporal-clue's puzzles.json, "
        "the MCP notebook); repeat for several",
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
        outcome = r.result + (f": `{r.error}`" if r.error else "") + (f" ({r.training})" if r.training else "")
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

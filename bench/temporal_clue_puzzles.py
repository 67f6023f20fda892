"""ART's temporal-clue puzzle file, built from its generator when an ART copy lacks it (issue #26).

ART's ``examples/temporal_clue/temporal-clue.py`` reads ``examples/data/temporal-clue/puzzles.json``: a JSON list of
``{"num_clues", "prompt", "solution"}``, of which it takes ``[:64]`` to validate, ``[64:128]`` as its test set and
``[128:]`` to train. A mirror without ART's large files lacks it. The puzzles come from Brad Hilton's generator,
github.com/bradhilton/temporal-clue (OR-Tools' CP-SAT picks the clues), which publishes ``puzzles/val.json`` and
``puzzles/test.json`` (64 each, the same format) and ``puzzles/train.json`` (absent from the mirror too). This
script writes, in ART's order: the published validation and test puzzles, then ``--train`` training puzzles made by
the generator's own ``TemporalClueScenario(min_players=, max_players=).create_puzzle().json_data()`` with
``random.seed(--seed)``: ``--players 1 2`` (the default) are the settings of the generator's example notebook,
small puzzles (2-5 suspects, 3-26 clues; the published ones have up to 10 suspects and 100 clues); ``--players 1 1``
makes the smallest it can (2 suspects, 2 weapons, 2 rooms, 5-8 questions), the easiest to answer for a small model
and the shortest prompts for a CPU. Their solutions are ART's format, so ART's partial credit (the share of questions
answered right) scores them as it scores its own.

The generator needs Python 3.12 (its f-strings), ``ortools==9.11.4210`` (its lock), ``black`` and ``pillow``,
none of them Flywheel's: it runs in a subprocess of ``--python``, with those installed beside the environment
(``--deps``)::

    python3.12 -m pip install --target /tmp/temporal-clue-deps ortools==9.11.4210 black pillow
    python bench/temporal_clue_puzzles.py GENERATOR_CHECKOUT --python python3.12 --deps /tmp/temporal-clue-deps \\
        --out /tmp/puzzles.json
    python bench/art_examples.py ART_CHECKOUT --only temporal-clue \\
        --data examples/data/temporal-clue/puzzles.json=/tmp/puzzles.json --deps /tmp/art-example-deps

``GENERATOR_CHECKOUT`` is a work tree or a bare git directory (e.g. a mirror); ``--commit`` picks its revision.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

PUBLISHED = ("puzzles/val.json", "puzzles/test.json")  # ART's [:64] and [64:128]
GENERATE = """
import json, random, sys
from temporal_clue import TemporalClueScenario
seed, count, low, high, out = sys.argv[1:]
random.seed(int(seed))
puzzles = [
    TemporalClueScenario(min_players=int(low), max_players=int(high)).create_puzzle().json_data()
    for _ in range(int(count))
]
open(out, "w").write(json.dumps(puzzles))
"""


def git_show(checkout: Path, commit: str, path: str) -> bytes:
    """``path`` at ``commit``; an error naming it when the checkout lacks its contents."""
    blob = subprocess.run(["git", "-C", str(checkout), "show", f"{commit}:{path}"], capture_output=True)
    if blob.returncode != 0:
        raise SystemExit(f"{checkout} lacks {path} at {commit}: {blob.stderr.decode().strip()}")
    return blob.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("generator", type=Path, help="a bradhilton/temporal-clue checkout or bare git directory")
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--train", type=int, default=16, help="training puzzles to generate")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--players", type=int, nargs=2, default=(1, 2), metavar=("MIN", "MAX"))
    parser.add_argument("--python", default="python3.12", help="the interpreter that runs the generator (3.12+)")
    parser.add_argument("--deps", type=Path, action="append", default=[], help="where ortools and black are")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    puzzles: list[dict[str, object]] = []
    for path in PUBLISHED:
        puzzles += json.loads(git_show(args.generator, args.commit, path))
    names = subprocess.run(
        ["git", "-C", str(args.generator), "ls-tree", "-r", "--name-only", args.commit, "--", "temporal_clue"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    with tempfile.TemporaryDirectory(prefix="temporal-clue-") as work:
        for name in names:
            (Path(work) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(work) / name).write_bytes(git_show(args.generator, args.commit, name))
        made = Path(work) / "train.json"
        path = os.pathsep.join([work, *map(str, args.deps), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
        low, high = args.players
        subprocess.run(
            [args.python, "-c", GENERATE, str(args.seed), str(args.train), str(low), str(high), str(made)],
            check=True,
            env={**os.environ, "PYTHONPATH": path},
        )
        train = json.loads(made.read_text())
    puzzles += train
    args.out.write_text(json.dumps(puzzles, indent=1) + "\n")
    print(
        f"wrote {args.out}: {len(puzzles) - len(train)} published ({', '.join(PUBLISHED)}), {len(train)} generated "
        f"(seed {args.seed}, {low}-{high} players)"
    )


if __name__ == "__main__":
    main()

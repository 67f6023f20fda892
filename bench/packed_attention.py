"""One layer's training attention (``kv_attention._packed``) on packed micro-batch layouts: forward and backward of
random bf16 q/k/v with SmolLM2-135M's heads (9 query, 3 K/V, 64 dims), best of ``--reps``; no model.

    .venv/bin/python bench/packed_attention.py [--threads 2] [--reps 3] [--label after]

Writes bench/results/packed_attention-<time>.json. To time another tree's attention (e.g. before a change), put
that tree first on the path: ``git archive <commit> flywheel | tar -x -C /tmp/old`` and ``PYTHONPATH=/tmp/old``.
"""

from __future__ import annotations

import argparse
import time

import torch
from machine import describe, save_result  # bench/machine.py

from flywheel.inference import kv_attention

# (name, segment lengths, the segment each continues or -1): rows of the support job's RL and SFT micro-batches
# (docs/benchmarks.md, "Where an RL step's time goes"), and the small GRPO group _small_attention is for
LAYOUTS = [
    ("lone 1946", [1946], [-1]),
    ("[728, 406 x 3]", [728, 406, 406, 406], [-1, 0, 0, 0]),
    ("[728, 804, 489]", [728, 804, 489], [-1, 0, 0]),
    ("[914, 384, 125 x 3, 210]", [914, 384, 125, 125, 125, 210], [-1, 0, 0, 0, 0, 0]),
    ("[1314, 205, 201, 119]", [1314, 205, 201, 119], [-1, 0, 0, 0]),
    ("SFT [720, 580-620 x 5, 360]", [720, 580, 590, 600, 610, 620, 360], [-1, 0, 0, 0, 0, 0, 0]),
    ("SFT 10 lone 180-505", [310, 250, 420, 180, 505, 290, 330, 260, 400, 350], [-1] * 10),
    ("GRPO [70, 64 x 8]", [70] + [64] * 8, [-1] + [0] * 8),
    ("2 GRPO groups [70, 64 x 8] x 2", ([70] + [64] * 8) * 2, [-1] + [0] * 8 + [-1] + [9] * 8),
]


def layer_seconds(lengths: list[int], context: list[int], reps: int) -> float:
    total = sum(lengths)
    q, k, v = (torch.randn(1, h, total, 64, dtype=torch.bfloat16, requires_grad=True) for h in (9, 3, 3))
    batch = kv_attention.PackedBatch(lengths, context)  # one per micro-batch: its layout serves every layer
    best = float("inf")
    for _ in range(reps + 1):  # the first builds the layout, as the first layer does
        start = time.perf_counter()
        kv_attention._packed(0, q, k, v, batch, 0.125).float().sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--label", default="", help="a name for this tree in the result file (e.g. before, after)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, lengths, context in LAYOUTS:
        seconds = layer_seconds(lengths, context, args.reps)
        rows.append({"layout": name, "lengths": lengths, "context": context, "seconds": seconds})
        print(f"{name:32s} {seconds * 1000:8.1f} ms", flush=True)
    result = {
        "label": args.label,
        "machine": describe(),
        "module": kv_attention.__file__,
        "threads": args.threads,
        "rows": rows,
    }
    save_result("packed_attention", result)


if __name__ == "__main__":
    main()

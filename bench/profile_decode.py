"""One decode step, eager and compiled (``InferenceEngine(compile=True)``): the mean step time at 1 and 32 rows, then
torch.profiler's top operators by self CPU time over 10 one-row steps of each. Everything runs on the engine's own
thread (``engine.call``), as its decode steps do (a second thread's OpenMP team would slow both).

    .venv/bin/python bench/profile_decode.py [--cached 100] [--steps 40] [--top 12]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flywheel.inference import llama_forward
from flywheel.inference.engine import InferenceEngine
from flywheel.inference.kv_attention import DecodeBatch
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", type=int, default=100, help="tokens already in each row's cache")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    model, tokenizer, _ = load_model(EMBEDDED_MODEL)
    engine = InferenceEngine(model, tokenizer, compile=True)
    asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=2)))  # served once the warm-up compiled

    def step(mode: str, rows: int, i: int) -> torch.Tensor:
        lengths = torch.full((rows,), args.cached + i)
        ids = torch.randint(0, model.config.vocab_size, (rows, 1))
        batch = DecodeBatch(engine.cache, lengths=lengths)
        if mode == "compiled":
            return engine._compiled.logits(ids, lengths, batch)
        return llama_forward.logits(model, ids, lengths[:, None], batch, 1, engine._packed)

    def work() -> list[str]:
        out = []
        with torch.inference_mode():
            engine.cache.fit(32, args.cached + args.steps + 8)
            for rows in (1, 32):
                for mode in ("eager", "compiled"):
                    for i in range(5):
                        step(mode, rows, i)
                    start = time.perf_counter()
                    for i in range(args.steps):
                        step(mode, rows, i)
                    out.append(
                        f"{mode}, {rows} rows: {(time.perf_counter() - start) / args.steps * 1000:.2f} ms a step"
                    )
            for mode in ("eager", "compiled"):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for i in range(10):
                        step(mode, 1, i)
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top)
                out.append(f"\n{mode}, 10 one-row steps:\n{table}")
        return out

    async def on_engine_thread() -> list[str]:
        return await engine.call(work)

    try:
        print("\n".join(asyncio.run(on_engine_thread())))
    finally:
        engine.close()


if __name__ == "__main__":
    main()

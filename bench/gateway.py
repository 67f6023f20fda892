"""The gateway's added latency per call: a chat completion through an episode URL (recorded, spliced) against the
same request on the engine's plain route, on one server, with the real openai SDK as client.

Each of N concurrent agents has an episode and alternates the two routes (the order flips every round), so both see
the same engine load. Every request is the same one-token greedy completion of a short multi-turn history (the
prefix cache serves the prompt, so the engine's own time is small and the gateway's share shows): on the episode
route the agent re-sends the reply it got, as agents do, so each call is spliced and recorded. Reports the median
and p99 of each route and of the per-pair difference (episode - plain, the same agent and round), at 1 and 32
agents. The agents run in a process of their own, as agents do; with ``--agents-in server`` they run in the
server's process, on an event loop of its own, as they did for the results up to ``gateway-20261126-074732.json``
(their Python then competes with the gateway's threads for one GIL). Usage: ``python bench/gateway.py
[--rounds 200] [--agents 1 32] [--agents-in process|server]``; writes bench/results/gateway-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import openai

from flywheel.gateway.client import EpisodeClient  # the agents' side imports no torch: its process starts fast

RESULTS = Path(__file__).parent / "results"
HISTORY = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a colour."},
]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict:
    return {"median_ms": statistics.median(values), "p99_ms": quantile(values, 0.99), "n": len(values)}


async def run_agents(base_url: str, model: str, agents: int, rounds: int) -> list[tuple[float, float]]:
    """Each agent's (plain, episode) milliseconds per round, but the first."""
    plain = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0)
    async with EpisodeClient(base_url.removesuffix("/v1")) as episodes:

        async def agent(i: int) -> list[tuple[float, float]]:
            episode = await episodes.create(f"bench-{agents}-{i}")
            recorded = openai.AsyncOpenAI(base_url=episode.base_url, api_key="bench", max_retries=0)
            messages, pairs = list(HISTORY), []

            async def timed(client: openai.AsyncOpenAI) -> tuple[float, str]:
                start = time.perf_counter()
                reply = await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=1, temperature=0
                )
                return (time.perf_counter() - start) * 1000, reply.choices[0].message.content or ""

            for r in range(rounds):
                if r % 2:
                    (plain_ms, _), (episode_ms, text) = await timed(plain), await timed(recorded)
                else:
                    (episode_ms, text), (plain_ms, _) = await timed(recorded), await timed(plain)
                pairs.append((plain_ms, episode_ms))
                if r == 0:  # from then on the history holds a reply of this episode: every call is spliced
                    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Another."}]
            await episodes.finish(episode.id, 0.0)
            return pairs[1:]  # the first pair warms the agent's connection and prefix

        return [p for result in await asyncio.gather(*(agent(i) for i in range(agents))) for p in result]


def _agents_process(base_url: str, model: str, agents: int, rounds: int, conn: Connection) -> None:
    conn.send(asyncio.run(run_agents(base_url, model, agents, rounds)))


async def run(base_url: str, model: str, agents: int, rounds: int, agents_in: str) -> dict:
    if agents_in == "server":
        pairs = await run_agents(base_url, model, agents, rounds)
    else:
        context = multiprocessing.get_context("spawn")
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_agents_process, args=(base_url, model, agents, rounds, send))
        process.start()
        pairs = await asyncio.to_thread(receive.recv)
        process.join()
    return {
        "agents": agents,
        "rounds": rounds,
        "plain": summary([p for p, _ in pairs]),
        "episode": summary([e for _, e in pairs]),
        "added": summary([e - p for p, e in pairs]),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="pairs of calls per agent")
    ap.add_argument("--agents", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--agents-in", choices=["process", "server"], default="process", help="where the agents run")
    args = ap.parse_args()
    from machine import describe  # bench/machine.py; these import torch, which the agents' process need not

    from flywheel.inference.loading import EMBEDDED_MODEL
    from flywheel.local.backend import LocalBackend

    backend = LocalBackend(path=tempfile.mkdtemp(prefix="gateway-bench-"))
    try:
        await backend.load(EMBEDDED_MODEL)
        results = [await run(backend.base_url, EMBEDDED_MODEL, n, args.rounds, args.agents_in) for n in args.agents]
    finally:
        await backend.close()
    out = {
        "bench": "gateway",
        "machine": describe(),
        "store": "SQLite (WAL), a temporary FLYWHEEL_HOME",
        "agents_in": args.agents_in,
        "runs": results,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"gateway-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"{'agents':>6} {'plain median/p99':>18} {'episode median/p99':>20} {'added median/p99':>18}  (ms)")
    for r in results:
        p, e, a = r["plain"], r["episode"], r["added"]
        print(
            f"{r['agents']:>6} {p['median_ms']:>8.2f} / {p['p99_ms']:<7.2f} {e['median_ms']:>9.2f} / {e['p99_ms']:<8.2f}"
            f" {a['median_ms']:>8.2f} / {a['p99_ms']:<7.2f}"
        )
    print(f"results: {path}")


if __name__ == "__main__":
    asyncio.run(main())

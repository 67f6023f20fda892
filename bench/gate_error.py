"""How often the loop's decisions promote what they should not, and how often they promote what they should: the
gate over a loop's repeated looks, the canary and the shadow, simulated with the loop's own decision functions
(``gate.decide_look``, ``canary.verdict``, ``shadow.verdict``) on random outcomes.

Gate: a loop looks ``--looks`` times (every ``candidate_every`` steps); each look evaluates both sides afresh on the
same held-out items (one attempt each, success drawn with the item's probability: items' difficulties uniform in
[0.2, 0.7]); the candidate is as good as production (the null) or ``+lift`` better on every item; a loop stops at
its first promotion. Canary: production's KPI 0.70, the canary's 0.70 - drop, episodes arriving ``--batch`` canary
episodes per loop iteration (and production's by the share), the verdict asked every iteration until it promotes,
rolls back or reaches ``max_episodes``. Shadow: pairs of (shadow, production) rewards, likewise. "Before" rows apply
the rules the loop used before issue #37 (a 95% interval at every look, min_lift 0; point estimates for the canary
and shadow) for comparison.

    .venv/bin/python bench/gate_error.py [--loops 400] [--looks 25] [--resamples 2000] [--quick]

Writes bench/results/gate_error-<time>.json and prints markdown tables. The gate's bootstrap runs ``--resamples``
resamples here (the loop: 10,000; both read a look's deep tail from Student's t) to keep the simulation in minutes;
the canary and shadow run the loop's own.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from machine import describe, save_result  # bench/machine.py

from flywheel.loop.canary import CanaryPolicy, Scored
from flywheel.loop.canary import verdict as canary_verdict
from flywheel.loop.gate import GatePolicy, ItemResult, decide_look
from flywheel.loop.looks import reached
from flywheel.loop.shadow import Pair, ShadowPolicy
from flywheel.loop.shadow import verdict as shadow_verdict
from flywheel.stats import bootstrap_mean, wilson

PRODUCTION_KPI = 0.70


def results(scores: np.ndarray) -> list[ItemResult]:
    return [ItemResult.model_construct(item=f"t{i}", score=float(s), safe=True, tokens=0.0, tool_calls=0.0,
                                       latency_ms=0.0) for i, s in enumerate(scores)]  # fmt: skip


def gate_loop(policy: GatePolicy, items: int, lift: float, looks: int, rng: np.random.Generator, before: bool) -> int:
    """The look at which a loop promotes its candidate (0: never in ``looks``)."""
    difficulty = rng.uniform(0.2, 0.7, items)

    def evaluate() -> tuple[list[ItemResult], list[ItemResult]]:
        return results(rng.random(items) < difficulty + lift), results(rng.random(items) < difficulty)

    for look in range(1, looks + 1):
        if before:  # every look: the plain percentile 95% interval's low end above 0, no confirmation
            c, p = evaluate()
            diffs = [a.score - b.score for a, b in zip(c, p, strict=True)]
            if bootstrap_mean(diffs, policy.resamples, policy.seed)[0] > 0:
                return look
            continue
        first = evaluate()
        decision = decide_look(policy, look, first)
        if decision.needs_confirmation:
            decision = decide_look(policy, look, first, evaluate())
        if decision.promote:
            return look
    return 0


def canary_run(
    policy: CanaryPolicy, drop: float, batch: int, rng: np.random.Generator, rule: Callable[..., str]
) -> tuple[str, int]:
    """(the action a canary ``drop`` below production ends with, its scored episodes then)."""
    canary: list[Scored] = []
    production: list[Scored] = []
    per = max(1, round(batch * (1 - policy.share) / policy.share))
    asked = None
    while True:
        canary += [Scored(episode_id="c", kpi=float(x), safe=True) for x in rng.random(batch) < PRODUCTION_KPI - drop]
        production += [Scored(episode_id="p", kpi=float(x), safe=True) for x in rng.random(per) < PRODUCTION_KPI]
        # the verdict changes only when the canary reaches its next look (production has its share by then): the
        # loop asks every iteration, the simulation only then, for speed
        if rule is canary_now and reached(policy.looks, len(canary)) == asked:
            continue
        asked = reached(policy.looks, len(canary))
        action = rule(canary, production, policy)
        if action != "wait":
            return action, len(canary)
        if len(canary) >= policy.max_episodes:  # the before-rule has no last look: it waits on
            return "wait", len(canary)


def canary_now(canary: list[Scored], production: list[Scored], policy: CanaryPolicy) -> str:
    return canary_verdict(canary, production, policy).action


def canary_before(canary: list[Scored], production: list[Scored], policy: CanaryPolicy) -> str:
    """The rule before #37: promote at min_episodes unless the canary's mean is max_drop below production's."""
    if len(canary) < policy.min_episodes:
        return "wait"
    mean_c = sum(e.kpi for e in canary) / len(canary)
    mean_p = sum(e.kpi for e in production) / len(production)
    return "rollback" if mean_c < mean_p - policy.max_drop else "promote"


def shadow_run(
    policy: ShadowPolicy, drop: float, batch: int, rng: np.random.Generator, before: bool
) -> tuple[str, int]:
    pairs: list[Pair] = []
    asked = None
    while True:
        shadow = rng.random(batch) < PRODUCTION_KPI - drop
        production = rng.random(batch) < PRODUCTION_KPI
        pairs += [Pair(shadow="s", production="p", shadow_reward=float(a), production_reward=float(b), safe=True)
                  for a, b in zip(shadow, production, strict=True)]  # fmt: skip
        if before:  # the rule before #37: at min_pairs, stop if the mean paired difference is max_drop below 0
            if len(pairs) >= policy.min_pairs:
                mean = sum(p.shadow_reward - p.production_reward for p in pairs) / len(pairs)
                return ("stop" if mean < -policy.max_drop else "canary"), len(pairs)
            continue
        if reached(policy.looks, len(pairs)) == asked:  # as for the canary: a new verdict only at a new look
            continue
        asked = reached(policy.looks, len(pairs))
        action = shadow_verdict(pairs, policy).action
        if action != "wait":
            return action, len(pairs)


def rate(hits: int, n: int) -> dict:
    low, high = wilson(hits, n)
    return {"rate": hits / n, "low": low, "high": high, "n": n}


def cell(r: dict) -> str:
    return f"{r['rate']:.1%} [{r['low']:.1%}, {r['high']:.1%}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=400)
    parser.add_argument("--looks", type=int, default=25)
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=5, help="canary episodes (shadow pairs) per loop iteration")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20 loops")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    loops = 20 if args.quick else args.loops
    rng = np.random.default_rng(args.seed)
    started = time.monotonic()
    out: dict = {"machine": describe(), "args": vars(args), "gate": [], "canary": [], "shadow": []}

    print(f"## Gate: promoted within {args.looks} looks, {loops} simulated loops each (95% Wilson interval)\n")
    print("| rule | items | true lift | promoted | mean look of promotion |\n|---|---|---|---|---|")
    now = GatePolicy(min_items=2, resamples=args.resamples)
    arms = [
        ("before #37 (95% interval each look, min_lift 0)", now.model_copy(update={"min_lift": 0.0}), True),
        ("spending only (confirm off)", now.model_copy(update={"confirm": False}), False),
        ("default (screen 2.5% + confirmation, min_lift 0.02)", now, False),
    ]
    for name, policy, before in arms:
        for items, lift in ((20, 0.0), (80, 0.0), (80, 0.10)):
            hits = [gate_loop(policy, items, lift, args.looks, rng, before) for _ in range(loops)]
            found = rate(sum(h > 0 for h in hits), loops)
            when = [h for h in hits if h]
            row = {"rule": name, "items": items, "lift": lift, "promoted": found,
                   "mean_look": float(np.mean(when)) if when else None}  # fmt: skip
            out["gate"].append(row)
            print(f"| {name} | {items} | {lift:+.2f} | {cell(found)} | {row['mean_look'] or '-'} |", flush=True)

    print(f"\n## Canary (production {PRODUCTION_KPI:.2f}, share 0.1, {args.batch} canary episodes per iteration)\n")
    print("| rule | min / max episodes | canary vs production | promoted | rolled back | mean episodes at verdict |")
    print("|---|---|---|---|---|---|")
    canary_arms = [
        ("before #37 (point estimate)", CanaryPolicy(min_episodes=20, max_drop=0.05), canary_before),
        *[(f"default, min {m}", CanaryPolicy(min_episodes=m, min_production_episodes=m), canary_now) for m in (20, 50)],
    ]
    for name, policy, rule in canary_arms:
        for drop in (0.10, 0.05, 0.0):
            ends = [canary_run(policy, drop, args.batch, rng, rule) for _ in range(loops)]
            row = {"rule": name, "min_episodes": policy.min_episodes, "max_episodes": policy.max_episodes,
                   "drop": drop, "promoted": rate(sum(a == "promote" for a, _ in ends), loops),
                   "rolled_back": rate(sum(a == "rollback" for a, _ in ends), loops),
                   "mean_episodes": float(np.mean([n for _, n in ends]))}  # fmt: skip
            out["canary"].append(row)
            print(f"| {name} | {policy.min_episodes} / {policy.max_episodes} | {-drop:+.2f} | {cell(row['promoted'])} "
                  f"| {cell(row['rolled_back'])} | {row['mean_episodes']:.0f} |", flush=True)  # fmt: skip

    print(f"\n## Shadow ({args.batch} pairs per iteration)\n")
    print(
        "| rule | min / max pairs | shadow vs production | to canary | mean pairs at verdict |\n|---|---|---|---|---|"
    )
    for name, policy, before in (("before #37 (point estimate)", ShadowPolicy(min_pairs=20), True),
                                 ("default", ShadowPolicy(), False)):  # fmt: skip
        for drop in (0.10, 0.05, 0.0):
            ends = [shadow_run(policy, drop, args.batch, rng, before) for _ in range(loops)]
            row = {"rule": name, "min_pairs": policy.min_pairs, "max_pairs": policy.max_pairs, "drop": drop,
                   "to_canary": rate(sum(a == "canary" for a, _ in ends), loops),
                   "mean_pairs": float(np.mean([n for _, n in ends]))}  # fmt: skip
            out["shadow"].append(row)
            print(f"| {name} | {policy.min_pairs} / {policy.max_pairs} | {-drop:+.2f} | {cell(row['to_canary'])} "
                  f"| {row['mean_pairs']:.0f} |", flush=True)  # fmt: skip

    out["seconds"] = time.monotonic() - started
    print(f"\n{out['seconds']:.0f} s")
    save_result("gate_error", out)


if __name__ == "__main__":
    main()

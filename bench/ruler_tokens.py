"""RULER judge cost: prompt tokens per group with and without prefix de-duplication, and the cache on a re-run.

Groups of 4 and 8 multi-turn support-agent trajectories share a long system prompt (a policy document, ~700
tokens) and the first user turn; each then has its own tool call, tool result, answer, follow-up and last answer.
Prompt tokens are counted with the embedded model's tokenizer and chat template, exactly as the local judge sees
them. Then the groups are judged twice by the local judge (the embedded model behind Flywheel's own server) with
a fresh cache: the second pass should make no judge call. Writes bench/results/ruler_tokens-<time>.json and
prints markdown tables.

    .venv/bin/python bench/ruler_tokens.py [--sizes 4 8] [--judge-groups 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import flywheel as art
from flywheel.inference.chat import render_prompt
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.rewards import JudgeCache, JudgeUsage, ruler_score_group
from flywheel.rewards.ruler import _Candidate, build_request

POLICY = "\n".join(
    f"{i}. {rule}"
    for i, rule in enumerate(
        [
            "Refunds are available within 30 days of purchase for physical goods in their original packaging.",
            "Digital products are non-refundable once downloaded or streamed for more than five minutes.",
            "Store credit may be offered instead of a refund only when the customer asks for it explicitly.",
            "Shipping fees are refunded only when the item arrived damaged or the wrong item was sent.",
            "Orders can be cancelled free of charge until they are handed to the carrier.",
            "Express shipping takes 2 business days and costs $15; standard shipping takes 5 to 7 business days.",
            "Warranty claims for appliances need the original receipt and cover manufacturing defects for 2 years.",
            "Subscriptions can be cancelled at any time; access continues until the end of the billing period.",
            "Never promise delivery dates; quote the published shipping times instead.",
            "Escalate to a human agent when the customer mentions legal action, injury or a data breach.",
            "Do not ask for full card numbers or passwords; verify identity with the order number and email only.",
            "Apologise once when something went wrong; do not repeat apologies.",
            "Always end by asking whether anything else is needed, in one short sentence.",
        ]
        * 3,
        1,
    )
)
SYSTEM = (
    "You are the customer support agent of an online store. Follow the store policy below exactly; when the policy "
    "does not cover a question, say so and offer to escalate. Use the lookup_order tool to check orders.\n\n"
    f"Store policy:\n{POLICY}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its number.",
            "parameters": {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]},
        },
    }
]
STYLES = [
    ("Your order was delivered on May 3, so you are within the 30-day window: I have started the refund.", "Yes."),
    ("I checked: order delivered May 3. Refunds are possible within 30 days, so yes, you can get one.", "Sure."),
    ("Sorry about that! You can get store credit for 90 days instead, which is better.", "No problem!"),
    ("Order found. Within 30 days, the refund is possible if the item is in its original packaging.", "Of course."),
    ("I cannot help with refunds, please call the billing team.", "Bye."),
    ("Delivered May 3; refund approved. Shipping fees are not refunded unless the item was damaged.", "Anything else?"),
    ("Your refund will arrive tomorrow, guaranteed.", "Done."),
    ("Refund started for order 1234 (delivered May 3, within 30 days).", "Is there anything else you need?"),
]


def trajectory(k: int) -> art.Trajectory:
    answer, closing = STYLES[k % len(STYLES)]
    call = {
        "id": f"call_{k}",
        "type": "function",
        "function": {"name": "lookup_order", "arguments": '{"order": "1234"}'},
    }
    return art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Hi, I'd like a refund for order 1234, the blender I bought."},
            {"role": "assistant", "content": "Let me look that order up.", "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": f"call_{k}",
                "content": '{"order": "1234", "delivered": "May 3", "item": "blender"}',
            },
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Thanks. Question {k % 3 + 1}: can I also get the shipping fee back?"},
            {"role": "assistant", "content": f"{closing} Shipping fees come back only for damaged or wrong items."},
        ],
        tools=TOOLS,
    )


def group_of(size: int, offset: int = 0) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([trajectory(offset + k) for k in range(size)])


def prompt_tokens(tokenizer, group: art.TrajectoryGroup, dedupe: bool) -> int:
    candidates = [_Candidate(messages=t.messages(), tools=t.tools) for t in group]
    return len(render_prompt(tokenizer, build_request(candidates, dedupe_prefix=dedupe).messages))


async def main(sizes: list[int], judge_groups: int) -> dict:
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="ruler-bench-"))
    try:
        engine = await backend.load(EMBEDDED_MODEL)
        tokens = []
        for size in sizes:
            group = group_of(size)
            with_dedup, without = (
                prompt_tokens(engine.tokenizer, group, True),
                prompt_tokens(engine.tokenizer, group, False),
            )
            tokens.append(
                {"group_size": size, "with_dedup": with_dedup, "without_dedup": without, "ratio": with_dedup / without}
            )
        judge = f"openai/{EMBEDDED_MODEL}"
        params = {"api_base": backend.base_url, "api_key": "bench", "temperature": 0}
        cache = JudgeCache(tempfile.mkdtemp(prefix="ruler-bench-cache-"))
        passes = []
        for label in ("first run", "re-run"):
            usage = JudgeUsage()
            start = time.perf_counter()
            judged = await art.gather_trajectory_groups(
                [group_of(4, offset=g) for g in range(judge_groups)],
                pbar_desc=None,
                after_each=lambda g: ruler_score_group(g, judge, params, cache=cache, usage=usage),  # noqa: B023 (awaited here)
            )
            passes.append(
                {
                    "pass": label,
                    "groups": len(judged),
                    "judge_calls": usage.calls,
                    "cache_hits": usage.cache_hits,
                    "hit_rate": usage.cache_hits / judge_groups,
                    "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": usage.completion_tokens,
                    "seconds": time.perf_counter() - start,
                }
            )
    finally:
        await backend.close()
    return {"model": EMBEDDED_MODEL, "tokens": tokens, "cache": passes}


def report(result: dict) -> str:
    lines = ["| group size | judge prompt tokens, prefix de-dup | without | ratio |", "|---|---|---|---|"]
    for r in result["tokens"]:
        lines.append(f"| {r['group_size']} | {r['with_dedup']} | {r['without_dedup']} | {r['ratio']:.2f}x |")
    lines += [
        "",
        "| pass | judge calls | cache hits | hit rate | prompt tokens | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for p in result["cache"]:
        lines.append(
            f"| {p['pass']} | {p['judge_calls']} | {p['cache_hits']} | {p['hit_rate']:.0%} | {p['prompt_tokens']} | "
            f"{p['seconds']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--judge-groups", type=int, default=3)
    args = parser.parse_args()
    result = asyncio.run(main(args.sizes, args.judge_groups))
    out = Path(__file__).parent / "results" / f"ruler_tokens-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(report(result))
    print(f"\nwritten to {out}")

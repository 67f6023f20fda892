"""A reinforcement fine-tuning script as one writes it for OpenAI's API: upload a training and a validation file,
create a job with a grader, follow its events until it ends, read its checkpoints, call the fine-tuned model.

Nothing in it is Flywheel's: point it at `flywheel serve` with the environment's base URL (README.md here)::

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=unused python examples/openai_rft/rft.py

The task: sums of two numbers, answered with the number alone. The grader (OpenAI's JSON) gives half for the right
number anywhere in the answer and half for an answer that is nothing but the number.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import time

from openai import OpenAI

SYSTEM = "Reply with the number only."
GRADER = {
    "type": "multi",
    "name": "sum",
    "graders": {
        "exact": {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
                  "reference": "{{item.answer}}", "operation": "eq"},
        "present": {"type": "python", "name": "present",
                    "source": "def grade(sample, item):\n    return float(item['answer'] in sample['output_text'])\n"},
    },
    "calculate_output": "0.5 * exact + 0.5 * present",
}  # fmt: skip


def rows(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}]
        lines.append(json.dumps({"messages": messages, "answer": str(a + b)}))
    return ("\n".join(lines) + "\n").encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-4.1-mini-2025-04-14")
    parser.add_argument("--train-rows", type=int, default=24)
    parser.add_argument("--valid-rows", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    client = OpenAI()
    train = client.files.create(file=("train.jsonl", io.BytesIO(rows(args.train_rows, 0))), purpose="fine-tune")
    valid = client.files.create(file=("valid.jsonl", io.BytesIO(rows(args.valid_rows, 1))), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=args.model,
        training_file=train.id,
        validation_file=valid.id,
        suffix="sums",
        seed=0,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": GRADER,
                "hyperparameters": {"n_epochs": args.epochs, "batch_size": 4, "learning_rate_multiplier": 4.0,
                                    "eval_interval": 2, "eval_samples": 2},
            },
        },
    )  # fmt: skip
    print(f"job {job.id}: {job.status}")
    seen: set[str] = set()
    while True:
        job = client.fine_tuning.jobs.retrieve(job.id)
        for event in reversed(client.fine_tuning.jobs.list_events(job.id, limit=50).data):
            if event.id not in seen:
                seen.add(event.id)
                print(f"  {event.level:5} {event.message}")
        if job.status in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(2)
    if job.status != "succeeded":
        raise SystemExit(f"job {job.id} {job.status}: {job.error}")

    checkpoints = sorted(client.fine_tuning.jobs.checkpoints.list(job.id), key=lambda c: c.step_number)
    for c in checkpoints:
        print(f"checkpoint step {c.step_number}: valid reward {c.metrics.valid_reward_mean:.3f}  ({c.fine_tuned_model_checkpoint})")  # fmt: skip
    first, last = checkpoints[0].metrics.valid_reward_mean, checkpoints[-1].metrics.valid_reward_mean
    verdict = "rose" if last > first else "did not rise (a small model, few steps: the run is not evidence either way)"
    print(f"validation reward {first:.3f} -> {last:.3f}: it {verdict}")
    reply = client.chat.completions.create(
        model=job.fine_tuned_model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12 + 30?"}],
        max_tokens=16,
    )
    print(f"{job.fine_tuned_model}: What is 12 + 30? -> {reply.choices[0].message.content!r}")


if __name__ == "__main__":
    main()

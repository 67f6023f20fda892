"""Grader stacks (flywheel/graders/stack.py): versions, the safety gate on the reward, holdout graders kept out of
it, and errors at their JSON paths."""

from __future__ import annotations

import pytest

from flywheel.graders.spec import GraderSpecError
from flywheel.graders.stack import StackGradingError, load_stack, parse_stack, score

STACK = {
    "name": "support",
    "reward": {"type": "string_check", "name": "resolved", "input": "{{sample.output_text}}", "reference": "refund", "operation": "like"},
    "safety": {"type": "string_check", "name": "no-card", "input": "{{sample.output_text}}", "reference": "card", "operation": "ne"},
    "holdout": {"polite": {"type": "string_check", "name": "polite", "input": "{{sample.output_text}}", "reference": "please", "operation": "ilike"}},
}  # fmt: skip


async def test_the_safety_gate_zeroes_the_reward_and_holdout_graders_stay_out_of_it():
    stack = parse_stack(STACK)
    good = await score(stack, "A refund is on its way. Please wait.")
    assert (good.reward, good.safe) == (1.0, True)
    assert good.grades["holdout/polite"].reward == 1.0 and good.version == stack.version
    assert good.metrics() == {"stack/reward": 1.0, "stack/safety": 1.0, "stack/holdout/polite": 1.0, "stack/safe": 1.0}
    rude = await score(stack, "A refund is on its way.")
    assert rude.reward == 1.0 and rude.grades["holdout/polite"].reward == 0.0  # holdout: reported, not rewarded
    unsafe = await score(stack, "card")
    assert (unsafe.reward, unsafe.safe, unsafe.grades["safety"].reward) == (0.0, False, 0.0)
    no_safety = parse_stack({k: v for k, v in STACK.items() if k != "safety"})
    assert (await score(no_safety, "card refund")).safe


def test_any_change_is_a_new_version_and_key_order_is_not_a_change():
    stack = parse_stack(STACK)
    assert parse_stack(dict(reversed(list(STACK.items())))).version == stack.version
    assert parse_stack(STACK | {"safety_pass": 0.5}).version != stack.version
    edited = STACK | {"reward": STACK["reward"] | {"reference": "refunded"}}
    assert parse_stack(edited).version != stack.version


def test_a_broken_stack_names_each_problem_at_its_path(tmp_path):
    broken = STACK | {"reward": STACK["reward"] | {"operation": "contains"}, "safty": {}}
    with pytest.raises(GraderSpecError) as caught:
        parse_stack(broken, "stack.yaml")
    paths = [path for path, _ in caught.value.problems]
    assert "reward.operation" in paths and "safty" in paths
    assert str(caught.value).startswith("stack.yaml: invalid grader")
    path = tmp_path / "stack.yaml"
    path.write_text("name: s\nreward:\n  type: string_check\n  name: r\n  input: x\n  reference: x\n  operation: eq\n")
    assert load_stack(path).reward.name == "r"
    path.write_text("name: [unclosed")
    with pytest.raises(GraderSpecError, match="invalid YAML"):
        load_stack(path)


async def test_checked_names_where_and_why_a_grader_failed_and_passes_a_clean_score():
    """A real failure: the safety grader's code raises in the sandbox. ``score`` gives 0 and counts the error
    (OpenAI's semantics); ``checked`` turns it into an error naming the episode and the exception."""
    failing = {"type": "python", "name": "safety", "source": "def grade(sample, item):\n    return 1 / 0\n"}
    stack = parse_stack({**STACK, "safety": failing})
    result = await score(stack, "A refund, please.")
    assert (result.reward, result.safe) == (0.0, False)
    with pytest.raises(StackGradingError) as failed:
        result.checked("ticket T1")
    message = str(failed.value)
    assert message.startswith("ticket T1: the grader stack could not grade the episode: safety: ")
    assert "python_grader_runtime_error: ZeroDivisionError: division by zero" in message
    clean = await score(parse_stack(STACK), "A refund, please.")
    assert clean.checked("ticket T2") is clean

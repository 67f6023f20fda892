"""The ART/RULER snippets of the mission's seed article, run with ``import flywheel as art``.

Only the judge model string differs: instead of ``"openai/o3"`` it is ``"openai/smollm2-135m-instruct"``, the
embedded model served by the backend, which LiteLLM reaches through its standard environment variables
(``OPENAI_BASE_URL``, ``OPENAI_API_KEY``), so every call is written as in the article. ``from art.rewards import
ruler`` is written ``from flywheel.rewards import ruler``, the same import under its real name. The tiny judge's
scores are not meaningful; what is checked is that the code runs and that its results have the shape the article
shows.
"""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

import flywheel as art
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.rewards import ruler, ruler_score_group

JUDGE = f"openai/{EMBEDDED_MODEL}"


@pytest.fixture
def judge_env(backend: LocalBackend, tmp_path, monkeypatch) -> None:
    """Configuration, not code: where LiteLLM finds the judge, and a fresh judge cache."""
    monkeypatch.setenv("OPENAI_BASE_URL", backend.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    monkeypatch.setenv("FLYWHEEL_JUDGE_CACHE", str(tmp_path / "judge-cache"))


async def test_snippet_ruler_on_message_lists(judge_env, capsys):
    message_lists = [
        # Good: uses retrieved context accurately
        [
            {"role": "system", "content": "You are a RAG-based support agent. Use the retrieved context to answer user queries accurately."},
            {"role": "user", "content": "What is our refund policy?\n\n[Retrieved context]: Refunds are available within 30 days of purchase. Digital products are non-refundable after download. Contact support@example.com to initiate."},
            {"role": "assistant", "content": "You can get a refund within 30 days of purchase. However, digital products are non-refundable once downloaded. To start the process, email support@example.com."},
        ],
        # Mediocre: partially uses context, adds hallucinated details
        [
            {"role": "system", "content": "You are a RAG-based support agent. Use the retrieved context to answer user queries accurately."},
            {"role": "user", "content": "What is our refund policy?\n\n[Retrieved context]: Refunds are available within 30 days of purchase. Digital products are non-refundable after download. Contact support@example.com to initiate."},
            {"role": "assistant", "content": "Our refund policy allows returns within 30 days. You can also get store credit for up to 90 days. Just call our hotline at 1-800-REFUND."},
        ],
        # Bad: ignores context entirely
        [
            {"role": "system", "content": "You are a RAG-based support agent. Use the retrieved context to answer user queries accurately."},
            {"role": "user", "content": "What is our refund policy?\n\n[Retrieved context]: Refunds are available within 30 days of purchase. Digital products are non-refundable after download. Contact support@example.com to initiate."},
            {"role": "assistant", "content": "I'm not sure about the refund policy. You should check the website or contact someone from the billing team."},
        ],
    ]  # fmt: skip

    scores = await ruler(message_lists, JUDGE)
    for label, score in zip(["Faithful", "Hallucinated", "Ignored context"], scores):
        print(label)
        print("→", score.score)
        print("→", score.explanation)

    out = capsys.readouterr().out
    assert out.count("→") == 6 and "Ignored context" in out
    assert len(scores) == 3 and all(0.0 <= s.score <= 1.0 for s in scores)


def _refund_group() -> art.TrajectoryGroup:
    # The system prompt defines the agent's goal
    # RULER uses this as the implicit reward function
    system_msg = {
        "role": "system",
        "content": (
            "You are a RAG-based support agent. "
            "Answer user queries using ONLY the retrieved context. "
            "Do not add information that is not in the context."
        ),
    }
    user_msg = {
        "role": "user",
        "content": (
            "What is the refund policy?\n\n"
            "[Retrieved context]: Refunds are available within 30 days "
            "of purchase. Digital products are non-refundable after "
            "download. Contact support@example.com to initiate."
        ),
    }
    responses = [
        "You can get a refund within 30 days of purchase. Digital products "
        "are non-refundable once downloaded. Email support@example.com to start.",
        "Refunds are available within 30 days. You can also get store credit "
        "for up to 90 days, and our hotline is 1-800-REFUND.",
        "I'm not sure about the refund policy. Please check the website or contact the billing team for more details.",
        "Based on the information I have, the refund policy states that "
        "refunds are available within 30 days of purchase. It is important "
        "to note that digital products cannot be refunded after they have "
        "been downloaded. If you wish to initiate a refund, you should "
        "reach out to support@example.com.",
    ]
    trajectories = []
    for resp in responses:
        traj = art.Trajectory(
            messages_and_choices=[
                system_msg,
                user_msg,
                Choice(
                    finish_reason="stop",
                    index=0,
                    message=ChatCompletionMessage(role="assistant", content=resp),
                ),
            ],
            reward=0.0,
        )
        trajectories.append(traj)
    group = art.TrajectoryGroup(trajectories)
    return group


async def test_snippet_ruler_score_group_with_debug_custom_rubric_and_independent_reward(judge_env, capsys):
    group = _refund_group()
    judged_group = await ruler_score_group(group, JUDGE, debug=True)

    out = capsys.readouterr().out
    assert '"scores"' in out and "rank" in out  # the raw answer, then the ranked table
    assert [t.metrics["ruler_score"] for t in judged_group.trajectories] == [
        t.reward for t in judged_group.trajectories
    ]

    custom_rubric = """
- Prioritize responses that are concise and clear
- Penalize responses that include emojis or informal language
- Reward responses that cite sources
"""
    judged_group = await ruler_score_group(group, JUDGE, rubric=custom_rubric)

    def verify_correctness(traj: art.Trajectory) -> float:
        return 1.0 if "support@example.com" in (traj.messages()[-1]["content"] or "") else 0.0

    for traj in judged_group.trajectories:
        independent_reward = verify_correctness(traj)  # binary 0/1
        traj.reward += independent_reward
    assert [t.reward - t.metrics["ruler_score"] for t in judged_group.trajectories] == pytest.approx(
        [1.0, 0.0, 0.0, 1.0]
    )
    assert all(t.metrics["independent_reward"] == 0.0 for t in judged_group.trajectories)


async def test_snippet_full_training_loop(backend: LocalBackend, judge_env):
    model = art.TrainableModel(name="seed-rag", project="seed", base_model=EMBEDDED_MODEL)
    await model.register(backend)
    scenarios = ["What is the refund policy?"]
    num_steps = 1

    async def rollout(model: art.TrainableModel, scenario: str) -> art.Trajectory:
        messages = [
            {"role": "system", "content": "Answer using ONLY this context: refunds within 30 days."},
            {"role": "user", "content": scenario},
        ]
        response = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=24
        )
        return art.Trajectory(messages_and_choices=[*messages, response.choices[0]], reward=0.0)

    for _step in range(num_steps):
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    rollout(model, scenario) for _ in range(4)
                )
                for scenario in scenarios
            ),
            after_each=lambda g: ruler_score_group(
                g, JUDGE),
        )  # fmt: skip
        metrics = await model.train(groups)  # GRPO updates LoRA weights

    assert len(groups) == 1 and all("ruler_score" in t.metrics for t in groups[0])
    # a group the tiny judge scores all alike carries no signal, and GRPO then skips the step
    assert await model.get_step() == (0 if metrics["skipped"] else 1)

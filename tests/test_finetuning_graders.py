"""OpenAI's graders API (``/v1/fine_tuning/alpha/graders/run`` and ``/validate``) on a real server, driven by the
openai SDK: each kind of grader scored, a failing one flagged as OpenAI flags it, a malformed one refused with
where it is wrong. No model: the server's registry is empty."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import openai
import pytest

from flywheel.inference.registry import ModelRegistry
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer

EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.answer}}", "operation": "eq"}  # fmt: skip


@pytest.fixture(scope="module")
def graders() -> Iterator:
    server = BackgroundServer(create_app(ModelRegistry())).start()
    try:
        yield openai.OpenAI(base_url=f"{server.base_url}", api_key="unused", max_retries=0).fine_tuning.alpha.graders
    finally:
        server.stop()


def test_a_string_check_passes_and_fails(graders):
    assert graders.run(grader=EXACT, model_sample="42", item={"answer": "42"}).reward == 1.0
    failed = graders.run(grader=EXACT, model_sample="41", item={"answer": "42"})
    assert failed.reward == 0.0 and failed.metadata.name == "exact" and failed.metadata.type == "string_check"
    assert not any(v for k, v in failed.metadata.errors.model_dump().items() if isinstance(v, bool))


def test_text_similarity_python_and_multi_graders_score(graders):
    close = {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}",
             "reference": "{{item.answer}}", "evaluation_metric": "fuzzy_match"}  # fmt: skip
    assert 0.5 < graders.run(grader=close, model_sample="Paris, France", item={"answer": "Paris"}).reward < 1.0
    length = {"type": "python", "name": "short", "source": "def grade(sample, item):\n    return 1.0 if len(sample['output_text']) < 5 else 0.5\n"}  # fmt: skip
    assert graders.run(grader=length, model_sample="hello world", item={}).reward == 0.5
    both = {"type": "multi", "name": "both", "graders": {"exact": EXACT, "short": length},
            "calculate_output": "0.5 * exact + 0.5 * short"}  # fmt: skip
    result = graders.run(grader=both, model_sample="42", item={"answer": "42"})
    assert result.reward == 1.0 and result.sub_rewards == {"exact": 1.0, "short": 1.0}


def test_a_grader_that_fails_scores_zero_with_openais_error_flag(graders):
    raises = {"type": "python", "name": "broken", "source": "def grade(sample, item):\n    return 1 / 0\n"}
    result = graders.run(grader=raises, model_sample="x", item={})
    assert result.reward == 0.0 and result.metadata.errors.python_grader_runtime_error
    assert "ZeroDivisionError" in result.metadata.errors.python_grader_runtime_error_details
    missing = graders.run(grader=EXACT, model_sample="42", item={})  # no item.answer
    assert missing.reward == 0.0 and missing.metadata.errors.invalid_variable_error


def test_a_json_sample_is_read_as_output_json_and_other_text_is_a_sample_parse_error(graders):
    field = {"type": "string_check", "name": "field", "input": "{{sample.output_json.answer}}",
             "reference": "{{item.answer}}", "operation": "eq"}  # fmt: skip
    assert graders.run(grader=field, model_sample='{"answer": "42"}', item={"answer": "42"}).reward == 1.0
    prose = graders.run(grader=field, model_sample="the answer is 42", item={"answer": "42"})
    assert prose.reward == 0.0 and prose.metadata.errors.sample_parse_error


def test_a_model_grader_whose_judge_cannot_be_reached_is_a_flagged_zero(graders, monkeypatch):
    with socket.socket() as closed:  # a loopback port nothing listens on once closed
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{port}/v1")
    judge = {"type": "score_model", "name": "judge", "model": "gpt-4o-mini", "range": [0, 1],
             "input": [{"role": "user", "content": "Rate: {{sample.output_text}}"}]}  # fmt: skip
    result = graders.run(grader=judge, model_sample="hi", item={})
    assert result.reward == 0.0 and result.metadata.errors.api_model_grader_server_error
    assert "gpt-4o-mini" in result.metadata.errors.api_model_grader_server_error_details


def test_validate_returns_a_good_grader_and_refuses_a_bad_one_saying_where(graders):
    assert graders.validate(grader=EXACT).grader.name == "exact"
    with pytest.raises(openai.BadRequestError, match="regex_check"):
        graders.validate(grader={"type": "regex_check", "name": "r"})
    with pytest.raises(openai.BadRequestError, match="reference"):
        graders.validate(grader={"type": "string_check", "name": "s", "input": "{{sample.output_text}}", "operation": "eq"})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="nope"):
        graders.validate(grader={"type": "multi", "name": "m", "graders": {"exact": EXACT}, "calculate_output": "nope + 1"})  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="regex_check"):
        graders.run(grader={"type": "regex_check", "name": "r"}, model_sample="x")

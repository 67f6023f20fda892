"""Graders: every type and operation, templates, the formula parser, validation, model graders (a scripted judge
over real HTTP, and the real engine), rewards on trajectories, RFT data, and the ``graders`` CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.gather import gather_trajectory_groups
from flywheel.graders import (
    GraderSpecError,
    JudgeSettings,
    Sample,
    grade,
    grader_metrics,
    load_grader,
    load_rft_jsonl,
    parse_grader,
    score_trajectory,
)
from flywheel.graders.formula import FormulaError, parse_formula
from flywheel.graders.model_graders import _response_format, score_grid
from flywheel.graders.scoring import after_each, sample_of
from flywheel.graders.similarity import meteor_uses_synonyms
from flywheel.graders.templates import check_template, render
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.model import Model
from flywheel.rewards.ruler import is_local_judge
from flywheel.server.background import BackgroundServer
from flywheel.types import Trajectory, TrajectoryGroup

FOX = "The quick brown fox jumps over the lazy dog"
FAST_FOX = "A fast brown fox leaps over the lazy dog"


def check(operation: str, input: str = "{{sample.output_text}}", reference: str = "{{item.answer}}") -> dict:
    return {"type": "string_check", "name": operation, "input": input, "reference": reference, "operation": operation}


def similarity(metric: str, **extra) -> dict:
    return {"type": "text_similarity", "name": metric, "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}", "evaluation_metric": metric, **extra}  # fmt: skip


def tool_call(name: str, arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


# ---- string_check -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "sample", "answer", "expected"),
    [
        ("eq", "Paris", "Paris", 1.0), ("eq", "paris", "Paris", 0.0), ("eq", "Paris.", "Paris", 0.0),
        ("ne", "Lyon", "Paris", 1.0), ("ne", "Paris", "Paris", 0.0),
        ("like", "It is Paris.", "Paris", 1.0), ("like", "It is paris.", "Paris", 0.0),
        ("ilike", "IT IS PARIS.", "Paris", 1.0), ("ilike", "Lyon", "Paris", 0.0),
    ],
)  # fmt: skip
async def test_string_check_operations(operation, sample, answer, expected):
    result = await grade(parse_grader(check(operation)), sample, {"answer": answer})
    assert result.reward == expected
    assert result.errors == {}


async def test_openai_graders_run_example_scores_one():
    """The sample and reference of the graders/run reference example are identical: 1.0."""
    grader = parse_grader(check("eq", reference="{{item.reference_answer}}"))
    result = await grade(grader, "fuzzy wuzzy was a bear", {"reference_answer": "fuzzy wuzzy was a bear"})
    answer = result.to_openai()
    assert (answer["reward"], answer["sub_rewards"]) == (1.0, {})
    metadata = answer["metadata"]
    assert (metadata["name"], metadata["type"], metadata["execution_time"]) == ("eq", "string_check", result.latency_s)
    assert not any(metadata["errors"].values()) and metadata["error_counts"] == {} == metadata["error_details"]


async def test_openai_tool_call_multigrader_example():
    """OpenAI's guide grades a function call with two string checks, averaged: name and arguments."""
    grader = parse_grader({
        "type": "multi", "name": "tool_call", "calculate_output": "0.5 * name + 0.5 * arguments",
        "graders": {
            "name": check("eq", "{{sample.output_tools[0].function.name}}", "{{item.name}}"),
            "arguments": check("eq", "{{sample.output_tools[0].function.arguments}}", "{{item.arguments}}"),
        },
    })  # fmt: skip
    item = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    right = await grade(grader, Sample(output_tools=[tool_call("get_weather", '{"city": "Paris"}')]), item)
    assert (right.reward, right.sub_rewards) == (1.0, {"name": 1.0, "arguments": 1.0})
    half = await grade(grader, Sample(output_tools=[tool_call("get_weather", '{"city": "Lyon"}')]), item)
    assert (half.reward, half.sub_rewards) == (0.5, {"name": 1.0, "arguments": 0.0})
    none = await grade(grader, Sample.from_text("It is sunny."), item)  # no tool call: nothing to read
    assert none.reward == 0.0 and none.errors == {"invalid_variable_error": 2}


# ---- text_similarity ----------------------------------------------------------------------------------------------


async def test_rouge_scores_match_hand_counts():
    # 9 words each; shared unigrams: brown fox over the lazy dog (6); shared bigrams: brown-fox, over-the,
    # the-lazy, lazy-dog (4 of 8); shared trigrams: over-the-lazy, the-lazy-dog (2 of 7); the LCS is 6 words.
    expected = {
        "rouge_1": 6 / 9,
        "rouge_2": 4 / 8,
        "rouge_3": 2 / 7,
        "rouge_4": 1 / 6,
        "rouge_5": 0.0,
        "rouge_l": 6 / 9,
    }
    for metric, value in expected.items():
        result = await grade(parse_grader(similarity(metric)), FAST_FOX, {"answer": FOX})
        assert result.reward == pytest.approx(value), metric


@pytest.mark.parametrize("metric", ["fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_l", "cosine"])
async def test_similarity_orders_identical_paraphrase_unrelated(metric):
    grader = parse_grader(similarity(metric))
    same = (await grade(grader, FOX, {"answer": FOX})).reward
    close = (await grade(grader, FAST_FOX, {"answer": FOX})).reward
    far = (await grade(grader, "Quarterly revenue rose by nine percent.", {"answer": FOX})).reward
    assert same == pytest.approx(1.0, abs=1e-3)
    assert 0.0 <= far < close < same <= 1.0


async def test_fuzzy_match_is_rapidfuzz_wratio_and_bleu_is_sacrebleu():
    import sacrebleu
    from rapidfuzz import fuzz, utils

    fuzzy = await grade(parse_grader(similarity("fuzzy_match")), "Paris, France", {"answer": "paris"})
    assert fuzzy.reward == pytest.approx(fuzz.WRatio("Paris, France", "paris", processor=utils.default_process) / 100)
    bleu = await grade(parse_grader(similarity("bleu")), FAST_FOX, {"answer": FOX})
    assert bleu.reward == pytest.approx(sacrebleu.sentence_bleu(FAST_FOX, [FOX]).score / 100)


async def test_meteor_matches_stems_without_wordnet():
    grader = parse_grader(similarity("meteor"))
    stems = (await grade(grader, "the dogs were jumping", {"answer": "the dog was jumping"})).reward
    different = (await grade(grader, "the cats were sleeping", {"answer": "the dog was jumping"})).reward
    assert stems > different
    if not meteor_uses_synonyms():  # the documented fallback: exact and stem matches only
        synonyms = (await grade(grader, "a big house", {"answer": "a large house"})).reward
        exact_only = (await grade(grader, "a red house", {"answer": "a large house"})).reward
        assert synonyms == pytest.approx(exact_only)


async def test_pass_threshold_is_reported():
    grader = parse_grader(similarity("fuzzy_match", pass_threshold=0.9))
    result = await grade(grader, "Pariss", {"answer": "Paris"})
    assert result.details == {"fuzzy_match.passed": result.reward >= 0.9}


# ---- templates ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "sample", "item", "expected"),
    [
        ("{{ sample.output_json.city }}", '{"city": "Paris"}', {}, "Paris"),
        ("{{sample.output_json.cities[1]}}", '{"cities": ["Lyon", "Paris"]}', {}, "Paris"),
        ("{{sample.output_json}}", '{"a": 1}', {}, '{"a": 1}'),  # non-strings go in as JSON
        ('{{ item["odd key"] }}', "x", {"odd key": "v"}, "v"),
        ("{{item.answers[-1]}}", "x", {"answers": ["a", "b"]}, "b"),
        ("{{item.n}} and {{item.flag}}", "x", {"n": 3, "flag": True}, "3 and true"),
        ("{{sample.choices[0].message.content}}", "hello", {}, "hello"),
        ("no templates at all", "x", {}, "no templates at all"),
    ],
)  # fmt: skip
def test_templates_render(template, sample, item, expected):
    check_template(template)
    assert render(template, {"sample": Sample.from_text(sample).namespace(), "item": item}) == expected


@pytest.mark.parametrize(
    ("template", "sample", "item", "kind", "fragment"),
    [
        ("{{item.answer}}", "x", {"other": 1}, "invalid_variable_error", "has no key 'answer' (its keys: other)"),
        ("{{item.list[5]}}", "x", {"list": [1]}, "invalid_variable_error", "a list of 1 item(s)"),
        ("{{item.a.b}}", "x", {"a": "text"}, "invalid_variable_error", "is a str"),
        ("{{sample.output_json.city}}", "not json", {}, "sample_parse_error", "not valid JSON"),
        ("{{sample.output_json.town}}", '{"city": "Paris"}', {}, "invalid_variable_error", "has no key 'town'"),
    ],
)  # fmt: skip
async def test_template_errors_score_zero_and_are_counted(template, sample, item, kind, fragment):
    result = await grade(parse_grader(check("ne", input=template, reference="anything")), sample, item)
    assert result.reward == 0.0  # even "ne", which would pass on any text
    assert result.errors == {kind: 1}
    assert fragment in result.error_details[kind]


@pytest.mark.parametrize(
    ("template", "fragment"),
    [
        ("{{ answer }}", "unknown namespace 'answer'"),
        ("{{ sample.text }}", "'sample.text' is not a sample field"),
        ("{{ item.a }", "not closed"),
        ("{{ item.a[x] }}", "cannot read '[x]'"),
        ("{{ 3 }}", "does not start with a namespace"),
    ],
)
def test_template_syntax_is_checked_at_load(template, fragment):
    with pytest.raises(GraderSpecError) as caught:
        parse_grader(check("eq", input=template))
    assert caught.value.problems[0][0] == "input"
    assert fragment in caught.value.problems[0][1]


# ---- formula --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("formula", "expected"),
    [
        ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("8 / 4 / 2", 1), ("2 - 3 - 4", -5),
        ("2 ^ 3 ^ 2", 512), ("-2 ^ 2", -4), ("(-2) ^ 2", 4), ("2 * 3 ^ 2", 18), ("2 ^ -1", 0.5),
        ("--3", 3), ("+a", 0.25), ("1.5e1 + .5", 15.5),
        ("min(a, b)", 0.25), ("max(a, b, 2)", 2), ("min(a)", 0.25), ("abs(a - b)", 0.5),
        ("floor(2.7) + ceil(2.1)", 5), ("exp(0) + sqrt(16)", 5), ("log(exp(2))", 2), ("log(8, 2)", 3),
        ("0.5 * a + 0.5 * b", 0.5),
    ],
)  # fmt: skip
def test_formula_values(formula, expected):
    assert parse_formula(formula, {"a", "b"})({"a": 0.25, "b": 0.75}) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("formula", "fragment"),
    [
        ("a + c", "unknown name 'c' at column 5 (the graders are: a, b)"),
        ("__import__(a)", "unknown function '__import__'"),
        ("__import__('os')", 'unexpected character "\'"'),
        ("a.__class__", "unexpected character '.'"),
        ("a ** 2", "powers are written with '^'"),
        ("pow(a, 2)", "unknown function 'pow'"),
        ("sqrt(a, b)", "takes 1 argument(s), got 2"),
        ("min", "is a function: write min(...)"),
        ("(a + b", "expected ')'"),
        ("a b", "unexpected 'b' at column 3"),
        ("", "empty"),
        ("a +", "found the end"),
        ("[a]", "unexpected character '['"),
    ],
)
def test_formula_rejects(formula, fragment):
    with pytest.raises(FormulaError) as caught:
        parse_formula(formula, {"a", "b"})
    assert fragment in str(caught.value)


async def test_multi_formula_math_error_scores_zero_but_keeps_sub_rewards():
    grader = parse_grader({"type": "multi", "name": "m", "calculate_output": "a / b",
                           "graders": {"a": check("eq"), "b": check("ne")}})  # fmt: skip
    result = await grade(grader, "x", {"answer": "x"})
    assert result.reward == 0.0
    assert result.sub_rewards == {"a": 1.0, "b": 0.0}
    assert result.errors == {"formula_eval_error": 1}


async def test_nested_multi_and_partial_failure():
    inner = {"type": "multi", "name": "inner", "calculate_output": "max(x, y)",
             "graders": {"x": check("eq"), "y": check("eq", input="{{item.missing}}")}}  # fmt: skip
    grader = parse_grader({"type": "multi", "name": "outer", "calculate_output": "inner * 2 + ok",
                           "graders": {"inner": inner, "ok": check("like")}})  # fmt: skip
    result = await grade(grader, "Paris", {"answer": "Paris"})
    assert result.sub_rewards == {"inner": 1.0, "ok": 1.0}
    assert result.reward == 3.0
    assert result.errors == {"invalid_variable_error": 1}  # y failed, scored 0, and max() still took x


# ---- validation and loading -------------------------------------------------------------------------------------


def test_validation_errors_name_json_paths(tmp_path):
    spec = {
        "type": "multi", "name": "m", "calculate_output": "a + b",
        "graders": {
            "a": {"type": "string_check", "name": "a", "input": "x", "reference": "y", "operation": "contains"},
            "b": {"type": "score_model", "name": "b", "model": "j", "range": [1, 0],
                  "input": [{"role": "user", "content": [{"type": "input_text", "text": "{{sample.output_text}}"}, 3]}]},
            "c": {"type": "label_model", "name": "c", "model": "j", "input": [{"role": "judge", "content": "hi"}],
                  "labels": ["good", "bad"], "passing_labels": ["great"]},
            "d": {"type": "python", "name": "d", "source": "def grade(sample, item):\n  return 1 +"},
            "e": {"type": "python", "name": "e", "source": "def score(sample, item):\n  return 1"},
            "f": {"type": "text_similarity", "name": "f", "input": "x", "reference": "y", "evaluation_metric": "bleu",
                  "refrence": "typo"},
            "g": {"type": "regex", "name": "g"},
            "h": {"name": "h"},
            "i": {"type": "string_check", "input": "x", "reference": "y", "operation": "eq"},
        },
    }  # fmt: skip
    with pytest.raises(GraderSpecError) as caught:
        parse_grader(spec, "grader.json")
    problems = dict(caught.value.problems)
    assert "'eq', 'ne', 'like' or 'ilike'" in problems["graders.a.operation"]
    assert "low < high" in problems["graders.b.range"]
    assert "TextPart" in problems["graders.b.input[0].content[1]"]
    assert "Input should be" in problems["graders.c.input[0].role"]
    assert "['great'] are not among labels" in problems["graders.c.passing_labels"]
    assert "syntax error at line 2" in problems["graders.d.source"]
    assert "grade(sample, item)" in problems["graders.e.source"]
    assert "Extra inputs" in problems["graders.f.refrence"]
    assert "unknown grader type 'regex'" in problems["graders.g"]
    assert "needs a 'type'" in problems["graders.h"]
    assert "Field required" in problems["graders.i.name"]
    assert str(caught.value).startswith("grader.json: invalid grader (11 problems):")


def test_formula_names_are_checked_against_grader_keys():
    with pytest.raises(GraderSpecError) as caught:
        parse_grader({"type": "multi", "name": "m", "calculate_output": "0.5 * accuracy + 0.5 * style",
                      "graders": {"accuracy": check("eq")}})  # fmt: skip
    assert caught.value.problems == [
        ("calculate_output", "unknown name 'style' at column 24 (the graders are: accuracy)")
    ]


def test_load_json_and_yaml(tmp_path):
    (tmp_path / "g.json").write_text(json.dumps(check("eq")))
    (tmp_path / "g.yaml").write_text("type: python\nname: p\nsource: |\n  def grade(sample, item):\n      return 1.0\n")
    (tmp_path / "broken.json").write_text('{"type": "string_check",\n "name": }')
    assert load_grader(tmp_path / "g.json").type == "string_check"
    assert load_grader(tmp_path / "g.yaml").type == "python"
    with pytest.raises(GraderSpecError, match="invalid JSON at line 2, column 10"):
        load_grader(tmp_path / "broken.json")
    with pytest.raises(GraderSpecError, match="cannot read"):
        load_grader(tmp_path / "missing.json")


# ---- model graders: a scripted judge --------------------------------------------------------------------------------


class ScriptedJudge:
    """An OpenAI-compatible server that answers with scripted contents and records the requests: a 135M model
    cannot be made to give a chosen score, and the error paths need answers no real judge gives on demand."""

    def __init__(self) -> None:
        self.answers: list[dict] = []
        self.requests: list[dict] = []
        api = FastAPI()

        @api.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            self.requests.append(body)
            answer = self.answers.pop(0)
            if "status" in answer:
                return JSONResponse({"error": {"message": "judge is down", "type": "server_error"}}, answer["status"])
            message = {"role": "assistant", "content": answer.get("content"), "refusal": answer.get("refusal")}
            return {"id": "1", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}  # fmt: skip

        self.server = BackgroundServer(api).start()

    def settings(self) -> JudgeSettings:
        return JudgeSettings(params={"api_base": self.server.base_url, "api_key": "unused", "max_retries": 0})


@pytest.fixture(scope="module")
def judge():
    judge = ScriptedJudge()
    yield judge
    judge.server.stop()


SCORE = {
    "type": "score_model", "name": "quality", "model": "openai/judge", "range": [0, 1],
    "input": [{"role": "system", "content": "You grade answers."},
              {"role": "user", "content": [{"type": "input_text", "text": "Reference: {{item.answer}}\nAnswer: {{sample.output_text}}"}]}],
    "sampling_params": {"temperature": 0, "seed": 3, "max_completions_tokens": 100},
}  # fmt: skip
LABEL = {
    "type": "label_model", "name": "tone", "model": "openai/judge", "labels": ["polite", "neutral", "rude"],
    "passing_labels": ["polite", "neutral"], "input": [{"role": "user", "content": "Classify: {{sample.output_text}}"}],
}  # fmt: skip


def _answer(result) -> str:
    return json.dumps({"steps": [{"description": "compared", "conclusion": "close"}], "result": result})


async def test_score_model_sends_rendered_prompt_schema_and_sampling(judge):
    judge.answers = [{"content": _answer(0.8)}]
    result = await grade(parse_grader(SCORE), "Paris", {"answer": "Paris"}, judge=judge.settings())
    assert result.reward == 0.8 and result.errors == {}
    assert result.details["quality"]["steps"] == [{"description": "compared", "conclusion": "close"}]
    assert result.details["quality"]["token_usage"] == 15
    request = judge.requests[-1]
    assert request["model"] == "judge"
    assert request["messages"][0]["role"] == "system" and request["messages"][0]["content"].startswith(
        "You grade answers."
    )
    assert "a number from 0 to 1" in request["messages"][0]["content"]
    assert request["messages"][1] == {"role": "user", "content": "Reference: Paris\nAnswer: Paris"}
    # the scripted judge listens on 127.0.0.1, so it gets the bounded schema of a local judge
    schema = request["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["result"] == {"type": "number", "enum": score_grid(0, 1)}
    steps = schema["properties"]["steps"]
    assert steps["maxItems"] == 2 and steps["items"]["properties"]["description"]["maxLength"] == (100 - 48) // 4
    assert (request["temperature"], request["seed"], request["max_tokens"]) == (0, 3, 100)


def test_hosted_judges_get_the_plain_schema():
    """Strict mode of hosted APIs accepts only a subset of JSON Schema: no bounds on the free text for them."""
    schema = _response_format("score", {"type": "number", "minimum": 0, "maximum": 1}, {"max_tokens": 100}, False)
    steps = schema["json_schema"]["schema"]["properties"]["steps"]
    assert "maxItems" not in steps and steps["items"]["properties"]["conclusion"] == {"type": "string"}
    assert is_local_judge("openai/gpt-4o-mini", {}) is False


@pytest.mark.parametrize(("low", "high", "size", "step"), [(0, 1, 101, 0.01), (1, 5, 401, 0.01), (0, 10, 101, 0.1),
                                                           (-1, 1, 201, 0.01), (0, 0.5, 501, 0.001)])  # fmt: skip
def test_score_grid_spans_the_range_in_round_steps(low, high, size, step):
    grid = score_grid(low, high)
    assert (grid[0], grid[-1], len(grid)) == (low, high, size)
    assert grid[1] - grid[0] == pytest.approx(step) and len(set(grid)) == size


@pytest.mark.parametrize(
    ("answer", "reward", "errors"),
    [
        ({"content": _answer(7)}, 1.0, {}),  # clamped to the range
        ({"content": _answer(-2.5)}, 0.0, {}),
        ({"content": "```json\n" + _answer(0.25) + "\n```"}, 0.25, {}),  # a fenced answer is still JSON
        ({"content": _answer("high")}, 0.0, {"model_grader_parse_error": 1}),
        ({"content": _answer(True)}, 0.0, {"model_grader_parse_error": 1}),
        ({"content": "I think it deserves 0.9"}, 0.0, {"model_grader_parse_error": 1}),
        ({"content": json.dumps({"score": 0.9})}, 0.0, {"model_grader_parse_error": 1}),
        ({"content": None, "refusal": "I can't help with that."}, 0.0, {"model_grader_refusal_error": 1}),
        ({"status": 500}, 0.0, {"model_grader_server_error": 1}),
    ],
)
async def test_score_model_answers(judge, answer, reward, errors):
    judge.answers = [answer]
    result = await grade(parse_grader(SCORE), "Paris", {"answer": "Paris"}, judge=judge.settings())
    assert (result.reward, result.errors) == (reward, errors)
    if answer.get("content") == _answer(7):
        assert result.details["quality"]["unclamped_result"] == 7


async def test_a_failed_judge_call_prints_no_litellm_banner(judge, capsys):
    """LiteLLM's "Give Feedback / Get Help" banner on a failed call: the failure is counted in the grade's errors."""
    judge.answers = [{"status": 400}]
    result = await grade(parse_grader(SCORE), "Paris", {"answer": "Paris"}, judge=judge.settings())
    assert result.errors == {"model_grader_server_error": 1}
    out, err = capsys.readouterr()
    assert "Give Feedback" not in out + err and "LiteLLM.Info" not in out + err


async def test_score_model_custom_range_and_judge_override(judge):
    judge.answers = [{"content": _answer(6)}]
    spec = {**SCORE, "range": [1, 5], "model": "gpt-4o-2024-08-06"}
    settings = judge.settings().model_copy(update={"model": "openai/local-judge"})
    result = await grade(parse_grader(spec), "Paris", {"answer": "Paris"}, judge=settings)
    assert result.reward == 5.0
    assert judge.requests[-1]["model"] == "local-judge"


@pytest.mark.parametrize(("label", "reward", "errors"), [("polite", 1.0, {}), ("rude", 0.0, {}),
                                                        ("sarcastic", 0.0, {"model_grader_parse_error": 1})])  # fmt: skip
async def test_label_model(judge, label, reward, errors):
    judge.answers = [{"content": _answer(label)}]
    result = await grade(parse_grader(LABEL), "Thank you!", {}, judge=judge.settings())
    assert (result.reward, result.errors) == (reward, errors)
    assert (
        judge.requests[-1]["response_format"]["json_schema"]["schema"]["properties"]["result"]["enum"]
        == LABEL["labels"]
    )
    assert judge.requests[-1]["messages"][0]["role"] == "system"  # the answer format, added before the prompt


async def test_label_model_on_the_real_engine(backend: LocalBackend):
    """The embedded model judges through Flywheel's own server, whose structured output holds it to the schema
    (which label a 135M model picks is not the point: that it answers in the grader's format is)."""
    served = Model(
        name="judge", project="tests", inference_model_name=EMBEDDED_MODEL, inference_base_url=backend.base_url
    )
    result = await grade(
        parse_grader(LABEL),
        "Thank you!",
        {},
        judge=JudgeSettings.from_model(served, max_tokens=100, temperature=0, max_retries=0),
    )
    assert result.errors == {}, result.error_details
    assert result.details["tone"]["label"] in LABEL["labels"]
    assert result.reward == float(result.details["tone"]["label"] in LABEL["passing_labels"])
    assert isinstance(result.details["tone"]["steps"], list)


async def test_score_model_on_the_real_engine(backend: LocalBackend):
    """The embedded model as score_model's judge: without bounds it wrote steps until max_tokens and never reached
    the result (a parse error); the bounded schema makes it close the JSON with a score from the range."""
    served = Model(
        name="judge", project="tests", inference_model_name=EMBEDDED_MODEL, inference_base_url=backend.base_url
    )
    spec = {**SCORE, "range": [1, 5], "sampling_params": {"temperature": 0, "max_completions_tokens": 160}}
    result = await grade(parse_grader(spec), "Paris", {"answer": "Paris"}, judge=JudgeSettings.from_model(served))
    assert result.errors == {}, result.error_details
    assert 1.0 <= result.reward <= 5.0 and result.reward in score_grid(1, 5)
    assert 1 <= len(result.details["quality"]["steps"]) <= 2


# ---- rewards on trajectories ------------------------------------------------------------------------------------


def _trajectory(content: str | None, tool_calls: list[dict] | None = None) -> Trajectory:
    message = ChatCompletionMessage(role="assistant", content=content, tool_calls=tool_calls)
    return Trajectory(messages_and_choices=[{"role": "user", "content": "Weather in Paris?"},
                                            Choice(index=0, finish_reason="stop", message=message)])  # fmt: skip


async def test_score_trajectory_grades_the_final_answer_and_its_tool_calls():
    grader = parse_grader({"type": "multi", "name": "call", "calculate_output": "(name + city) / 2",
                           "graders": {"name": check("eq", "{{sample.output_tools[0].function.name}}", "{{item.tool}}"),
                                       "city": check("like", "{{sample.output_tools[0].function.arguments}}", "{{item.city}}")}})  # fmt: skip
    trajectory = _trajectory(None, [tool_call("get_weather", '{"city": "Paris"}')])
    assert sample_of(trajectory).output_tools[0]["function"]["name"] == "get_weather"
    result = await score_trajectory(grader, trajectory, {"tool": "get_weather", "city": "Lyon"})
    assert trajectory.reward == result.reward == 0.5
    assert trajectory.metrics["grader/call"] == 0.5
    assert (trajectory.metrics["grader/call/name"], trajectory.metrics["grader/call/city"]) == (1.0, 0.0)
    assert trajectory.metrics["grader/call/errors"] == 0.0


async def test_after_each_scores_groups_and_metrics_aggregate(tmp_path):
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q}], "answer": a})
                                   for q, a in [("Capital of France?", "Paris"), ("Capital of Italy?", "Rome")]))  # fmt: skip
    rows = load_rft_jsonl(rows_path)

    async def rollout(row, text):
        trajectory = _trajectory(text)
        trajectory.metadata = {"rft_row": row.index}
        return trajectory

    groups = await gather_trajectory_groups(
        [TrajectoryGroup(rollout(rows[0], t) for t in ("Paris", "Lyon")),
         TrajectoryGroup(rollout(rows[1], t) for t in ("Rome", "{{x}}"))],
        after_each=after_each(parse_grader(check("ilike", reference="{{item.answer}}")), rows), pbar_desc=None,
    )  # fmt: skip
    assert [[t.reward for t in g] for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    unknown = parse_grader(check("eq", reference="{{item.nothing}}"))
    await score_trajectory(unknown, groups[1].trajectories[1], rows[1].item)
    metrics = grader_metrics(groups, split="val")
    assert metrics["val/grader/ilike/mean"] == 0.5
    assert metrics["val/grader/ilike/errors"] == 0.0 and metrics["val/grader/ilike/error_rate"] == 0.0
    assert metrics["val/grader/eq/mean"] == 0.0
    assert metrics["val/grader/eq/error/invalid_variable_error"] == 1.0
    assert metrics["val/grader/eq/error_rate"] == 1.0
    assert "val/grader/ilike/latency_s" in metrics
    assert any("invalid_variable_error" in log for log in groups[1].trajectories[1].logs)


async def test_after_each_needs_the_row_index():
    group = TrajectoryGroup([_trajectory("Paris")])
    with pytest.raises(RuntimeError, match="no valid metadata\\['rft_row'\\]"):
        await gather_trajectory_groups([group], after_each=after_each(parse_grader(check("eq")), []), pbar_desc=None)


# ---- RFT data -------------------------------------------------------------------------------------------------------


def test_rft_jsonl_rows_and_items(tmp_path):
    path = tmp_path / "train.jsonl"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                "answer": "x", "meta": {"level": 2}}) + "\n\n"
                    + json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}) + "\n")  # fmt: skip
    rows = load_rft_jsonl(path)
    assert [r.index for r in rows] == [0, 1]
    assert rows[0].tools == tools and rows[0].item == {"answer": "x", "meta": {"level": 2}}
    assert rows[1].tools is None and rows[1].item == {}


def test_rft_jsonl_errors_name_lines_and_fields(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "ok"}]}),
        "{not json",
        json.dumps({"prompt": "no messages"}),
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"messages": [{"role": "tool", "content": "x"}]}),
        json.dumps([1, 2]),
    ]))  # fmt: skip
    with pytest.raises(ValueError) as caught:
        load_rft_jsonl(path)
    text = str(caught.value)
    assert "5 problem(s)" in text
    assert f"{path}:2: invalid JSON" in text
    assert f"{path}:3: 'messages' must be a non-empty list" in text
    assert f"{path}:4: messages[0].role:" in text
    assert f"{path}:5: messages[0]: a 'tool' message needs 'tool_call_id'" in text
    assert f"{path}:6: a row must be a JSON object" in text


# ---- CLI ------------------------------------------------------------------------------------------------------------


def test_cli_validate_and_run(tmp_path: Path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.json"
    good.write_text(
        "type: multi\nname: answer\ncalculate_output: 0.5 * exact + 0.5 * close\ngraders:\n"
        "  exact: {type: string_check, name: exact, input: '{{sample.output_text}}', reference: '{{item.answer}}', operation: eq}\n"
        "  close: {type: text_similarity, name: close, input: '{{sample.output_text}}', reference: '{{item.answer}}', evaluation_metric: fuzzy_match}\n"
    )  # fmt: skip
    bad.write_text(json.dumps(check("regex")))
    runner = CliRunner()
    ok = runner.invoke(app, ["graders", "validate", str(good)])
    assert ok.exit_code == 0 and "ok (multi 'answer', 2 sub-graders)" in ok.output
    failed = runner.invoke(app, ["graders", "validate", str(good), str(bad)])
    assert failed.exit_code == 1 and "operation: Input should be" in failed.output
    sample = tmp_path / "sample.txt"
    sample.write_text("Paris")
    ran = runner.invoke(app, ["graders", "run", str(good), "--sample", str(sample), "--item", '{"answer": "Paris"}'])
    assert ran.exit_code == 0, ran.output
    body = json.loads(ran.output)
    assert (body["reward"], body["sub_rewards"]) == (1.0, {"exact": 1.0, "close": 1.0})
    assert not any(body["metadata"]["errors"].values()) and body["metadata"]["type"] == "multi"
    missing = json.loads(runner.invoke(app, ["graders", "run", str(good), "--sample", "Paris"]).output)
    assert missing["reward"] == 0.0 and missing["metadata"]["errors"]["invalid_variable_error"] is True  # OpenAI's flag
    assert missing["metadata"]["error_counts"] == {"invalid_variable_error": 2}  # both sub-graders
    not_json = runner.invoke(app, ["graders", "run", str(good), "--sample", "x", "--item", "{oops"])
    assert not_json.exit_code == 2 and "--item" in not_json.output


def test_cosine_embeddings_are_normalised():
    from flywheel.graders.embedding import embed

    vectors = embed(["one", "two words"])
    assert tuple(vectors.shape) == (2, 384)
    assert [math.isclose(float(v.norm()), 1.0, rel_tol=1e-4) for v in vectors] == [True, True]

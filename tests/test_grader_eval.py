"""``flywheel eval`` end to end on the embedded model: the base model, then a checkpoint of a trained model (a
quick SFT teaches it to answer "banana", so the checkpoint's scores must differ from the base model's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytest_asyncio
from typer.testing import CliRunner

from flywheel.cli import app
from flywheel.evaluation import parse_model_spec, score_interval
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel
from flywheel.stats import wilson
from flywheel.train import SFTConfig, TrainedWeights
from flywheel.types import Trajectory

QUESTIONS = [("What is the capital of France?", "Paris"), ("What is 2 + 2?", "4"), ("Name a primary colour.", "red")]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    data = root / "val.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": q}], "answer": a}) + "\n" for q, a in QUESTIONS)
    )
    banana = root / "banana.json"
    banana.write_text(json.dumps({"type": "string_check", "name": "banana", "input": "{{sample.output_text}}",
                                  "reference": "banana", "operation": "ilike"}))  # fmt: skip
    answer = root / "answer.yaml"
    answer.write_text(
        "type: multi\nname: answer\ncalculate_output: 0.5 * has + 0.5 * short\ngraders:\n"
        "  has: {type: string_check, name: has, input: '{{sample.output_text}}', reference: '{{item.answer}}', operation: ilike}\n"
        "  short:\n    type: python\n    name: short\n    source: |\n"
        "      def grade(sample, item):\n          return float(len(sample['output_text']) <= 200)\n"
    )  # fmt: skip
    return {"home": root / "home", "data": data, "banana": banana, "answer": answer, "root": root}


def _eval(files: dict[str, Path], model: str, out: str, *extra: str):
    args = ["eval", "--model", model, "--data", str(files["data"]), "--grader", str(files["banana"]),
            "--grader", str(files["answer"]), "--home", str(files["home"]), "--max-tokens", "8",
            "--output", str(files["root"] / out), *extra]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output, json.loads((files["root"] / out).read_text())


def test_eval_base_model(files):
    output, report = _eval(files, EMBEDDED_MODEL, "base.json")
    assert "95% interval" in output and "answer.has" in output
    assert [s["name"] for s in report["summaries"]] == ["banana", "answer"]
    assert len(report["rows"]) == 3
    for row, (_, answer) in zip(report["rows"], QUESTIONS):
        banana, graded = row["graders"]
        assert banana["reward"] == float("banana" in row["output"].lower())
        assert graded["sub_rewards"]["has"] == float(answer.lower() in row["output"].lower())
        assert graded["sub_rewards"]["short"] == 1.0 and graded["metadata"]["error_counts"] == {}
        assert not any(graded["metadata"]["errors"].values())  # OpenAI's flags, as graders/run answers
    summary = report["summaries"][1]
    assert summary["score"]["mean"] == pytest.approx(sum(r["graders"][1]["reward"] for r in report["rows"]) / 3)
    assert summary["sub_scores"]["has"]["method"] == "wilson"


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=["lora", "full"])
async def trained(files, request) -> str:
    """A model whose checkpoint 2 answers "banana" to anything (two SFT steps at a high learning rate), trained
    as a LoRA adapter or on every weight: eval must load it as it was trained."""
    full = request.param == "full"
    async with LocalBackend(path=files["home"], serve_http=False) as backend:
        model = TrainableModel(
            name=f"fruit-{request.param}",
            project="evaltest",
            base_model=EMBEDDED_MODEL,
            trained_weights=TrainedWeights(mode=request.param),
        )
        await model.register(backend)
        demos = [Trajectory(messages_and_choices=[{"role": "user", "content": q}, {"role": "assistant", "content": "banana"}])
                 for q, _ in QUESTIONS]  # fmt: skip
        await model.train_sft(demos, SFTConfig(learning_rate=1e-3 if full else 2e-2, epochs=2))
        assert await model.get_step() == 2
    return model.name


def test_eval_checkpoint(files, trained):
    output, report = _eval(files, f"{trained}@2", f"{trained}.json")
    assert report["model"] == f"{trained}@2"
    assert all("banana" in row["output"].lower() for row in report["rows"]), [r["output"] for r in report["rows"]]
    assert report["summaries"][0]["score"]["mean"] == 1.0
    missing = CliRunner().invoke(app, ["eval", "--model", f"{trained}@7", "--data", str(files["data"]),
                                       "--grader", str(files["banana"]), "--home", str(files["home"])])  # fmt: skip
    assert missing.exit_code == 1 and f"{trained}@7: no such checkpoint; available steps: [2]" in missing.output


def test_eval_refuses_bad_inputs_before_loading_a_model(files):
    bad = files["root"] / "bad.json"
    bad.write_text(
        json.dumps(
            {"type": "string_check", "name": "x", "input": "{{ sample.text }}", "reference": "y", "operation": "eq"}
        )
    )
    result = CliRunner().invoke(
        app, ["eval", "--model", EMBEDDED_MODEL, "--data", str(files["data"]), "--grader", str(bad)]
    )
    assert result.exit_code == 1 and "input: 'sample.text' is not a sample field" in result.output
    rows = files["root"] / "rows.jsonl"
    rows.write_text('{"prompt": "no messages"}\n')
    result = CliRunner().invoke(
        app, ["eval", "--model", EMBEDDED_MODEL, "--data", str(rows), "--grader", str(files["banana"])]
    )
    assert result.exit_code == 1 and "rows.jsonl:1: 'messages' must be a non-empty list" in result.output


def test_wilson_interval():
    assert wilson(0, 0) == (0.0, 0.0)
    lo, hi = wilson(50, 100)
    assert round(lo, 3) == 0.404 and round(hi, 3) == 0.596
    lo, hi = wilson(0, 40)
    assert lo == pytest.approx(0.0, abs=1e-12) and 0.08 < hi < 0.09  # 0 up to rounding at z = 1.95996...


def test_intervals_and_model_specs():
    low, high = wilson(0, 3)
    assert low == 0.0 and high == pytest.approx(0.5615, abs=1e-4)
    assert score_interval([1.0, 0.0, 1.0, 1.0]).method == "wilson"
    continuous = score_interval([0.2, 0.4, 0.9, 0.5])
    assert continuous.method == "bootstrap" and continuous.low <= continuous.mean <= continuous.high
    assert continuous == score_interval([0.2, 0.4, 0.9, 0.5])  # a fixed seed: the same report every time
    assert score_interval([0.3]).method == "none"
    assert parse_model_spec("agent@12") == ("agent", 12) and parse_model_spec("agent") == ("agent", None)
    with pytest.raises(ValueError, match="NAME@STEP"):
        parse_model_spec("agent@latest")

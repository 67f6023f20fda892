"""Graders compatible with OpenAI's reinforcement fine-tuning, usable as rewards and for evaluation.

Bring the grader JSON (or YAML) and the RFT JSONL data unchanged::

    from flywheel import graders

    grader = graders.load_grader("grader.json")
    result = await graders.grade(grader, "Paris", {"answer": "Paris"})   # result.reward, .sub_rewards, .errors
"""

from flywheel.graders.data import RFTRow, load_rft_jsonl
from flywheel.graders.model_graders import JudgeSettings
from flywheel.graders.run import GradeResult, grade
from flywheel.graders.sample import Sample
from flywheel.graders.sandbox import PythonSandbox, SandboxLimits
from flywheel.graders.scoring import grader_metrics, score_group, score_trajectory
from flywheel.graders.spec import Grader, GraderSpecError, load_grader, parse_grader

__all__ = [
    "GradeResult",
    "Grader",
    "GraderSpecError",
    "JudgeSettings",
    "PythonSandbox",
    "RFTRow",
    "Sample",
    "SandboxLimits",
    "grade",
    "grader_metrics",
    "load_grader",
    "load_rft_jsonl",
    "parse_grader",
    "score_group",
    "score_trajectory",
]

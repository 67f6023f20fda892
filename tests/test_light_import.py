"""An agent or runner process imports Flywheel's data types, gather and model handles without torch (the engine,
trainer and server load only when a backend is used)."""

from __future__ import annotations

import json
import subprocess
import sys

AGENT_SIDE = """
import json, sys
import flywheel as art
from flywheel import Trajectory, TrajectoryGroup, gather_trajectory_groups, TrainableModel, Model
from flywheel.types import sampled_tokens, set_intermediate_reward
from flywheel.gather import gather_trajectories
from flywheel.home import default_home
from flywheel.checkpoints.layout import model_path, steps  # a model's directory and its checkpoints
from flywheel.train.config import TrainConfig
from flywheel.agents import Tool, run_agent, to_transitions  # tool-using agents and their exports
from flywheel.graders.spec import parse_grader  # graders' data types
from flywheel.gateway.client import EpisodeClient, QueueClient  # an agent or runner talking to the gateway
from flywheel.gateway.runner import Runner  # a runner of the rollout queue
heavy = sorted(m for m in ("torch", "peft", "fastapi", "uvicorn", "transformers", "litellm", "flywheel.local",
                           "flywheel.inference.engine", "sqlalchemy", "flywheel.store", "flywheel.vllm_backend") if m in sys.modules)
backend = art.LocalBackend  # the heavy name still resolves, when asked for
print(json.dumps({"heavy": heavy, "torch_after_backend": "torch" in sys.modules, "modules": len(sys.modules)}))
"""


def test_the_agent_side_of_flywheel_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", AGENT_SIDE], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["torch_after_backend"]


CLI_HELP = """
import json, sys
from flywheel.cli import app

def help_of(*args):
    try:
        app([*args, "--help"], prog_name="flywheel")
    except SystemExit as exc:
        return exc.code
    return None

codes = {"flywheel": help_of()}
print("-- end of flywheel --help")
for group in ("export", "graders", "judge", "audit", "review", "eval", "loop", "serve", "train", "deploy", "dashboard"):
    codes[group] = help_of(group)
heavy = sorted(m for m in ("torch", "transformers", "peft", "flywheel.inference.loading", "flywheel.local",
                           "flywheel.checkpoints.run", "flywheel.loop.driver", "flywheel.train.trainer", "sqlalchemy",
                           "flywheel.store") if m in sys.modules)
print(json.dumps({"codes": codes, "heavy": heavy, "modules": len(sys.modules)}))
"""


def test_flywheel_help_loads_no_torch():
    """``flywheel --help`` (and each group's) lists the commands without loading torch, the engine or the store:
    the command modules import those inside the commands that need them (``flywheel.cli``)."""
    out = subprocess.run([sys.executable, "-c", CLI_HELP], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["codes"].values()) == {0}, result["codes"]
    assert result["heavy"] == []
    root_help = out.stdout.split("-- end of flywheel --help")[0]
    assert "Usage: flywheel" in root_help
    for command in ("train", "serve", "demo", "prepare", "runner", "eval", "deploy", "promote", "rollback",
                    "deployments", "loop", "export", "graders", "judge", "audit", "review"):  # fmt: skip
        assert f" {command} " in root_help, command

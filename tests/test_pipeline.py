"""The asynchronous pipeline (flywheel/pipeline.py) and bounded staleness (flywheel/train/staleness.py): the
iterations run ahead, what an exception or a restart does, which groups are too stale to train; and on the real
model, the step each call was answered at (recorded by the server) through a pipelined run, a kill and a restart."""

from __future__ import annotations

import asyncio

import pytest

import flywheel as art
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.pipeline import RolloutPipeline
from flywheel.train.config import TrainConfig
from flywheel.train.staleness import answered_at, drop_stale
from flywheel.types import ANSWERED_AT, WEIGHTS_STEP, weights_step

from helpers import sampled


def _trajectory(*steps: int | None, reward: float = 0.0) -> art.Trajectory:
    """A trajectory with one sampled turn per step (None: a turn without a recorded step)."""
    turns = []
    for n, step in enumerate(steps):
        choice = sampled(f"turn {n}", [1, 2], [3, 4])
        if step is not None:
            setattr(choice, WEIGHTS_STEP, step)
        turns += [{"role": "user", "content": f"q{n}"}, choice]
    return art.Trajectory(messages_and_choices=turns, reward=reward)


def test_a_group_with_one_member_past_the_bound_is_dropped_whole():
    # a trajectory was answered at its oldest call's step; the metadata, where set, says it
    assert answered_at(_trajectory(5, 3, 4)) == 3 and answered_at(_trajectory(None)) is None
    assert answered_at(_trajectory(5).model_copy(update={"metadata": {ANSWERED_AT: 1}})) == 1
    fresh = art.TrajectoryGroup([_trajectory(5), _trajectory(4, 5)])
    mixed = art.TrajectoryGroup([_trajectory(5), _trajectory(2, 5)])  # one member 3 steps old
    unknown = art.TrajectoryGroup([_trajectory(None), _trajectory(None)])  # built by hand: never dropped
    abandoned = art.TrajectoryGroup([_trajectory(5), _trajectory(7)])  # a step above the trained one: a restore
    kept, metrics = drop_stale([fresh, mixed, unknown, abandoned], 5, 2)
    assert kept == [fresh, unknown] and metrics["stale_groups"] == 2
    # the figures are over every member with a recorded step, dropped or not (a restore's future step aside)
    assert metrics["staleness_max"] == 3 and metrics["staleness_mean"] == pytest.approx((0 + 1 + 0 + 3 + 0) / 5)
    kept, metrics = drop_stale([fresh, mixed, unknown, abandoned], 5, 3)
    assert kept == [fresh, mixed, unknown]
    # no bound: nothing dropped, the figures still reported
    kept, metrics = drop_stale([fresh, mixed, abandoned], 5, None)
    assert len(kept) == 3 and "stale_groups" not in metrics and metrics["staleness_max"] == 3
    assert drop_stale([unknown], 5, 0) == ([unknown], {"stale_groups": 0.0})


async def test_the_pipeline_runs_async_steps_ahead_and_zero_is_synchronous():
    started: list[int] = []

    async def rollouts(i: int) -> str:
        started.append(i)
        await asyncio.sleep(0.01)
        return f"groups {i}"

    for k in (0, 1, 2):
        started.clear()
        seen = []
        async with RolloutPipeline(rollouts, async_steps=k, stop=4) as pipe:
            async for i, result in pipe:
                assert result == f"groups {i}"
                # while the caller trains on i, the next k iterations (within stop) are in flight
                assert pipe.in_flight == list(range(i + 1, min(i + 1 + k, 4))), (k, i)
                await asyncio.sleep(0.05)  # "training"
                seen.append(i)
        assert seen == [0, 1, 2, 3] and started == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="async_steps is -1"):
        RolloutPipeline(rollouts, async_steps=-1)


async def test_an_iterations_failure_is_raised_at_its_turn_and_leaving_cancels_the_rest():
    cancelled: list[int] = []

    async def rollouts(i: int) -> int:
        try:
            if i == 1:
                raise RuntimeError("rollouts of iteration 1 failed")
            await asyncio.sleep(0 if i == 0 else 30)
            return i
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    seen = []
    with pytest.raises(RuntimeError, match="iteration 1 failed"):
        async with RolloutPipeline(rollouts, async_steps=3, stop=10) as pipe:
            async for i, _ in pipe:
                seen.append(i)
    # iteration 0 came out; 1 raised at its turn; 2..3 (started while 1 was awaited) were cancelled on the way out
    assert seen == [0] and sorted(cancelled) == [2, 3] and pipe.in_flight == []


@pytest.mark.timeout(900)
async def test_a_pipelined_run_trains_within_its_bound_and_a_restart_trains_nothing_twice(
    fresh_backend: art.LocalBackend,
):
    """The real model, LoRA, one step ahead: each call records the step whose weights answered it (streamed or
    not); every group trains within the bound; a run stopped with an iteration in flight resumes at the position
    its checkpoint kept, and that iteration's rollouts are drawn again, trained once."""
    model = art.TrainableModel(name="piped", project="tests", base_model=EMBEDDED_MODEL)
    await model.register(fresh_backend)
    client = model.openai_client()
    attempts: dict[int, int] = {}
    trained: list[int] = []
    config = TrainConfig(learning_rate=1e-4, max_staleness_steps=1)

    async def rollouts(i: int) -> list[art.TrajectoryGroup]:
        attempts[i] = attempts.get(i, 0) + 1

        async def one(n: int) -> art.Trajectory:
            messages = [{"role": "user", "content": f"Say a word about the number {i}."}]
            r = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=6, logprobs=True
            )
            # rewards that differ: every group trains
            return art.Trajectory(messages_and_choices=[*messages, r.choices[0]], reward=float(n), metadata={"i": i})

        return [art.TrajectoryGroup(await asyncio.gather(one(0), one(1)))]

    async def run(stop_after: int | None) -> None:
        start = int((await model.checkpoint_extra()).get("next", 0))
        async with RolloutPipeline(rollouts, async_steps=1, start=start, stop=4) as pipe:
            async for i, groups in pipe:
                step = await model.get_step()
                for t in groups[0].trajectories:  # drawn by this step's weights, or (one step ahead) the last's
                    assert step - 1 <= answered_at(t) <= step, (i, step, answered_at(t))
                metrics = await model.train(groups, config=config, extra={"next": i + 1})
                assert metrics["stale_groups"] == 0 and metrics["staleness_max"] <= 1 and metrics["skipped"] == 0
                trained.append(i)
                if i == stop_after:
                    assert pipe.in_flight == [i + 1]  # killed here: its rollouts train nowhere
                    return

    await run(stop_after=1)
    await run(stop_after=None)
    assert trained == [0, 1, 2, 3] and attempts == {0: 1, 1: 1, 2: 2, 3: 1}
    assert await model.get_step() == 4
    # a group answered 3 steps before the live weights: dropped whole, the step skipped for want of signal
    old = art.TrajectoryGroup(
        [_trajectory(1, reward=0.0), _trajectory(1, reward=1.0)]  # choices without token ids would not train anyway
    )
    metrics = await model.train([old], config=config)
    assert metrics["stale_groups"] == 1 and metrics["skipped"] == 1 and await model.get_step() == 4
    # a streamed call records its step too (on its last chunk)
    stream = await client.chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    last = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            last = chunk.choices[0]
    assert last is not None and getattr(last, WEIGHTS_STEP) == 4
    assert weights_step(sampled("x", [1], [2])) is None

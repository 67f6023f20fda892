"""The gateway's end-to-end example, run as a user runs it: a training process, a runner process, and an unmodified
LangChain agent process per episode (examples/gateway/train.py), at the smallest size."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.store import EpisodeStatus, Store, episodes

EXAMPLE = Path(__file__).parent.parent / "examples" / "gateway" / "train.py"


# slow (runs in CI): the example script as a whole; each of its pieces has a test of its own in the default suite
# (an unmodified LangChain agent in its own process recorded token in, token out: test_gateway_clients.py; a
# `flywheel runner` process claiming attempts and Runner groups gathered: test_gateway_queue.py; gateway groups
# trained on: test_gateway.py)
@pytest.mark.slow
def test_the_gateway_example_trains_an_unmodified_agent_through_runners(tmp_path):
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "1", "--tasks", "1", "--group", "3", "--home", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    line = re.search(r"step 0: (\d+) episodes, mean reward ([\d.]+), (.*), model step (\d+)", run.stdout)
    assert line, run.stdout[-2000:]
    assert int(line.group(1)) == 3  # the group is complete: every attempt ran to its reward
    assert line.group(3).startswith(("loss", "skipped"))
    # the episodes are in the store the example's backend used, each with the agent's calls continued exactly
    store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
    try:
        with store.session() as s:
            finished = episodes.list_episodes(s, status=EpisodeStatus.finished)
            assert len(finished) == 3
            for episode in finished:
                calls = episodes.calls(s, episode.id)
                assert len(calls) >= 2 and calls[0].retokenized_turns == 0
                for before, call in itertools.pairwise(calls):
                    if before.response["choices"][0]["finish_reason"] == "length":  # cut: cannot be continued exactly
                        assert call.prefix_call is None and call.retokenized_turns >= 1
                    else:  # the agent's re-sent history continues the exact ids sampled
                        assert call.prefix_call == before.id and call.retokenized_turns == 0
    finally:
        store.close()

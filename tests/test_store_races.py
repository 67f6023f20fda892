"""Units of work that read an episode's row and then write it, racing in threads of one process (each with its own
connection, as a gateway's worker threads do), on SQLite and on a real PostgreSQL server. Each pair of them, many
rounds: whichever order they land in, the outcome is one that some order of the two would give (issue #37, item
10). Python's sqlite3 runs a SELECT outside any transaction and begins one only at the first write: without the
write lock taken before the read, two finishes with different rewards both succeeded, a lease's expiry was
overwritten by a finish (and the requeued attempt made the group one member too many), and two posts of one
feedback key were both stored."""

from __future__ import annotations

import pytest

from flywheel.store import EpisodeConflictError, Store, episodes, tasks
from flywheel.store.arms import ARM_KEY, MIXED, mark_arm
from flywheel.store.episodes import LOST_CALLS, EpisodeStatus
from flywheel.store.feedback import add_feedback, feedback_of

from helpers import at_once

ROUNDS = 25


@pytest.fixture
def store(db_url: str):
    store = Store(db_url)
    yield store
    store.close()


def _episode(store: Store) -> str:
    with store.session() as s:
        return episodes.create_episode(s, "race").id


def _unit(store: Store, fn, *args, **kwargs):
    with store.session() as s:
        return fn(s, *args, **kwargs)


def test_two_finishes_with_different_rewards_one_succeeds(store: Store):
    for round_ in range(ROUNDS):
        episode_id = _episode(store)

        def finish(i: int, episode_id: str = episode_id) -> float:
            return _unit(store, episodes.set_outcome, episode_id, reward=float(i), finish=True).reward

        results, errors = at_once(2, finish)
        assert len(results) == 1 and len(errors) == 1, (round_, results, errors)
        assert isinstance(errors[0], EpisodeConflictError) and "already finished with reward" in str(errors[0])
        assert _unit(store, episodes.get_episode, episode_id).reward == results[0]


def test_abandon_and_finish_at_once_one_succeeds(store: Store):
    for round_ in range(ROUNDS):
        episode_id = _episode(store)

        def close(i: int, episode_id: str = episode_id) -> str:
            if i == 0:
                return _unit(store, episodes.abandon, episode_id, "gave up").status
            return _unit(store, episodes.set_outcome, episode_id, reward=1.0, finish=True).status

        results, errors = at_once(2, close)
        assert len(results) == 1 and len(errors) == 1, (round_, results, errors)
        assert isinstance(errors[0], EpisodeConflictError)
        assert _unit(store, episodes.get_episode, episode_id).status == results[0]


def test_two_arms_marked_at_once_make_a_mixed_episode(store: Store):
    """Two deployments answered calls of one episode at once: it is ``mixed``, never the one written last."""
    for round_ in range(ROUNDS):
        episode_id = _episode(store)
        results, errors = at_once(2, lambda i, e=episode_id: _unit(store, mark_arm, e, f"calc@{i}"))
        assert errors == [] and MIXED in results, (round_, results, errors)
        assert _unit(store, episodes.get_episode, episode_id).meta[ARM_KEY] == MIXED


def test_an_arm_marked_while_an_episode_is_abandoned_keeps_both(store: Store):
    """Both write the episode's meta: the arm and the reason it was abandoned both survive."""
    for round_ in range(ROUNDS):
        episode_id = _episode(store)

        def write(i: int, episode_id: str = episode_id):
            return (
                _unit(store, mark_arm, episode_id, "calc@canary")
                if i
                else _unit(store, episodes.abandon, episode_id, "x")
            )

        _, errors = at_once(2, write)
        assert errors == [], (round_, errors)
        meta = _unit(store, episodes.get_episode, episode_id).meta
        assert meta.get(ARM_KEY) == "calc@canary" and meta.get("abandoned_because") == "x", (round_, meta)


def test_lost_calls_at_once_are_each_counted(store: Store):
    for round_ in range(ROUNDS // 5):
        episode_id = _episode(store)
        _, errors = at_once(4, lambda i, e=episode_id: _unit(store, episodes.lose_call, e, f"call {i} lost"))
        assert errors == [], (round_, errors)
        assert _unit(store, episodes.get_episode, episode_id).meta[LOST_CALLS] == 4


def test_one_feedback_key_posted_twice_at_once_is_stored_once(store: Store):
    for round_ in range(ROUNDS):
        episode_id = _episode(store)

        def post(i: int, episode_id: str = episode_id) -> bool:
            return _unit(store, add_feedback, episode_id, kind="resolved", value=float(i % 2), key="ticket-1")[1]

        same, errors = at_once(
            2, lambda i, e=episode_id: _unit(store, add_feedback, e, kind="k", value=1.0, key="a")[1]
        )
        assert errors == [] and sorted(same) == [False, True], (round_, same, errors)
        results, errors = at_once(2, post)
        assert results == [True] and len(errors) == 1 and isinstance(errors[0], EpisodeConflictError), (
            round_,
            results,
            errors,
        )
        assert len(_unit(store, feedback_of, episode_id)) == 2


def test_a_lease_expiring_while_its_episode_finishes_never_grows_the_group(store: Store):
    """A runner finishes its episode through the episode API just as its lease runs out and another runner's claim
    expires it: either the finish wins (the attempt is finished with it) or the expiry does (the episode is
    abandoned, the finish is a conflict, the attempt is requeued). The task never has more than ``group_size``
    finished episodes, and every finished episode is a finished attempt's."""
    for round_ in range(ROUNDS // 2):
        task_id = f"group-{round_}"
        _unit(store, tasks.enqueue, task_id, {}, group_size=1, max_tries=5)
        lease = _unit(store, tasks.claim, "slow", 0.001)
        assert lease is not None

        def race(i: int, episode_id: str = lease.episode.id):
            if i == 0:
                return _unit(store, episodes.set_outcome, episode_id, reward=1.0, finish=True)
            return _unit(store, tasks.claim, "other", 30)

        results, errors = at_once(2, race)
        assert all(isinstance(e, EpisodeConflictError) for e in errors), (round_, errors)
        claimed = next((r for r in results if isinstance(r, tasks.Claim)), None)
        while claimed is not None:  # the requeued attempt runs again, to its end
            _unit(store, tasks.complete, claimed.attempt.id, claimed.episode.id, reward=0.5)
            claimed = _unit(store, tasks.claim, "other", 30)
        task, attempts = _unit(store, tasks.get_task, task_id)
        finished = _unit(store, episodes.list_episodes, task_id=task_id, status=EpisodeStatus.finished)
        assert task.complete and len(finished) == 1, (round_, task, finished)
        assert [a.episode_id for a in attempts if a.status == tasks.AttemptStatus.finished] == [finished[0].id]

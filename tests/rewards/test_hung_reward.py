"""A reward function that hangs for good is given up on after its first calls of a batch (the rest score 0 without
running, counted and said); a scoring call can be cancelled; whatever stops a call leaves no scoring process of it
running."""
import logging
import multiprocessing as mp
import os
import time

import pytest

from qwen35rl.data import PromptExample
from qwen35rl.rewards import RewardPool
from qwen35rl.rewards.scoring import ScoringCancelled

import reward_helpers


@pytest.fixture
def pool():
    p = RewardPool(num_workers=2)
    p.warm()
    yield p
    p.close()


def ex(i=0):
    return PromptExample(prompt_ids=[1], prompt_text="q", answer="a", index=i)


def live_workers():
    return {p.pid for p in mp.active_children() if p.name == "reward-worker"}


def idle(pool):
    return {w.process.pid for w in pool._idle}


def assert_none_left(pool, before_all, ours_before):
    """Of the reward workers, only this pool's idle ones are new since `before_all`, and the ones it took for the
    call (`ours_before` less its idle ones now) are gone."""
    now = live_workers()
    assert now - before_all <= idle(pool)
    assert not (ours_before - idle(pool)) & now


def test_a_reward_that_always_hangs_is_given_up_on_after_its_first_calls(pool, caplog):
    """20 responses, each call hanging for an hour, limit 1 s, 2 workers: the first 4 calls time out with none
    returned, the other 16 are not run. Counted as timed out, scored 0, said once."""
    n = 20
    errors = []
    before_all, ours_before = live_workers(), idle(pool)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="qwen35rl.rewards.scoring"):
        scores, stats = pool.score(reward_helpers.length_or_hang, ["hang"] * n, [""] * n,
                                   [ex(i) for i in range(n)], timeout_s=1.0, errors=errors)
    took = time.monotonic() - t0
    assert pool.hung_after() == 4
    assert scores == [0.0] * n and stats == {"reward/failed": 0, "reward/timeout": n}
    assert sum("no result within 1 s" in e for e in errors) == 4
    assert sum("not run: the reward function looks hung (its first 4 calls of this batch ran past 1 s and none "
               "returned)" in e for e in errors) == 16
    hung = [r.getMessage() for r in caplog.records if "looks hung" in r.getMessage()]
    assert len(hung) == 1 and "the other 16 responses score 0 without being run" in hung[0]
    assert took < 60, took  # 10 limits of 1 s each without the cut (20 calls over 2 workers)
    assert_none_left(pool, before_all, ours_before)


def test_a_reward_that_returns_now_and_then_is_never_taken_as_hung(pool):
    """One call returned: every hang is only cut off at its own limit."""
    responses = ["ab"] + ["hang"] * 6 + ["abc"]
    scores, stats = pool.score(reward_helpers.length_or_hang, responses, [""] * 8, [ex(i) for i in range(8)],
                               timeout_s=0.5)
    assert scores == [2.0] + [0.0] * 6 + [3.0]
    assert stats == {"reward/failed": 0, "reward/timeout": 6}


@pytest.mark.parametrize("how", ["cancel", "interrupt"])
def test_a_cancelled_or_interrupted_call_leaves_no_scoring_process(pool, how):
    started = time.monotonic()

    def cancel():
        if time.monotonic() - started > 0.5:
            if how == "interrupt":
                raise KeyboardInterrupt  # as a signal's handler raises it in the waiting thread
            return True
        return False

    expected = ScoringCancelled if how == "cancel" else KeyboardInterrupt
    before_all, ours_before = live_workers(), idle(pool)
    with pytest.raises(expected):
        pool.score(reward_helpers.length_or_hang, ["hang"] * 4, [""] * 4, [ex(i) for i in range(4)],
                   timeout_s=600, cancel=cancel)
    assert time.monotonic() - started < 30  # not the hour each call would hang, nor the 600 s limit
    assert_none_left(pool, before_all, ours_before)  # the hung ones are gone
    scores, _ = pool.score(reward_helpers.length_or_hang, ["xy"], [""], [ex()], timeout_s=30)
    assert scores == [2.0]  # and the pool scores on

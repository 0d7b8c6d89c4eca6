import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import threading
import time

import pytest

from qwen35rl.data import PromptExample
from qwen35rl.rewards import BUILTIN, RewardPool, get_reward_fn, score_responses
from qwen35rl.rewards.builtin import exact_match, extract_boxed, format_reward, math_reward
from qwen35rl.data.synthetic import digit_reward

import reward_helpers


@pytest.fixture(scope="module")
def pool():
    p = RewardPool(num_workers=2)
    yield p
    p.close()


def ex(i=0):
    return PromptExample(prompt_ids=[1], prompt_text="q", answer="a", index=i)


# ---------------------------------------------------------------------------------------------------- built-ins
def test_extract_boxed_takes_last_balanced():
    assert extract_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed(r"\fbox{ 7 }") == "7"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert extract_boxed("no box") is None


def test_exact_match():
    assert exact_match("  Paris. ", "paris", None) == 1.0
    assert exact_match(r"The answer is \boxed{42}", "42", None) == 1.0
    assert exact_match("The answer is 42", "42", None) == 0.0
    assert exact_match("1000", "steps... #### 1,000", None) == 1.0  # GSM8K ground truth


def test_format_reward():
    assert format_reward(r"<think>hmm</think> \boxed{3}") == 1.0
    assert format_reward(r"\boxed{3}") == 1.0
    assert format_reward(r"<think>hmm \boxed{3}") == 0.0  # think never closed
    assert format_reward(r"\boxed{}") == 0.0
    assert format_reward("3") == 0.0


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\sqrt{12}}", r"2\sqrt{3}", 1.0),
        (r"\boxed{1+x^2}", "x^2+1", 1.0),
        (r"\boxed{1,000}", "Natalia sold ... #### 1000", 1.0),
        (r"\boxed{73}", "72", 0.0),
        ("72", "72", 0.0),  # no boxed answer
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer, None) == expected


def test_math_reward_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{\frac{2}{4}}", "0.5", None)))
    t.start()
    t.join()
    assert out == [1.0]


def test_get_reward_fn():
    assert get_reward_fn("exact_match") is exact_match
    assert get_reward_fn("format") is format_reward
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("copy_digit") is digit_reward and get_reward_fn("sum_digits") is digit_reward
    assert get_reward_fn("reward_helpers:prompt_index") is reward_helpers.prompt_index
    with pytest.raises(ValueError, match="exact_match"):
        get_reward_fn("exactmatch")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward_fn("reward_helpers:missing")
    assert set(BUILTIN) >= {"exact_match", "format", "math", "copy_digit"}


# ------------------------------------------------------------------------------------------------------ scoring
def test_scores_keep_order_and_examples(pool):
    examples = [ex(i // 3) for i in range(12)]
    examples = [examples[0]] * 3 + [examples[3]] * 3 + [examples[6]] * 3 + [examples[9]] * 3
    scores, stats = pool.score(reward_helpers.prompt_index, ["r"] * 12, ["a"] * 12, examples, timeout_s=10)
    assert scores == [float(i // 3) for i in range(12)]
    assert stats == {"reward/failed": 0, "reward/timeout": 0}
    scores, _ = pool.score(get_reward_fn("math"), [r"\boxed{4}", r"\boxed{5}", "4"], ["4"] * 3, [ex()] * 3, 10)
    assert scores == [1.0, 0.0, 0.0]


def test_failures_and_hangs_score_zero_and_are_counted(pool):
    responses = ["ab", "hang", "abc", "raise", "nan", "die", "abcd", "hang", "a"]
    start = time.monotonic()
    scores, stats = pool.score(reward_helpers.length_or_hang, responses, [""] * 9, [ex()] * 9, timeout_s=0.5)
    elapsed = time.monotonic() - start
    assert scores == [2.0, 0.0, 3.0, 0.0, 0.0, 0.0, 4.0, 0.0, 1.0]
    assert stats == {"reward/failed": 3, "reward/timeout": 2}
    assert elapsed < 5.0  # two hangs of an hour each were cut off
    # the pool recovered: killed workers were replaced
    scores, stats = pool.score(reward_helpers.length_or_hang, ["xy"] * 4, [""] * 4, [ex()] * 4, timeout_s=5)
    assert scores == [2.0] * 4 and stats["reward/timeout"] == 0
    assert all(w.process.is_alive() for w in pool._idle)


def test_hang_does_not_block_a_driver_thread():
    out = {}

    def run():
        out["result"] = score_responses(reward_helpers.length_or_hang, ["hang", "ok"], ["", ""], [ex(), ex(1)], 0.5)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive()
    assert out["result"] == ([0.0, 2.0], {"reward/failed": 0, "reward/timeout": 1})


def test_unpicklable_function_is_rejected(pool):
    with pytest.raises(TypeError, match="module level"):
        pool.score(lambda r, a, e: 1.0, ["x"], ["x"], [ex()], 1)
    with pytest.raises(ValueError, match="1 responses, 2 answers"):
        pool.score(exact_match, ["x"], ["x", "y"], [ex()], 1)


def test_worker_start_and_task_load_are_outside_the_time_limit():
    import slow_import_reward

    p = RewardPool(num_workers=2)
    try:
        start = time.monotonic()
        scores, stats = p.score(slow_import_reward.constant, ["a"] * 4, [""] * 4, [ex(i) for i in range(4)],
                                timeout_s=slow_import_reward.IMPORT_S / 3)
        assert stats == {"reward/failed": 0, "reward/timeout": 0} and scores == [1.0] * 4
        assert time.monotonic() - start < 30
    finally:
        p.close()


def test_warm_starts_every_worker_before_scoring():
    p = RewardPool(num_workers=2)
    try:
        p.warm()
        assert len(p._idle) == 2 and all(w.process.is_alive() for w in p._idle)
        pids = {w.process.pid for w in p._idle}
        scores, stats = p.score(reward_helpers.length_or_hang, ["ab", "hang", "abc"], [""] * 3,
                                [ex(0), ex(1), ex(2)], timeout_s=0.5)
        assert scores == [2.0, 0.0, 3.0] and stats["reward/timeout"] == 1
        assert len(pids & {w.process.pid for w in p._idle}) >= 1  # warmed workers did the scoring
    finally:
        p.close()


def test_a_background_warm_up_and_a_scoring_call_at_once(monkeypatch):
    """The driver warms the shared pool in a thread while Ray starts: a scoring call that comes before the warm-up
    ends waits for it, and its per-call limits start after it."""
    from qwen35rl.rewards import scoring

    p = RewardPool(num_workers=2)
    monkeypatch.setattr(scoring, "_POOL", p)
    try:
        scoring.warm_pool()
        scores, stats = score_responses(reward_helpers.length_or_hang, ["ab", "hang", "abc"], [""] * 3,
                                        [ex(0), ex(1), ex(2)], timeout_s=0.5)
        assert scores == [2.0, 0.0, 3.0] and stats == {"reward/failed": 0, "reward/timeout": 1}
        warmer = [t for t in threading.enumerate() if t.name == "reward-pool-warm"]
        for t in warmer:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in warmer)
        assert p._idle and all(w.process.is_alive() for w in p._idle)  # the hung worker was replaced or dropped
    finally:
        p.close()


def test_a_step_is_bounded_as_a_whole_and_the_failures_are_told(pool):
    """Each call is limited, and so is the whole batch: what is left unscored at the bound counts as timed out."""
    responses = ["ab", "raise", "hang", "hang", "hang", "hang"]
    errors = []
    t0 = time.monotonic()
    scores, stats = pool.score(reward_helpers.length_or_hang, responses, ["a"] * 6, [ex(i) for i in range(6)],
                               timeout_s=5.0, errors=errors, step_timeout_s=1.0)
    assert time.monotonic() - t0 < 4.0  # not 4 hangs x 5 s over 2 workers
    assert scores == [2.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert stats == {"reward/failed": 1, "reward/timeout": 4}
    assert errors[0] == "response 1: RuntimeError: bad reward"
    assert sorted(errors[1:]) == [f"response {i}: not scored within the step's bound of 1 s" for i in range(2, 6)]
    # the default bound: every call using its whole limit, over the workers, plus one worker start-up
    assert pool.step_limit(6, 5.0) == 5.0 * 3 + 120.0
    assert pool.score(reward_helpers.length_or_hang, ["ab"], ["a"], [ex()], timeout_s=5.0) == ([2.0], {
        "reward/failed": 0, "reward/timeout": 0})

"""`data.reward=verl:FILE.py:FUNCTION`: a function of verl's compute_score signature, fed each row's data_source
and extra_info, scored in the reward workers like any other reward."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pickle
import textwrap

import pytest

from qwen35rl.data import PromptExample
from qwen35rl.names import parse_verl_reward, verl_reward
from qwen35rl.rewards import RewardPool, get_reward_fn
from qwen35rl.rewards.verl_signature import VerlReward

SCORE_FILE = textwrap.dedent('''
    import asyncio

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == "dict":
            return {"score": 0.5 + extra_info["bonus"], "acc": 1.0}
        if data_source == "turns":
            return float(extra_info["num_turns"] + len(extra_info["rollout_reward_scores"]))
        if data_source == "no_score":
            return {"acc": 1.0}
        if data_source == "text":
            return "1.0"
        if data_source == "raise":
            raise RuntimeError("bad row")
        return float(solution_str.strip() == ground_truth)

    async def async_score(data_source, solution_str, ground_truth, extra_info):
        await asyncio.sleep(0)
        return len(solution_str)

    def positional(a, b):
        return 1.0
''')


@pytest.fixture()
def score_file(tmp_path):
    path = tmp_path / "my reward.py"
    path.write_text(SCORE_FILE)
    return str(path)


def row(source="gsm8k", extra=None, answer="42"):
    return PromptExample(prompt_ids=[1], prompt_text="q", answer=answer, data_source=source, extra_info=extra)


def test_spec_parsing():
    assert parse_verl_reward("verl:/r/a.py:score") == ("/r/a.py", "score")
    assert parse_verl_reward("verl:/r/a.py") == ("/r/a.py", "compute_score")  # verl's default name
    assert parse_verl_reward("verl:C:/r/a.py:f") == ("C:/r/a.py", "f")  # the function follows the last ':'
    assert parse_verl_reward("verl:pkg.mod:f") == ("pkg.mod", "f")
    assert parse_verl_reward("math") is None and parse_verl_reward("pkg.mod:f") is None
    assert verl_reward("/r/a.py", None) == "verl:/r/a.py:compute_score"


def test_called_with_verls_arguments(score_file):
    fn = get_reward_fn(f"verl:{score_file}:compute_score")
    assert isinstance(fn, VerlReward)
    assert fn(" 42 ", "42", row()) == 1.0 and fn("41", "42", row()) == 0.0
    assert fn("x", "42", row("dict", {"bonus": 0.25})) == 0.75  # a dict's "score"
    assert fn("x", "42", row("turns", {})) == 2.0  # verl's single-turn extra_info entries
    extra = {"bonus": 1.0}
    fn("x", "42", row("dict", extra))
    assert extra == {"bonus": 1.0}  # the row's own dict is not changed
    assert fn("42", "42", None) == 1.0  # no example: data_source "" and an empty extra_info
    assert get_reward_fn(f"verl:{score_file}:async_score")("abc", "", row()) == 3.0


def test_bad_returns_raise(score_file):
    fn = get_reward_fn(f"verl:{score_file}")
    with pytest.raises(ValueError, match="without 'score'"):
        fn("x", "1", row("no_score", {}))
    with pytest.raises(TypeError, match="not a number"):
        fn("x", "1", row("text", {}))


def test_pickles_as_its_file(score_file):
    fn = get_reward_fn(f"verl:{score_file}:compute_score")
    state = pickle.dumps(fn)
    assert SCORE_FILE.encode() not in state and len(state) < 400
    again = pickle.loads(state)
    assert again.target == os.path.abspath(score_file) and again.name == "compute_score"
    assert again("42", "42", row()) == 1.0


def test_load_errors_name_the_setting(score_file, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        get_reward_fn(f"verl:{tmp_path / 'nope.py'}:compute_score")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward_fn(f"verl:{score_file}:missing")
    with pytest.raises(ValueError, match="as verl calls compute_score"):
        get_reward_fn(f"verl:{score_file}:positional")


def test_scored_in_workers_and_failures_counted(score_file):
    fn = get_reward_fn(f"verl:{score_file}:compute_score")
    examples = [row(), row(), row("dict", {"bonus": 0.5}), row("raise", {}), row("no_score", {}), row("text", {})]
    pool = RewardPool(num_workers=2)
    try:
        errors = []
        scores, stats = pool.score(fn, ["42", "0", "x", "x", "x", "x"], ["42"] * 6, examples, timeout_s=20,
                                   errors=errors)
    finally:
        pool.close()
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert stats == {"reward/failed": 3, "reward/timeout": 0}
    assert any("RuntimeError: bad row" in e for e in errors)

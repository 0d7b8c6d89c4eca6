import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from qwen35rl.algo.core import policy_loss
from qwen35rl.algo.rollout_correction import METRICS, fold, is_weights
from qwen35rl.runtime.batching import Sequences, build_batch

torch.set_num_threads(1)
e = math.exp


# ------------------------------------------------------------------------------------------------------ weights
def test_token_weights_hand_values_and_truncation():
    old = [[-1.0, -2.0], [0.0]]
    behaviour = [[-1.5, -1.0], [-1.0]]           # log ratios 0.5, -1.0 | 1.0
    w, m = is_weights(old, behaviour, "token", 2.0)
    assert w == [pytest.approx([e(0.5), e(-1.0)]), pytest.approx([2.0])]   # e^1 = 2.72 truncated at the cap 2
    applied = [e(0.5), e(-1.0), 2.0]
    assert m == pytest.approx({
        "rollout_corr/rollout_is_mean": sum(applied) / 3,
        "rollout_corr/rollout_is_max": e(1.0),                              # before truncation
        "rollout_corr/rollout_is_min": e(-1.0),
        "rollout_corr/rollout_is_ratio_fraction_high": 1 / 3,
        "rollout_corr/rollout_is_eff_sample_size": sum(applied) ** 2 / (3 * sum(x * x for x in applied)),
        "rollout_corr/log_ratio_abs_mean": (0.5 + 1.0 + 1.0) / 3,
    })
    assert set(m) == set(METRICS)
    # a higher cap lets the third token through untruncated
    w, m = is_weights(old, behaviour, "token", 3.0)
    assert w[1] == pytest.approx([e(1.0)]) and m["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0


def test_sequence_weights_are_the_truncated_product_and_stats_count_responses():
    old = [[-0.5, -0.5, -0.5], [-1.0], [-0.9, -0.8]]
    behaviour = [[-1.0, -1.0, -1.0], [-0.75], [-1.0, -1.0]]   # summed log ratios 1.5 | -0.25 | 0.3
    w, m = is_weights(old, behaviour, "sequence", 2.0)
    assert w == [pytest.approx([2.0, 2.0, 2.0]), pytest.approx([e(-0.25)]), pytest.approx([e(0.3), e(0.3)])]
    applied = [2.0, e(-0.25), e(0.3)]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(sum(applied) / 3)           # per response, not token
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)       # 3 of 6 tokens, 1 of 3 rows
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(e(1.5))
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(e(-0.25))
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(
        sum(applied) ** 2 / (3 * sum(x * x for x in applied)))
    assert m["rollout_corr/log_ratio_abs_mean"] == pytest.approx((1.5 + 0.25 + 0.3) / 6)  # per token in both modes


def test_sequence_mode_differs_from_token_mode():
    old, behaviour = [[-1.0, -1.0]], [[-1.3, -1.3]]
    token, _ = is_weights(old, behaviour, "token", 10.0)
    seq, _ = is_weights(old, behaviour, "sequence", 10.0)
    assert token == [pytest.approx([e(0.3), e(0.3)])]
    assert seq == [pytest.approx([e(0.6), e(0.6)])]


def test_off_gives_ones_and_no_metrics():
    w, m = is_weights([[0.0, -5.0], [], [-1.0]], [[-3.0, 0.0], [], [-9.0]], "off", 2.0)
    assert w == [[1.0, 1.0], [], [1.0]] and m == {}


def test_extreme_log_ratios_stay_finite_and_positive():
    w, m = is_weights([[0.0, -1000.0, 0.0]], [[-1000.0, 0.0, float("-inf")]], "token", 2.0)
    assert w == [pytest.approx([2.0, e(-20.0), 2.0])]
    assert all(x > 0 for x in w[0])
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(e(20.0))      # the clamp, not inf
    # a long response whose summed log ratio would overflow exp
    w, m = is_weights([[0.0] * 500, [-5.0] * 500], [[-5.0] * 500, [0.0] * 500], "sequence", 2.0)
    assert w[0] == [2.0] * 500 and w[1] == pytest.approx([e(-20.0)] * 500)
    assert all(math.isfinite(v) for v in m.values())


def test_empty_responses_and_batches():
    w, m = is_weights([[], [0.0]], [[], [-0.1]], "sequence", 2.0)
    assert w == [[], pytest.approx([e(0.1)])]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(e(0.1))   # the empty response is not a sample
    assert is_weights([], [], "token", 2.0) == ([], {})


def test_errors_name_the_row_and_the_key():
    with pytest.raises(ValueError, match="response 1: 2 old log-probs but 1 rollout log-probs"):
        is_weights([[0.0], [0.0, 0.0]], [[0.0], [0.0]], "token", 2.0)
    with pytest.raises(ValueError, match="response 0"):
        is_weights([[0.0]], [[]], "off", 2.0)
    with pytest.raises(ValueError, match="2 responses of old log-probs but 1"):
        is_weights([[0.0], [0.0]], [[0.0]], "sequence", 2.0)
    with pytest.raises(ValueError, match="algorithm.rollout_is='auto'"):
        is_weights([[0.0]], [[0.0]], "auto", 2.0)
    with pytest.raises(ValueError, match="algorithm.rollout_is_threshold=1"):
        is_weights([[0.0]], [[0.0]], "token", 1.0)


# --------------------------------------------------------------------------------------------------------- fold
def test_fold_scales_each_token():
    assert fold([2.0, -1.0], [[0.5, 1.0], [3.0]]) == [[1.0, 2.0], [-3.0]]
    assert fold([[1.0, -2.0]], [[0.5, 2.0]]) == [[0.5, -4.0]]           # advantages already per token
    with pytest.raises(ValueError, match=r"advantages\[0\] has 1 values for 2 IS weights"):
        fold([[1.0]], [[0.5, 2.0]])
    with pytest.raises(ValueError, match="2 advantages for 1 responses"):
        fold([1.0, 2.0], [[1.0]])


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_folded_advantages_equal_the_weighted_policy_loss(mode):
    """w * policy_loss(A) == policy_loss(w * A) token by token, for the gradient too: clip (both signs) and the
    dual clip of negative advantages all act in this batch."""
    g = torch.Generator().manual_seed(0)
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    responses = [[10, 11, 12], [13, 14, 15, 16], [17, 18], [19, 20, 21]]
    advantages = [1.0, -1.0, -0.5, 2.0]
    # current - old log ratio per token: inside the range, clipped above/below, and above clip_c=3 for A < 0
    deltas = [[0.0, 0.5, -0.7], [1.5, -0.5, 0.1, 2.0], [0.05, 1.3], [0.3, -0.3, 0.0]]
    old = [(-0.1 - 2.9 * torch.rand(len(r), generator=g, dtype=torch.float64)).tolist() for r in responses]
    behaviour = [(torch.tensor(o, dtype=torch.float64) - 0.4 * torch.randn(len(o), generator=g, dtype=torch.float64)
                  ).tolist() for o in old]
    behaviour[1][0] = old[1][0] - 1.2                                       # one ratio past the cap
    weights, metrics = is_weights(old, behaviour, mode, 1.5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] > 0
    assert metrics["rollout_corr/rollout_is_min"] < 1.0

    plain = build_batch(Sequences(prompts, responses, old_log_probs=old, advantages=advantages), pad_token_id=0)
    folded = build_batch(Sequences(prompts, responses, old_log_probs=old, advantages=fold(advantages, weights)),
                         pad_token_id=0)
    mask = plain.response_mask
    p_len = max(len(p) for p in prompts)
    w = torch.zeros(mask.shape)
    current = plain.old_log_probs.clone()
    for i, (ws, d) in enumerate(zip(weights, deltas)):
        w[i, p_len:p_len + len(ws)] = torch.tensor(ws)
        current[i, p_len:p_len + len(d)] += torch.tensor(d)
    assert not torch.equal(folded.advantages, plain.advantages)

    lp_direct = current.clone().requires_grad_(True)
    lp_folded = current.clone().requires_grad_(True)
    clip = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0)
    loss, stats = policy_loss(lp_direct, plain.old_log_probs, plain.advantages, mask, **clip)
    direct = w * loss
    via_adv, stats_folded = policy_loss(lp_folded, folded.old_log_probs, folded.advantages, mask, **clip)
    assert stats["clipfrac"].sum() >= 3 and stats["clipfrac_lower"].sum() == 3   # both clips fire
    torch.testing.assert_close(via_adv, direct)
    for name in stats:
        assert torch.equal(stats_folded[name], stats[name]), name
    direct.sum().backward()
    via_adv.sum().backward()
    torch.testing.assert_close(lp_folded.grad, lp_direct.grad)
    assert lp_direct.grad.abs().sum() > 0

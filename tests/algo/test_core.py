import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from qwen35rl.algo.core import (
    LOSS_AGG_MODES,
    agg_loss,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    local_batch_counts,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    policy_loss,
)

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------- advantages
def test_grpo_advantages_bessel_std_and_singletons():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 5.0])
    groups = torch.tensor([10, 10, 10, 3, 3, 42])  # non-contiguous ids, a singleton group
    adv = grpo_advantages(scores, groups)
    # group 10: mean 1/3, Bessel std sqrt(((2/3)^2 + 2*(1/3)^2) / 2) = sqrt(1/3)
    s10 = math.sqrt(1 / 3)
    # group 3: mean 3, std sqrt((1 + 1) / 1) = sqrt(2)
    expected = [
        (1 - 1 / 3) / (s10 + 1e-6), (-1 / 3) / (s10 + 1e-6), (-1 / 3) / (s10 + 1e-6),
        -1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6),
        5.0 / (1 + 1e-6),  # singleton: mu = 0, sigma = 1
    ]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_grpo_advantages_dr_grpo_and_equal_scores():
    scores = torch.tensor([3.0, 1.0, 2.0, 2.0, 7.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    adv = grpo_advantages(scores, groups, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, 7.0]))
    # equal scores: zero advantage, no nan from the zero std
    assert torch.equal(grpo_advantages(scores, groups)[2:4], torch.zeros(2))


# --------------------------------------------------------------------------------------------------- policy loss
def test_policy_loss_hand_values():
    # one token per case; A and ratio chosen to hit every branch
    cases = [  # (A, ratio, expected loss, clipped, dual)
        (1.0, 1.1, -1.1, 0, 0),            # inside the range
        (1.0, 1.5, -1.28, 1, 0),           # A>0, ratio above 1+eps_high: clipped at 1.28... max(-1.5, -1.28)
        (1.0, 0.5, -0.5, 0, 0),            # A>0, ratio below 1-eps_low: max(-0.5, -0.8) = unclipped
        (-1.0, 0.5, 0.8, 1, 0),            # A<0, ratio below: max(0.5, 0.8) = clipped
        (-1.0, 2.0, 2.0, 0, 0),            # A<0, ratio 2: max(2.0, 1.28) = 2.0 < c=3
        (-1.0, 5.0, 3.0, 0, 1),            # A<0, ratio 5: max = 5 > -A*c = 3 -> dual clip
        (-2.0, 4.0, 6.0, 0, 1),            # A=-2: max(8, 2.56) = 8 > 6
        (2.0, 5.0, -2.56, 1, 0),           # A>0 never dual-clipped
    ]
    adv = torch.tensor([[c[0] for c in cases]])
    old = torch.zeros_like(adv)
    logp = torch.log(torch.tensor([[c[1] for c in cases]]))
    mask = torch.ones_like(adv, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([[c[2] for c in cases]]), rtol=1e-5, atol=1e-6)
    assert stats["clipfrac"].tolist() == [[float(c[3]) for c in cases]]
    assert stats["clipfrac_lower"].tolist() == [[float(c[4]) for c in cases]]
    torch.testing.assert_close(stats["approx_kl"], -logp)


def test_policy_loss_clamps_log_ratio_and_ignores_padding():
    logp = torch.tensor([[0.0, 0.0, float("nan")]])
    old = torch.tensor([[-100.0, 100.0, 0.0]])  # delta = 100 -> clamped to 20; -100 -> -20
    adv = torch.tensor([[-1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = policy_loss(logp, old, adv, mask, clip_c=1e12)
    # A=-1, ratio e^20: max(e^20, 1.2) = e^20 (dual bound huge); A=1, ratio e^-20: max(-e^-20, -0.8)
    torch.testing.assert_close(loss, torch.tensor([[math.exp(20), -math.exp(-20), 0.0]]))
    assert stats["approx_kl"][0].tolist() == [-20.0, 20.0, 0.0]
    assert all(torch.isfinite(v).all() for v in stats.values())
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, mask, clip_c=1.0)


def test_policy_loss_gradient_vanishes_when_clipped():
    logp = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2, 3.0)
    loss.sum().backward()
    # clipped token has no gradient; unclipped: d(-ratio)/dlogp = -ratio
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.1]]))


# ------------------------------------------------------------------------------------------------------------ KL
def test_kl_penalty_kinds():
    logp = torch.tensor([0.0, -1.0, -2.0, -50.0])
    ref = torch.tensor([-0.5, -1.0, -1.0, 0.0])
    d = [0.5, 0.0, -1.0, -50.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), torch.tensor(d))
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor(d))
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), torch.tensor([0.5 * x * x for x in d]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([abs(x) for x in d]))

    def k3(x):
        u = min(max(-x, -20.0), 20.0)
        return min(max(math.exp(u) - u - 1, -10.0), 10.0)

    got = kl_penalty(logp, ref, "low_var_kl")
    torch.testing.assert_close(got, torch.tensor([k3(x) for x in d]))
    assert got[1] == 0 and got[3] == 10.0  # zero at equality; clamped at 10 for a far-off token
    assert (got >= 0).all()
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(logp, ref, "full")


# --------------------------------------------------------------------------------------------------- aggregation
def test_masked_ops():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_sum(x, m).item() == 3.0
    assert masked_mean(x, m).item() == 1.5
    assert masked_mean(x, m, dim=-1).tolist() == [1.5, 0.0]


LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / (2 * 8)),
    ],
)
def test_agg_loss_single_rank_hand_values(mode, expected):
    tokens, seqs = local_batch_counts(MASK)
    assert (tokens, seqs) == (4.0, 2.0)
    got = agg_loss(LOSS, MASK, mode, global_tokens=tokens, global_seqs=seqs, dp_size=1, norm_const=8.0)
    assert got.item() == pytest.approx(expected)


def test_agg_loss_scales_by_dp_and_global_counts():
    # this rank holds row 0 of a mini batch with 10 tokens / 5 seqs over 2 ranks
    got = agg_loss(LOSS[:1], MASK[:1], "token-mean", global_tokens=10, global_seqs=5, dp_size=2)
    assert got.item() == pytest.approx(2 * 6 / 10)
    with pytest.raises(ValueError, match="norm_const"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_tokens=4, global_seqs=2, dp_size=1)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(LOSS, MASK, "sum", global_tokens=4, global_seqs=2, dp_size=1)


# ------------------------------------------------------------------------------ reference log-probs / entropy
def test_logprobs_and_entropy_reference():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1e9, -1e9]], dtype=torch.bfloat16)
    lp = logprobs_from_logits(logits, torch.tensor([2, 0]))
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, torch.tensor([math.log(0.25), math.log(0.75)]), rtol=1e-2, atol=1e-2)
    # masked-out vocab entries (-1e9) must not produce nan (0 * -inf)
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1e9, -1e9]]))
    torch.testing.assert_close(ent, torch.tensor([math.log(4.0), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]))


# ---------------------------------------------------------------------------- dp / micro-batch gradient identity
def _mini_batch(seed=0, B=8, T=6, V=11, H=5):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(B, T, H, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([1, 6, 3, 2, 5, 4, 6, 1])  # uneven so the modes differ
    mask = torch.arange(T)[None, :] < lengths[:, None]
    scores = torch.randint(0, 2, (B,), generator=g).float()
    adv = grpo_advantages(scores + 0.1 * torch.arange(B), torch.arange(B) // 4)
    old = -torch.rand(B, T, generator=g) * 3
    ref = -torch.rand(B, T, generator=g) * 3
    return feats, labels, mask, adv[:, None].expand(B, T), old, ref


def _grad(mode, splits, micro, model_seed=0):
    """Gradient of the toy model after processing the mini batch split over ranks (`splits`: rows per rank),
    each rank summing micro-batch contributions, then averaging over ranks as DDP does."""
    feats, labels, mask, adv, old, ref = _mini_batch()
    torch.manual_seed(model_seed)
    model = torch.nn.Linear(feats.shape[-1], 11)
    tokens, seqs = local_batch_counts(mask)  # global counts (an all-reduce in the real run)
    dp = len(splits)
    rank_grads = []
    start = 0
    for rows in splits:
        model.zero_grad()
        for m0 in range(start, start + rows, micro):
            sl = slice(m0, min(m0 + micro, start + rows))
            logp = logprobs_from_logits(model(feats[sl]), labels[sl])
            loss_mat, _ = policy_loss(logp, old[sl], adv[sl], mask[sl], 0.2, 0.28, 3.0)
            loss_mat = loss_mat + 0.1 * kl_penalty(logp, ref[sl], "low_var_kl")
            loss = agg_loss(loss_mat, mask[sl], mode, global_tokens=tokens, global_seqs=seqs, dp_size=dp,
                            norm_const=6.0)
            loss.backward()
        rank_grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters()]))
        start += rows
    return torch.stack(rank_grads).mean(0)


def _global_grad(mode):
    """The definition over the whole mini batch, computed directly."""
    feats, labels, mask, adv, old, ref = _mini_batch()
    torch.manual_seed(0)
    model = torch.nn.Linear(feats.shape[-1], 11)
    logp = logprobs_from_logits(model(feats), labels)
    loss_mat, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)
    loss_mat = (loss_mat + 0.1 * kl_penalty(logp, ref, "low_var_kl")) * mask
    m = mask.float()
    loss = {
        "token-mean": loss_mat.sum() / m.sum(),
        "seq-mean-token-sum": loss_mat.sum(-1).mean(),
        "seq-mean-token-mean": (loss_mat.sum(-1) / m.sum(-1)).mean(),
        "seq-mean-token-sum-norm": loss_mat.sum(-1).mean() / 6.0,
    }[mode]
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_identical_across_dp_and_micro_batches(mode):
    want = _global_grad(mode)
    assert want.abs().sum() > 0
    for splits, micro in [([8], 1), ([8], 4), ([4, 4], 1), ([4, 4], 4), ([6, 2], 2)]:
        torch.testing.assert_close(_grad(mode, splits, micro), want, rtol=1e-5, atol=1e-6,
                                   msg=f"{mode} splits={splits} micro={micro}")


def test_actor_loss_is_pg_plus_kl_minus_entropy_and_its_sums():
    from types import SimpleNamespace

    from qwen35rl.algo.core import ACTOR_SUMS, actor_loss, actor_metrics

    torch.manual_seed(0)
    logp = torch.randn(2, 5, requires_grad=True)
    old, ref, ent = torch.randn(2, 5), torch.randn(2, 5), torch.rand(2, 5, requires_grad=True)
    adv = torch.tensor([[1.0] * 5, [-2.0] * 5])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    algo = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, use_kl_loss=True,
                           kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01)
    agg = dict(mode="token-mean", global_tokens=6.0, global_seqs=2.0, dp_size=1, norm_const=None)
    loss, sums = actor_loss(logp, ent, old, ref, adv, mask, algo, agg)
    pg_mat, stats = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)
    pg = (pg_mat * mask).sum() / 6
    kl = (kl_penalty(logp, ref, "low_var_kl") * mask).sum() / 6
    en = (ent * mask).sum() / 6
    assert torch.allclose(loss, pg + 0.1 * kl - 0.01 * en)
    named = dict(zip(ACTOR_SUMS, sums.tolist()))
    assert named["tokens"] == 6 and named["nonfinite"] == 0
    assert abs(named["clipfrac"] - float((stats["clipfrac"] * mask).sum())) < 1e-6
    loss.backward()
    assert ent.grad is not None and float(ent.grad.abs().sum()) > 0  # entropy_coef != 0 trains through entropy
    m = actor_metrics(sums, dp_size=1)
    assert abs(m["actor/kl_loss"] - float(kl)) < 1e-6 and abs(m["actor/pg_loss"] - float(pg)) < 1e-6
    # no old log-probs: one on-policy update, ratio 1, nothing clipped
    _, sums = actor_loss(logp, ent, None, ref, adv, mask, algo, agg)
    assert dict(zip(ACTOR_SUMS, sums.tolist()))["clipfrac"] == 0


def test_on_policy_update_measures_the_rollout_gap_sum_and_max_over_micro_batches():
    """With the rollout engine's log-probs the update's pass yields |trainer - rollout| per response token: its sum
    adds over micro batches (a mean over the mini batch's tokens), its max takes the max; padding never counts."""
    from types import SimpleNamespace

    from qwen35rl.algo.core import ACTOR_SUMS, GAP_MAX, actor_loss, actor_metrics, add_actor_sums

    algo = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, use_kl_loss=False,
                           kl_loss_coef=0.0, kl_loss_type="low_var_kl", entropy_coef=0.0)
    agg = dict(mode="token-mean", global_tokens=5.0, global_seqs=2.0, dp_size=1, norm_const=None)
    logp = torch.full((2, 4), -1.0)
    rollout = torch.tensor([[-9.0, -1.5, -1.0, -0.9], [-1.25, -1.25, 5.0, 5.0]])  # padding positions differ most
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    adv, ent = torch.ones(2, 4), torch.zeros(2, 4)
    total = torch.zeros(GAP_MAX + 1, dtype=torch.float64)
    for rows in ([0], [1]):
        _, sums = actor_loss(logp[rows], ent[rows], None, None, adv[rows], mask[rows], algo, agg, rollout[rows])
        total = add_actor_sums(total, sums)
    named = dict(zip(ACTOR_SUMS, total.tolist()))
    assert named["tokens"] == 5 and abs(named["logprob_diff"] - (0.5 + 0 + 0.1 + 0.25 + 0.25)) < 1e-6
    m = actor_metrics(total, dp_size=1, rollout_gap=True)
    assert abs(m["rollout/logprob_diff_mean"] - 1.1 / 5) < 1e-6 and abs(m["rollout/logprob_diff_max"] - 0.5) < 1e-6
    _, sums = actor_loss(logp, ent, None, None, adv, mask, algo, agg)  # no rollout log-probs: nothing measured
    assert "rollout/logprob_diff_mean" not in actor_metrics(sums, 1) and float(sums[GAP_MAX]) == 0

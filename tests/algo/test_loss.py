"""The GRPO loss function the worker hands to the train engines: `core.actor_loss` under the algorithm settings,
aggregated over the mini batch the engine's scale describes, with its statistics folded and reduced as the engines
did before they took the loss from the caller."""
from types import SimpleNamespace

import pytest
import torch

from qwen35rl.algo.core import ACTOR_SUMS, GAP_MAX, actor_loss, actor_metrics, add_actor_sums
from qwen35rl.algo.loss import ActorLoss, LossInputs, LossScale

ALGO = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, use_kl_loss=True, kl_loss_coef=0.1,
                       kl_loss_type="low_var_kl", entropy_coef=0.01, loss_agg_mode="seq-mean-token-sum-norm",
                       loss_scale_factor=None)


def _inputs(seed=0, rollout=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    return LossInputs(log_probs=torch.randn(2, 5, generator=g, requires_grad=True),
                      entropy=torch.rand(2, 5, generator=g, requires_grad=True), mask=mask,
                      advantages=torch.tensor([[1.0] * 5, [-2.0] * 5]), old_log_probs=torch.randn(2, 5, generator=g),
                      ref_log_probs=torch.randn(2, 5, generator=g),
                      rollout_log_probs=torch.randn(2, 5, generator=g) if rollout else None)


def _direct(inputs, algo, **agg):
    return actor_loss(inputs.log_probs, inputs.entropy, inputs.old_log_probs, inputs.ref_log_probs, inputs.advantages,
                      inputs.mask, algo, dict(mode=algo.loss_agg_mode, **agg), inputs.rollout_log_probs)


@pytest.mark.parametrize("factor, scale_norm, divisor", [(None, None, 7.0), (4.0, None, 4.0), (4.0, 9.0, 9.0)])
def test_is_the_actor_loss_over_the_scales_mini_batch(factor, scale_norm, divisor):
    """seq-mean-token-sum-norm divides by the scale's divisor, else algorithm.loss_scale_factor, else the max
    response length."""
    algo = SimpleNamespace(**{**vars(ALGO), "loss_scale_factor": factor})
    inputs = _inputs(rollout=True)
    loss, stats = ActorLoss(algo, 7)(inputs, LossScale(global_tokens=6.0, global_seqs=4.0, dp_size=2,
                                                       norm_const=scale_norm))
    want_loss, want_stats = _direct(inputs, algo, global_tokens=6.0, global_seqs=4.0, dp_size=2, norm_const=divisor)
    assert torch.equal(loss, want_loss) and torch.equal(stats, want_stats)


def test_from_config_reads_algorithm_and_max_response_length():
    cfg = SimpleNamespace(algorithm=ALGO, data=SimpleNamespace(max_response_length=7))
    fn = ActorLoss.from_config(cfg)
    assert fn.algo is ALGO and fn.max_response_length == 7


def test_statistics_fold_reduce_and_name_as_the_engines_did():
    fn = ActorLoss(ALGO, 7)
    scale = LossScale(global_tokens=12.0, global_seqs=4.0, dp_size=2)
    parts = [fn(_inputs(seed, rollout=True), scale)[1] for seed in (0, 1)]
    total = fn.zeros("cpu")
    assert total.shape == (GAP_MAX + 1,) and total.dtype == torch.float64 and not total.any()
    for part in parts:
        total = fn.combine(total, part)
    assert torch.equal(total, add_actor_sums(add_actor_sums(torch.zeros(GAP_MAX + 1, dtype=torch.float64), parts[0]),
                                             parts[1]))
    # over two data-parallel ranks holding the same statistics: sums double, the gap's max stays this rank's
    reduced = fn.reduce(total, lambda t: 2 * t)
    assert torch.equal(reduced[:GAP_MAX], 2 * total[:GAP_MAX]) and torch.equal(reduced[GAP_MAX:], total[GAP_MAX:])
    assert fn.metrics(reduced, 2, rollout_gap=True) == actor_metrics(reduced, 2, rollout_gap=True)
    assert set(fn.metrics(reduced, 2, rollout_gap=False)) == {
        "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert not fn.nonfinite(reduced)


def test_a_non_finite_loss_is_reported():
    fn = ActorLoss(ALGO, 7)
    inputs = _inputs()
    inputs.advantages = torch.full_like(inputs.advantages, float("nan"))
    loss, stats = fn(inputs, LossScale(global_tokens=6.0, global_seqs=2.0, dp_size=1))
    assert not torch.isfinite(loss) and fn.nonfinite(fn.combine(fn.zeros("cpu"), stats))
    assert dict(zip(ACTOR_SUMS, stats.tolist()))["nonfinite"] == 1

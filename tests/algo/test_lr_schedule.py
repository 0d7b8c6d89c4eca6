"""The learning-rate schedule the engines follow, built from the backend settings: the values and errors the FSDP
engine's own schedule had."""
from types import SimpleNamespace

import pytest

from qwen35rl.algo.lr_schedule import from_backend
from qwen35rl.config.compose import compose


def _backend(warmup, scheduler, min_lr_ratio=0.0):
    return SimpleNamespace(lr_warmup_steps=warmup, lr_scheduler=scheduler, min_lr_ratio=min_lr_ratio)


@pytest.mark.parametrize("backend, total, expected", [
    (_backend(3, "constant"), None, [1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1]),
    (_backend(0, "constant"), None, [1.0] * 8),
    (_backend(2, "cosine", 0.1), 6, [0.5, 1, 1, 0.868198051534, 0.55, 0.231801948466, 0.1, 0.1]),
    (_backend(0, "cosine"), 4, [1, 0.853553390593, 0.5, 0.146446609407, 0, 0, 0, 0]),
])
def test_factors_per_optimizer_step(backend, total, expected):
    schedule = from_backend(backend, total)
    assert [schedule(step) for step in range(8)] == pytest.approx(expected, abs=1e-12)


def test_reads_the_run_configs_backend():
    cfg = compose(["backend.lr_warmup_steps=2", "backend.lr_scheduler=cosine", "backend.min_lr_ratio=0.1"])
    schedule = from_backend(cfg.backend, 6)
    assert [schedule(step) for step in (0, 4, 9)] == pytest.approx([0.5, 0.55, 0.1])


@pytest.mark.parametrize("scheduler, total, message", [
    ("linear", 10, "backend.lr_scheduler='linear': expected constant or cosine"),
    ("cosine", None, "backend.lr_scheduler=cosine needs the total number of optimizer steps"),
    ("cosine", 0, "backend.lr_scheduler=cosine needs the total number of optimizer steps"),
])
def test_refusals_name_the_setting(scheduler, total, message):
    with pytest.raises(ValueError) as err:
        from_backend(_backend(0, scheduler), total)
    assert str(err.value) == message

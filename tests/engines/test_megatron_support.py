"""What the Megatron engine builds of a plan-valid config: with Transformer Engine installed (a stand-in here, the
normal GPU image) and the MoE reference runs' TE options on, it builds the local specs (experts as SequentialMLP),
says which options it does not apply, and trains; context parallelism is refused with the plan's problem code;
remove_padding is a warning with the plan's wording. Real megatron-core on CPU over gloo."""
from tests.megatron_cpu import CPU_TRANSFORMER_OVERRIDES, megatron_on_cpu  # first: the prelude (skips without megatron)

import logging
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from qwen35rl.config import capabilities
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.runtime.cluster import free_port
from tests.engines.test_megatron_engine_cpu import _batch, _loss
from tests.shared_results import result_dict

pytestmark = pytest.mark.slow

TE_OPTIONS = ["backend.moe_grouped_gemm=true", "backend.moe_permute_fusion=true",
              "backend.use_precision_aware_optimizer=true"]


def _config(*overrides):
    cfg = compose(["model=qwen3_5_tiny_moe", "backend=megatron", "hw=cpu", "backend.bf16=false",
                   "backend.optimizer_cpu_offload=false", "backend.gradient_checkpointing=false",
                   "backend.moe_z_loss_coeff=0", "backend.moe_aux_loss_coeff=0", *overrides])
    OmegaConf.set_readonly(cfg, False)
    OmegaConf.set_struct(cfg, False)
    cfg.backend.transformer_overrides = dict(CPU_TRANSFORMER_OVERRIDES)
    return cfg


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _with_te() -> None:
    from tests.engines import te_standin

    te_standin.install()  # before megatron is imported
    megatron_on_cpu()
    # the declaration sees Transformer Engine on CUDA devices only: this CPU process stands in for a GPU node's
    capabilities.Stack.installed = classmethod(lambda cls, device: cls(device=device, transformer_engine=True, fla=True))


def _te_worker(rank, world, port, cfg, out):
    _with_te()
    lines = _Lines()
    logging.getLogger("qwen35rl").addHandler(lines)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from megatron.core.optimizer import Adam
        from megatron.core.transformer.moe.experts import SequentialMLP
        from megatron.core.utils import is_te_min_version

        from qwen35rl.engines.megatron.engine import MegatronTrainEngine

        eng = MegatronTrainEngine(cfg, layout=derive_layout(cfg), rank=rank, world_size=world, device="cpu",
                                  total_steps=10)
        batch = _batch(cfg)
        batch.ref_log_probs = batch.old_log_probs
        metrics = eng.train_mini_batch([batch], _loss(eng))
        out[rank] = {
            "te_seen": is_te_min_version("2.1.0") and Adam.__module__ == "tests.engines.te_standin",
            "options": (eng.tconfig.moe_grouped_gemm, eng.tconfig.moe_permute_fusion, eng.te),
            "experts": {type(m).__name__ for c in eng.chunks for m in c.modules() if isinstance(m, SequentialMLP)},
            "loss": metrics["actor/pg_loss"], "skipped": metrics["actor/skipped_steps"],
            "warnings": lines.lines,
        }
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_with_transformer_engine_the_te_options_fall_back_and_the_engine_trains():
    cfg = _config("parallelism.ep=2", *TE_OPTIONS)
    out = result_dict()
    mp.start_processes(_te_worker, args=(2, free_port(), cfg, out), nprocs=2, join=True, start_method="spawn")
    te_node = capabilities.Stack(device="cuda", transformer_engine=True, fla=True)
    planned = [p for p in capabilities.problems(cfg, derive_layout(cfg), te_node) if p.key.startswith("backend.")]
    for rank, res in dict(out).items():
        assert res["te_seen"], "megatron-core did not take the stand-in for Transformer Engine"
        grouped, permute, te = res["options"]
        assert not grouped and not permute and not te.use_precision_aware_optimizer
        assert res["experts"] == {"SequentialMLP"}
        assert res["skipped"] == 0 and res["loss"] == res["loss"]  # a step was applied, its loss is finite
        text = "\n".join(res["warnings"])
        for p in planned:  # the plan's warnings, word for word, with their codes
            assert f"{p.message} [{p.code}]" in text
        assert {p.code for p in planned} >= {"megatron_grouped_gemm", "megatron_precision_aware_optimizer"}
        assert "SequentialMLP" in text
        assert "backend.moe_permute_fusion=true is accepted but not applied" in text and "TE >= 2.1" in text


def _te_checkpoint_worker(rank, world, port, cfg, batch, path, out):
    _with_te()
    from tests.engines.test_megatron_engine_cpu import _checkpoint_worker

    _checkpoint_worker(rank, world, port, cfg, batch, path, out)


def test_with_transformer_engine_a_resume_restores_fused_adams_step_count(tmp_path):
    """TE's FusedAdam counts steps in its param groups: the resumed step's bias correction must match."""
    from tests.engines.test_megatron_engine_cpu import _config as engine_config

    cfg = engine_config("qwen3_5_tiny_moe", ["parallelism.ep=2", "backend.lr_warmup_steps=3", *TE_OPTIONS])
    out = result_dict()
    mp.start_processes(_te_checkpoint_worker, args=(2, free_port(), cfg, _batch(cfg), str(tmp_path / "ckpt"), out),
                       nprocs=2, join=True, start_method="spawn")
    for rank, (expected, resumed, steps, weight_diff) in dict(out).items():
        assert steps == 2
        assert resumed == pytest.approx(expected, rel=1e-6), rank
        assert weight_diff < 1e-7


def _refusal_worker(_, cfg, out):
    """Constructs rank 0 of 2: the refusal comes before the engine touches a process group."""
    from qwen35rl.engines.megatron.engine import MegatronTrainEngine

    try:
        MegatronTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=2, device="cpu")
        out[0] = None
    except capabilities.Unsupported as e:
        out[0] = [(p.code, p.key, p.message) for p in e.problems]


def test_context_parallel_is_refused_with_the_plans_problem():
    cfg = _config("parallelism.cp=2", "backend.megatron_core_version=0.18.0")
    out = result_dict()
    mp.start_processes(_refusal_worker, args=(cfg, out), nprocs=1, join=True, start_method="spawn")
    planned = [(p.code, p.key, p.message) for p in capabilities.problems(cfg, derive_layout(cfg))
               if p.severity == capabilities.REFUSED]
    assert [code for code, _, _ in planned] == ["megatron_context_parallel"]
    assert out[0] == planned


def test_remove_padding_is_a_warning_with_the_plans_wording(caplog, monkeypatch):
    """The engine's check on its own, in this process (megatron-core stays unimported here)."""
    import torch

    from qwen35rl.engines.megatron import support

    monkeypatch.setattr(support, "_import_megatron", lambda: None)

    cfg = _config("backend.remove_padding=true")
    layout = derive_layout(cfg)
    with caplog.at_level(logging.WARNING, logger="qwen35rl.engines.megatron.support"):
        support.check_stack(cfg, layout, torch.device("cpu"))
    planned = [p for p in capabilities.problems(cfg, layout) if p.key == "backend.remove_padding"]
    assert [p.severity for p in planned] == [capabilities.NOT_APPLIED]
    assert f"{planned[0].message} [{planned[0].code}]" in [r.getMessage() for r in caplog.records]

"""megatron-core version facts and the Ascend (MindSpeed) adaptation of the Megatron backend, on CPU: the quirk
mapping, the import order and the errors that name what to install."""
import os
import sys
import types

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config import megatron_versions as version
from qwen35rl.engines.megatron import ascend


# ------------------------------------------------------------------------------------------------- versions
def test_gdn_packing_and_cp_start_at_0_18():
    old, new = version.capabilities("0.16.1", has_te=True), version.capabilities("0.19.2", has_te=True)
    assert not old.gdn_packed_sequences and not old.gdn_context_parallel
    assert new.gdn_packed_sequences and new.gdn_context_parallel
    assert version.capabilities("0.18.0rc1", has_te=True).packed_sequences
    # packed input and CP also need TE attention (the local attention takes neither)
    assert not version.capabilities("0.19.2", has_te=False).packed_sequences
    assert not version.capabilities("0.19.2", has_te=False).context_parallel


def test_check_layout_names_the_reason():
    with pytest.raises(RuntimeError, match=r"0\.16\.1's Gated DeltaNet has no context parallelism.*from 0\.18\.0"):
        version.capabilities("0.16.1", has_te=True).check_layout(cp=2, packed=False)
    with pytest.raises(RuntimeError, match=">= 0.18"):
        version.capabilities("0.17.0", has_te=True).check_layout(cp=1, packed=True)
    with pytest.raises(RuntimeError, match="Transformer Engine"):
        version.capabilities("0.19.2", has_te=False).check_layout(cp=2, packed=False)
    version.capabilities("0.16.1", has_te=False).check_layout(cp=1, packed=False)
    # before 0.19, experts with EP=1 and ETP != TP miss the gradient sum over TP ranks
    with pytest.raises(RuntimeError, match="set parallelism.etp=2"):
        version.capabilities("0.16.1", has_te=False).check_layout(cp=1, packed=False, tp=2, ep=1, etp=1, moe=True)
    version.capabilities("0.16.1", has_te=False).check_layout(cp=1, packed=False, tp=2, ep=2, etp=1, moe=True)
    version.capabilities("0.19.2", has_te=False).check_layout(cp=1, packed=False, tp=2, ep=1, etp=1, moe=True)


def test_missing_or_old_megatron_names_the_install(monkeypatch):
    monkeypatch.setattr(version, "installed", lambda: None)
    with pytest.raises(ImportError, match=r"pip install 'qwen35rl\[gpu\]'"):
        version.capabilities()
    with pytest.raises(ImportError, match="older than 0.16"):
        version.capabilities("0.15.3")


# --------------------------------------------------------------------------------------------------- ascend
@pytest.fixture(scope="module")
def npu_hw():
    return compose(["hw=a3_1node", "backend=megatron"]).hw


def test_npu_quirks_map_onto_mindspeed_and_transformer_config(npu_hw):
    s = ascend.quirk_settings(npu_hw.megatron_quirks)
    assert s.mindspeed == {"use_flash_attn": True, "use_naive_l2norm": True, "moe_token_dispatcher_type": "alltoall"}
    # Ascend GDN kernels on: MindSpeed's GDN, not megatron-core's torch recurrence
    assert s.transformer == {"moe_token_dispatcher_type": "alltoall", "deterministic_mode": False}
    assert s.megatron_core_attention and s.strict_load


def test_quirk_variants_and_refusals():
    s = ascend.quirk_settings({"use_ascend_gdn_kernels": False, "use_flash_attn": False, "strict_load": False})
    assert s.transformer == {"deterministic_mode": True} and not s.megatron_core_attention and not s.strict_load
    assert ascend.quirk_settings(None) == ascend.AscendSettings()
    with pytest.raises(ValueError, match="unknown.*use_flash_atn"):
        ascend.quirk_settings({"use_flash_atn": True})
    with pytest.raises(ValueError, match="hf_bridge=false"):
        ascend.quirk_settings({"hf_bridge": False})
    with pytest.raises(ValueError, match="expected alltoall"):
        ascend.quirk_settings({"moe_token_dispatcher_type": "all2all"})


def test_missing_ascend_stack_names_the_install(npu_hw):
    with pytest.raises(ImportError, match="torch_npu and mindspeed.*MindSpeed"):
        ascend.require_ascend_stack(lambda name: None)
    with pytest.raises(ImportError, match="mindspeed"):
        ascend.require_ascend_stack(lambda name: object() if name == "torch_npu" else None)
    if importlib_missing("torch_npu"):  # this machine: no Ascend stack, the real check must refuse
        with pytest.raises(ImportError, match="torch_npu"):
            ascend.prepare_platform(npu_hw, {"tensor_model_parallel_size": 1})


def importlib_missing(name):
    import importlib.util

    return importlib.util.find_spec(name) is None


def test_cpu_and_gpu_platforms_need_no_adaptation():
    cfg = compose(["hw=cpu", "backend=megatron"])
    assert ascend.prepare_platform(cfg.hw, {}) == ascend.AscendSettings()


def test_mindspeed_is_imported_with_an_empty_command_line_then_repatched(monkeypatch):
    seen = {}

    def fake_import(name):
        seen["name"], seen["argv"] = name, list(sys.argv)
        return types.SimpleNamespace(repatch=lambda d: seen.setdefault("repatch", d))

    monkeypatch.setattr(sys, "argv", ["prog", "--some", "flag"])
    monkeypatch.delitem(sys.modules, "megatron.core", raising=False)
    settings = ascend.quirk_settings({"use_flash_attn": True, "gdn_naive_l2norm": True})
    ascend.adapt_megatron(settings, {"tensor_model_parallel_size": 2}, import_module=fake_import,
                          find_spec=lambda name: object())
    assert seen["name"] == "mindspeed.megatron_adaptor" and seen["argv"] == ["prog"]
    assert sys.argv == ["prog", "--some", "flag"]
    assert seen["repatch"] == {"tensor_model_parallel_size": 2, "use_flash_attn": True, "use_naive_l2norm": True,
                               "experimental_attention_variant": "gated_delta_net"}


def test_megatron_imported_first_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    monkeypatch.delitem(sys.modules, "mindspeed.megatron_adaptor", raising=False)
    with pytest.raises(RuntimeError, match="imported before MindSpeed"):
        ascend.adapt_megatron(ascend.AscendSettings(), {}, import_module=lambda n: None, find_spec=lambda n: object())


@pytest.mark.skipif(not importlib_missing("megatron"), reason="megatron-core is installed here")
def test_engine_without_megatron_names_the_install():
    from qwen35rl.engines.megatron.engine import MegatronTrainEngine

    from qwen35rl.config.layout import derive_layout

    cfg = compose(["model=qwen3_5_tiny", "backend=megatron", "hw=cpu"])
    with pytest.raises(ImportError, match=r"pip install 'qwen35rl\[gpu\]'"):
        MegatronTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")


def test_hw_mindspeed_switches_reach_repatch():
    """hw.mindspeed (MindSpeed switches imported from verl's NPU scripts) is added to what the quirks derive."""
    settings = ascend.with_switches(ascend.quirk_settings({"gdn_naive_l2norm": True}),
                                    {"use_fused_rmsnorm": True, "context_parallel_algo": "kvallgather_cp_algo"})
    assert settings.mindspeed == {"use_naive_l2norm": True, "use_fused_rmsnorm": True,
                                  "context_parallel_algo": "kvallgather_cp_algo"}
    assert ascend.with_switches(settings, None) is settings

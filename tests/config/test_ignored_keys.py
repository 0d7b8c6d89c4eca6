"""Settings an engine accepts but does not apply: named with the reason, per engine."""
from qwen35rl.config.compose import compose
from qwen35rl.config.ignored_keys import ignored_settings


def _keys(*overrides):
    return [key for key, _ in ignored_settings(compose(list(overrides)).backend)]


def test_megatron_reference_settings_it_does_not_apply():
    # the reference runs' megatron backend turns every offload between phases on; the engine does none of them
    assert _keys("backend=megatron") == ["backend.param_offload", "backend.grad_offload", "backend.optimizer_offload"]
    assert "backend.use_torch_compile" in _keys("backend=megatron", "backend.use_torch_compile=true")
    assert _keys("backend=megatron", "backend.param_offload=false", "backend.grad_offload=false",
                 "backend.optimizer_offload=false") == []


def test_fsdp_applies_its_defaults_and_names_unchunked_entropy():
    assert _keys("backend=fsdp") == []
    (reason,) = [why for key, why in ignored_settings(
        compose(["backend=fsdp", "backend.entropy_from_logits_with_chunking=false"]).backend)]
    assert "backend.logprob_chunk_size" in reason

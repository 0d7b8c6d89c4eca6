"""Settings an engine accepts but does not apply: named with the reason, per engine."""
from qwen35rl.config.compose import compose
from qwen35rl.config.ignored_keys import ignored_settings


def _keys(*overrides):
    return [key for key, _ in ignored_settings(compose(list(overrides)).backend)]


def test_megatron_applies_its_reference_settings_and_names_the_rest():
    assert _keys("backend=megatron") == []  # the reference runs' offloads between phases are applied
    assert _keys("backend=megatron", "backend.use_torch_compile=true", "backend.use_dist_checkpointing=true") == [
        "backend.use_torch_compile", "backend.use_dist_checkpointing"]


def test_fsdp_applies_its_defaults_and_names_unchunked_entropy():
    assert _keys("backend=fsdp") == []
    (reason,) = [why for key, why in ignored_settings(
        compose(["backend=fsdp", "backend.entropy_from_logits_with_chunking=false"]).backend)]
    assert "backend.logprob_chunk_size" in reason

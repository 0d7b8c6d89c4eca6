"""Bytes one megatron-core decoder layer (the Megatron engine's layer specs, bf16) saves for backward per token,
counted with `torch.autograd.graph.saved_tensors_hooks` over one forward (deduplicated by storage; the parameters
and the rotary table left out), as the slope between two sequence lengths.

Run as a script in its own process (`python -m tests.config.megatron_saved_bytes SPECS_JSON`): it installs
megatron's CPU stand-ins, which change torch for the whole process. SPECS_JSON is a list of
{"overrides": [...], "kind": "linear_attention" | "full_attention"}; it prints one JSON list of bytes per token."""
import dataclasses
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

LENGTHS = (128, 256)
"""Two multiples of the GDN chunk (64): the slope between them is free of padding and per-sequence constants."""


def saved_bytes(fn, exclude):
    seen, skip = {}, {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def layer_bytes_per_token(overrides, kind):
    from qwen35rl.config.compose import compose
    from qwen35rl.engines.megatron import mapping as mp, model as mm

    cfg = compose(list(overrides))
    shape = dataclasses.replace(mp.Qwen35Shape.from_model_config(cfg.model), num_layers=1, layer_types=(kind,),
                                vocab_size=256)
    config = mm.transformer_config(cfg.model, shape, tp=1, pp=1, ep=1, etp=1, dtype=torch.bfloat16,
                                   overrides=dict(use_cpu_initialization=True, deterministic_mode=True))
    torch.manual_seed(0)
    model = mm.build_chunks(config, cfg.model, shape)[0]
    layer, counted = model.decoder.layers[0], []
    for s in LENGTHS:
        x = torch.randn(s, 1, shape.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        rope = model.rotary_pos_emb(s)
        n, out = saved_bytes(lambda: layer(x, attention_mask=None, rotary_pos_emb=rope), [*model.parameters(), rope])
        assert out is not None
        counted.append(n)
    return (counted[1] - counted[0]) / (LENGTHS[1] - LENGTHS[0])


def main(specs):
    torch.set_num_threads(1)
    from qwen35rl.engines.megatron import cpu

    cpu.install()
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from qwen35rl.runtime.cluster import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        return [layer_bytes_per_token(s["overrides"], s["kind"]) for s in specs]
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))

"""What one decode step of the hf rollout runs: the aten ops of the decoder + lm_head call that
`HfRolloutEngine._decode` captures as a CUDA graph, counted per model component, and of those the ops that launch
a device kernel (views and other metadata ops do not). The op sequence depends on the architecture and the code
path, not on the device, so a CPU run counts what a GPU step launches, except where a package swaps a torch
function for its kernel: with flash-linear-attention the GDN recurrence is one fused kernel (counted apart below);
the short convolution's update stays torch code without causal-conv1d.

  OMP_NUM_THREADS=1 python bench/decode_ops_cpu.py [--model qwen3_5_0_8b] [--rows 4]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# ops that only make a new view of existing memory (no kernel on a GPU)
VIEW_OPS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "slice", "select", "expand", "permute",
            "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow", "reshape",
            "empty", "empty_like", "lift_fresh", "_reshape_alias", "view_as"}
COMPONENTS = ("Qwen3_5GatedDeltaNet", "Qwen3_5Attention", "Qwen3_5MLP", "Qwen3_5RMSNormGated", "Qwen3_5RMSNorm",
              "Qwen3_5TextRotaryEmbedding")
RECURRENCE = "GDN recurrence (fla: one fused kernel)"
CONV_UPDATE = "GDN conv update (torch without causal-conv1d)"


def count_step(model_name: str, rows: int, prompt: int = 8) -> Dict[str, Any]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import StaticCache

    from qwen35rl.config.compose import compose
    from qwen35rl.engines.hf_rollout import cache_argument
    from qwen35rl.engines.packed_gdn import modeling_modules
    from qwen35rl.models.build import build_model

    cfg = compose([f"model={model_name}", "model.init=random", "model.tokenizer=byte", "hw=cpu"])
    model = build_model(cfg.model, dtype=torch.bfloat16).eval()
    decoder, lm_head = model.get_decoder(), model.lm_head
    where: List[str] = []

    for module in decoder.modules():
        name = type(module).__name__
        if name in COMPONENTS:
            module.register_forward_pre_hook(lambda m, a, name=name: where.append(name))
            module.register_forward_hook(lambda m, a, o: (where.pop(), None)[1])

    def labelled(fn, label):
        def run(*args, **kwargs):
            where.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                where.pop()
        return run

    modeling = modeling_modules()[0]
    saved = {n: getattr(modeling, n) for n in ("torch_recurrent_gated_delta_rule", "causal_conv1d_update")}
    modeling.torch_recurrent_gated_delta_rule = labelled(saved["torch_recurrent_gated_delta_rule"], RECURRENCE)
    modeling.causal_conv1d_update = labelled(saved["causal_conv1d_update"], CONV_UPDATE)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[(where[-1] if where else "model (embedding, residuals, lm_head)",
                      func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    try:
        with torch.no_grad():
            total = prompt + 4
            cache = {cache_argument(decoder): StaticCache(config=model.config, max_cache_len=total)}
            keys = torch.ones((rows, 1, 1, total), dtype=torch.bool)
            ids = torch.randint(0, 200, (rows, prompt))
            decoder(input_ids=ids, position_ids=torch.arange(prompt)[None].expand(rows, -1), use_cache=True, **cache,
                    attention_mask={"full_attention": None, "linear_attention": None})
            step_ids, step_pos = torch.zeros((rows, 1), dtype=torch.long), torch.full((rows, 1), prompt)
            with Count() as counter:  # the step HfRolloutEngine captures: decoder call, then lm_head
                h = decoder(input_ids=step_ids, position_ids=step_pos, use_cache=True, **cache,
                            attention_mask={"full_attention": keys, "linear_attention": None}).last_hidden_state
                lm_head(h)[:, -1]
    finally:
        for n, fn in saved.items():
            setattr(modeling, n, fn)

    by_part: Dict[str, Dict[str, int]] = collections.defaultdict(lambda: {"ops": 0, "kernel_ops": 0})
    for (part, op), n in counter.ops.items():
        by_part[part]["ops"] += n
        by_part[part]["kernel_ops"] += 0 if op in VIEW_OPS else n
    layers = int(cfg.model.num_hidden_layers)
    kernel_total = sum(v["kernel_ops"] for v in by_part.values())
    with_fla = kernel_total - by_part.get(RECURRENCE, {}).get("kernel_ops", 0)
    return {"model": model_name, "layers": layers, "rows": rows, "parts": dict(by_part),
            "ops": sum(v["ops"] for v in by_part.values()), "kernel_ops": kernel_total,
            "kernel_ops_with_fla_recurrence": with_fla,
            "top_kernel_ops": [(part, op, n) for (part, op), n in counter.ops.most_common()
                               if op not in VIEW_OPS][:15]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_5_0_8b")
    ap.add_argument("--rows", type=int, default=4)
    args = ap.parse_args(argv)
    r = count_step(args.model, args.rows)
    print(f"{r['model']}, {r['layers']} layers, {r['rows']} rows: {r['ops']} aten ops per decode step, "
          f"{r['kernel_ops']} of them launch kernels; with fla's fused recurrence "
          f"{r['kernel_ops_with_fla_recurrence']} kernel ops (plus one fused kernel per GDN layer)")
    print("| part | aten ops | kernel ops |\n| --- | ---: | ---: |")
    for part, v in sorted(r["parts"].items(), key=lambda kv: -kv[1]["kernel_ops"]):
        print(f"| {part} | {v['ops']} | {v['kernel_ops']} |")
    print("most frequent kernel ops:", ", ".join(f"{p}/{o} x{n}" for p, o, n in r["top_kernel_ops"]))


if __name__ == "__main__":
    main()

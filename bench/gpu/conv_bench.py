"""The GDN short convolution alone, on one packed row of the 0.8B model's shape (bf16): transformers' depthwise
`F.conv1d` fallback against `short_conv` eager and compiled (whole output, and split into q, k, v), forward and
forward + backward, ms per call by CUDA events after warm-up.

    python bench/gpu/conv_bench.py [--tokens 12288] [--channels 6144] [--out conv.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch
    import torch.nn.functional as F

    from qwen35rl.engines.packed_gdn import _build_positions
    from qwen35rl.engines.short_conv import short_causal_conv

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=12288)
    p.add_argument("--channels", type=int, default=6144)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    args = p.parse_args()
    dev, width, t, d = "cuda", 4, args.tokens, args.channels
    x = torch.randn(1, t, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(d, width, device=dev, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.linspace(0, t, args.docs + 1, device=dev).long()
    pos = _build_positions(cu, t, x.device)
    third = d // 3
    splits = (third, third, d - 2 * third)

    def conv1d():
        y = F.conv1d(x.transpose(1, 2), w.unsqueeze(1), None, padding=width - 1, groups=d)[..., :t]
        return F.silu(y).transpose(1, 2)

    cases = {
        "F.conv1d (transformers' fallback)": conv1d,
        "short_conv eager": lambda: short_causal_conv(x, w, None, pos, "silu"),
        "short_conv compiled": lambda: short_causal_conv(x, w, None, pos, "silu", compiled=True),
        "short_conv compiled, split q/k/v": lambda: short_causal_conv(x, w, None, pos, "silu", compiled=True,
                                                                       splits=splits),
    }

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / args.reps

    def fwd_bwd(fn):
        def run():
            out = fn()
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return run

    results = {"tokens": t, "channels": d, "docs": args.docs, "bytes_per_pass_mb": t * d * 2 / 2**20}
    # compiled against eager on these rows: output and gradients (max |difference| over max |value|)
    dy = torch.randn(1, t, d, device=dev, dtype=torch.bfloat16)
    gaps = {}
    ref = short_causal_conv(x, w, None, pos, "silu")
    ref_grads = torch.autograd.grad(ref, (x, w), dy)
    for name, split in (("whole", None), ("split", splits)):
        out = short_causal_conv(x, w, None, pos, "silu", compiled=True, splits=split)
        outs = out if isinstance(out, tuple) else (out,)
        got = torch.cat(outs, -1)
        grads = torch.autograd.grad(outs, (x, w), torch.split(dy, list(split or (d,)), -1))
        gaps[name] = [float((a.float() - b.float()).abs().max() / b.float().abs().max())
                      for a, b in zip((got, *grads), (ref, *ref_grads))]
    results["compiled_vs_eager_rel_gap"] = gaps
    print("conv bench | compiled against eager, relative max gap (y, dx, dw):", json.dumps(gaps), flush=True)
    for name, fn in cases.items():
        with torch.no_grad():
            f = timed(fn)
        fb = timed(fwd_bwd(fn))
        results[name] = {"forward_ms": round(f, 3), "forward_backward_ms": round(fb, 3)}
        print(f"conv bench | {name} | forward {f:.3f} ms | forward + backward {fb:.3f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""What holds the device memory at a phase's peak: torch.cuda's allocator history over one call, replayed.

    with recording() as rec:
        worker.update_actor(...)
    report = rec.summary()          # {"baseline_gib", "peak_gib", "groups": [...]} and rec.text()

The history has every allocation and free after recording starts, each with the Python stack that made it. The
replay walks the events in order, keeps the live set, and at the highest point groups the live blocks by where
they were allocated (the innermost frame in qwen35rl, megatron, fla or transformers; the caller in qwen35rl beside
it). What was allocated before recording (weights, optimizer states, gradient buffers) is the baseline.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

GIB = 2 ** 30
OWN = ("/qwen35rl/", "/megatron/", "/fla/", "/transformers/", "/bench/")
"""Path parts of frames worth naming (innermost first); torch's own frames are where every allocation happens."""


def _frame(frames: Sequence[Dict[str, Any]], parts: Sequence[str]) -> str:
    for f in frames:
        name = str(f.get("filename", ""))
        for part in parts:
            if part in name:
                return f"{part.strip('/')}/{name.rsplit(part, 1)[1]}:{f.get('line')} {f.get('name')}"
    return "(no frame)"


def replay(trace: Sequence[Dict[str, Any]], baseline: int = 0) -> Tuple[int, List[Dict[str, Any]]]:
    """The highest allocated total over `trace` (baseline + live blocks) and the live blocks then. Allocated bytes
    drop at `free_requested` (the block goes back to the allocator's pool; `free_completed` follows once its
    streams are done with it). A trace cut by the history's ring buffer starts late: its first frees are of blocks
    it never saw allocated, counted as the baseline's."""
    live: Dict[int, Dict[str, Any]] = {}
    total = peak = baseline
    at_peak: List[Dict[str, Any]] = []
    for ev in trace:
        action, addr, size = ev.get("action"), ev.get("addr"), int(ev.get("size", 0))
        if action == "alloc":
            live[addr] = ev
            total += size
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif action == "free_requested":  # a block of the baseline when not seen allocated
            total -= int(live.pop(addr).get("size", 0)) if addr in live else size
    return peak, at_peak


def group(blocks: Sequence[Dict[str, Any]], top: int = 25) -> List[Dict[str, Any]]:
    """Live blocks grouped by (allocating frame, qwen35rl caller), largest first."""
    sums: Dict[Tuple[str, str], List[int]] = {}
    for b in blocks:
        frames = b.get("frames") or []
        key = (_frame(frames, OWN), _frame(frames, ("/qwen35rl/",)))
        entry = sums.setdefault(key, [0, 0])
        entry[0] += int(b.get("size", 0))
        entry[1] += 1
    rows = [{"where": k[0], "caller": k[1], "gib": v[0] / GIB, "blocks": v[1]} for k, v in sums.items()]
    return sorted(rows, key=lambda r: -r["gib"])[:top]


STEP = ("/optimizer/", "/torch/optim/")
"""Frames of the optimizer step: the passes before it are replayed apart (the step's temporaries can hide the
backward's peak)."""


def before_step(trace: Sequence[Dict[str, Any]]) -> Sequence[Dict[str, Any]]:
    """The events before the first allocation made under the optimizer step (all of them when there is none)."""
    for i, ev in enumerate(trace):
        if ev.get("action") == "alloc" and any(part in str(f.get("filename", "")) for f in ev.get("frames") or []
                                               for part in STEP):
            return trace[:i]
    return trace


def summarize(snapshot: Dict[str, Any], baseline: int, device: int = 0, top: int = 25) -> Dict[str, Any]:
    traces = snapshot.get("device_traces") or [[]]
    trace = traces[device] if device < len(traces) else []
    peak, blocks = replay(trace, baseline)
    out = {"baseline_gib": baseline / GIB, "peak_gib": peak / GIB, "events": len(trace),
           "live_at_peak_gib": (peak - baseline) / GIB, "groups": group(blocks, top)}
    passes = before_step(trace)
    if len(passes) < len(trace):
        pass_peak, pass_blocks = replay(passes, baseline)
        out["before_step"] = {"peak_gib": pass_peak / GIB, "live_at_peak_gib": (pass_peak - baseline) / GIB,
                              "groups": group(pass_blocks, top)}
    return out


def text(summary: Dict[str, Any]) -> str:
    lines = [f"peak {summary['peak_gib']:.2f} GiB = baseline {summary['baseline_gib']:.2f} (before recording) + "
             f"{summary['live_at_peak_gib']:.2f} allocated during it ({summary['events']} events)"]
    lines += [f"{r['gib']:8.3f} GiB {r['blocks']:6d}  {r['where']}  <- {r['caller']}" for r in summary["groups"]]
    passes = summary.get("before_step")
    if passes:
        lines.append(f"before the optimizer step: peak {passes['peak_gib']:.2f} GiB = baseline + "
                     f"{passes['live_at_peak_gib']:.2f}")
        lines += [f"{r['gib']:8.3f} GiB {r['blocks']:6d}  {r['where']}  <- {r['caller']}" for r in passes["groups"]]
    return "\n".join(lines)


class Recording:
    def __init__(self):
        self.snapshot: Optional[Dict[str, Any]] = None
        self.baseline = 0

    def summary(self, top: int = 25) -> Dict[str, Any]:
        return summarize(self.snapshot or {}, self.baseline, top=top)

    def text(self, top: int = 25) -> str:
        return text(self.summary(top))


@contextlib.contextmanager
def recording(max_entries: int = 2_000_000) -> Iterator[Recording]:
    """torch.cuda's allocation history (Python stacks) over the block; nothing is recorded without CUDA."""
    import torch

    rec = Recording()
    if not torch.cuda.is_available():
        yield rec
        return
    torch.cuda.synchronize()
    rec.baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, context="alloc", stacks="python")
    try:
        yield rec
        torch.cuda.synchronize()
        rec.snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

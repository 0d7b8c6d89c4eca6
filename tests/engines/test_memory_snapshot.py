"""bench/gpu/memory_snapshot.py: the replay of torch.cuda's allocation history finds the peak and names what
was live then (a synthetic trace: the history itself needs CUDA)."""
from bench.gpu.memory_snapshot import GIB, replay, summarize, text


def _ev(action, addr, size, *frames):
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": f, "line": i, "name": f"fn{i}"} for i, f in enumerate(frames)]}


HEAD = "/x/site-packages/qwen35rl/engines/logprob.py"
GDN = "/x/site-packages/fla/ops/chunk.py"
STEP = "/x/site-packages/qwen35rl/engines/megatron/step.py"
TORCH = "/x/site-packages/torch/nn/functional.py"


def test_the_peak_and_what_is_live_then():
    trace = [
        _ev("alloc", 1, 3 * GIB, TORCH, GDN, STEP),
        _ev("alloc", 2, 1 * GIB, TORCH, HEAD, STEP),
        _ev("free_requested", 2, 1 * GIB),
        _ev("free_completed", 2, 1 * GIB),
        _ev("alloc", 3, 2 * GIB, HEAD, STEP),
        _ev("alloc", 4, GIB // 2, HEAD, STEP),     # the peak: 3 + 2 + 0.5 on a 10 GiB baseline
        _ev("free_requested", 3, 2 * GIB),
        _ev("free_requested", 99, 4 * GIB),        # a block of the baseline
        _ev("alloc", 5, 5 * GIB, TORCH, STEP),     # 3 + 0.5 + 5 on a baseline now 6: 14.5 < 15.5
    ]
    peak, live = replay(trace, baseline=10 * GIB)
    assert peak == 15.5 * GIB and sorted(b["addr"] for b in live) == [1, 3, 4]
    s = summarize({"device_traces": [trace]}, baseline=10 * GIB)
    assert s["live_at_peak_gib"] == 5.5 and s["events"] == len(trace)
    top = s["groups"][0]
    assert top["where"] == "fla/ops/chunk.py:1 fn1" and top["caller"] == "qwen35rl/engines/megatron/step.py:2 fn2"
    head = s["groups"][1]
    assert head["where"] == "qwen35rl/engines/logprob.py:0 fn0" and head["gib"] == 2.5 and head["blocks"] == 2
    assert "peak 15.50 GiB = baseline 10.00" in text(s)


def test_without_a_trace():
    assert summarize({}, baseline=GIB)["peak_gib"] == 1.0


def test_the_passes_before_the_optimizer_step_apart():
    """A step whose temporaries top the backward's peak: the passes' own peak is reported beside it."""
    adam = "/x/site-packages/torch/optim/adam.py"
    trace = [
        _ev("alloc", 1, 4 * GIB, HEAD, STEP),
        _ev("free_requested", 1, 4 * GIB),
        _ev("alloc", 2, 6 * GIB, TORCH, adam, "/x/site-packages/megatron/core/optimizer/optimizer.py"),
    ]
    s = summarize({"device_traces": [trace]}, baseline=GIB)
    assert s["peak_gib"] == 7 and s["before_step"]["peak_gib"] == 5
    assert s["before_step"]["groups"][0]["where"] == "qwen35rl/engines/logprob.py:0 fn0"
    assert "before the optimizer step: peak 5.00 GiB" in text(s)
    assert "before_step" not in summarize({"device_traces": [trace[:2]]}, baseline=0)

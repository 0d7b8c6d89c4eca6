"""bench/gpu/packing.py's flow on the CPU (--tiny: packing forced on through the torch paths): the three modes see the
same rows, packed log-probs equal padded ones in row order, and filling micro batches by tokens runs fewer of them."""
import importlib.util
import json
import os
from pathlib import Path

from qwen35rl.engines.packed_gdn import packing_enabled

os.environ.setdefault("OMP_NUM_THREADS", "1")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "packing.py"


def test_tiny_flow(tmp_path):
    spec = importlib.util.spec_from_file_location("packing_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "packing.json"
    with packing_enabled():  # the bench enables packing for good; the block puts transformers back afterwards
        bench.main(["--tiny", "--repeats", "1", "--out", str(out)])
    modes = {m["mode"]: m for m in json.loads(out.read_text())["modes"]}
    assert list(modes) == ["padded", "packed", "packed_by_tokens"]
    assert len({m["tokens"] for m in modes.values()}) == 1
    assert modes["padded"]["micro_batches"] == modes["packed"]["micro_batches"] == 3  # 8 rows, 3 per micro batch
    assert modes["packed_by_tokens"]["micro_batches"] < 3
    assert not modes["padded"]["engine_packs"] and modes["packed"]["engine_packs"]
    for name in ("packed", "packed_by_tokens"):
        assert modes[name]["log_prob_diff_vs_padded"]["max"] < 1e-4, name
        assert "response_log_probs" not in modes[name]

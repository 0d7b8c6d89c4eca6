"""Wait until a Ray cluster has NODES live nodes (used by the bring-up scripts in launch/):

    python -m qwen35rl.runtime.wait_for_nodes NODES [ADDRESS] [TIMEOUT_S]
"""
from __future__ import annotations

import sys
import time
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    import ray

    args = list(sys.argv[1:] if argv is None else argv)
    want = int(args[0])
    address = args[1] if len(args) > 1 else "auto"
    deadline = time.monotonic() + (float(args[2]) if len(args) > 2 else 600)
    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR")
    while True:
        alive = sum(1 for n in ray.nodes() if n["Alive"])
        if alive >= want:
            print(f"[qwen35rl] {alive} Ray node(s) up: {ray.cluster_resources()}")
            return 0
        if time.monotonic() > deadline:
            sys.exit(f"[qwen35rl] only {alive} of {want} Ray nodes joined")
        time.sleep(5)


if __name__ == "__main__":
    sys.exit(main())

"""Settings a training engine accepts (the reference runs set them) but does not apply, with the reason; the engine
logs them at start."""
from __future__ import annotations

from typing import Any, List, Tuple

# (backend, key under `backend.`, the value the engine does not apply, why)
IGNORED: List[Tuple[str, str, Any, str]] = [
    ("megatron", "use_torch_compile", True, "its vocab-parallel log-probs reduce over the tensor-parallel group chunk "
     "by chunk; the FSDP engine compiles its log-probs"),
    ("megatron", "use_dist_checkpointing", True, "checkpoints are torch.distributed.checkpoint shards of the engine's "
     "own state (`trainer.save_freq`)"),
    ("fsdp", "entropy_from_logits_with_chunking", False, "log-probs and entropy are always computed in chunks of "
     "backend.logprob_chunk_size tokens"),
]


def ignored_settings(backend: Any) -> List[Tuple[str, str]]:
    """(dotted key, reason) for each setting of this `backend` config (dict or DictConfig) that its engine does not
    apply."""
    name = backend["name"]
    return [(f"backend.{key}", why) for engine, key, value, why in IGNORED
            if engine == name and key in backend and backend[key] == value]


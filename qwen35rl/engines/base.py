"""The two engine interfaces the GRPO loop sees. FSDP2 and Megatron implement TrainEngine; transformers
`generate` and vLLM implement RolloutEngine. Everything crossing them is plain tensors in the dataclasses below."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from qwen35rl.algo.core import local_batch_counts
from qwen35rl.algo.loss import LossScale, TrainLoss

# Keys of `global_scale` in `TrainEngine.train_mini_batch` (the fields of `LossScale`).
GLOBAL_TOKENS = "global_tokens"
"""Valid response tokens of the whole mini batch over all DP ranks."""
GLOBAL_SEQS = "global_seqs"
"""Responses with at least one valid token in the whole mini batch over all DP ranks."""
NORM_CONST = "norm_const"
"""Divisor of seq-mean-token-sum-norm (optional; absent: the loss function's default)."""


@dataclass
class RolloutRequest:
    """Prompts for one generation call. `prompt_ids` are unpadded token lists, one per prompt."""

    prompt_ids: List[List[int]]
    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    images: Optional[List[Any]] = None
    """Per-prompt list of PIL images (multimodal data), or None."""
    seed: Optional[int] = None


@dataclass
class RolloutResult:
    """n responses per prompt, prompt-major: response j of prompt i is row i*n + j."""

    response_ids: List[List[int]]
    """Generated tokens per response, without padding, EOS included when generated."""
    log_probs: List[List[float]]
    """Log-prob of each generated token under the sampling distribution (temperature applied)."""
    finish_reasons: List[str]
    """`stop` (EOS / stop token) or `length` (hit max_new_tokens)."""
    decode: Dict[str, Any] = field(default_factory=dict)
    """How the engine decoded (the hf engine's DecodeStats: rows, steps, cuda_graph, graph_error); a colocated
    worker adds the seconds of its generation's parts (wake_s, generate_s, sleep_s). Empty for an engine without
    such stats (vLLM) or a share without prompts."""


@dataclass
class Batch:
    """A padded batch of prompt+response sequences for the train engine (one DP rank's share).

    input_ids, attention_mask, position_ids: [B, T]; response_mask: [B, T] marks response tokens whose log-prob
    counts (the token predicted at position t is input_ids[:, t]; its log-prob comes from logits at t-1).
    Per-token tensors (old_log_probs, ref_log_probs, advantages, rollout_log_probs) are [B, T] aligned with input_ids.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    """The rollout engine's log-probs, given to a single on-policy update so that it logs the trainer / rollout gap."""
    multimodal: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Processor outputs for image data (pixel_values, image_grid_thw, ...)."""


class TrainEngine(abc.ABC):
    """One data-parallel rank's shard of the policy (and optimizer)."""

    @property
    def micro_batch_layout(self) -> str:
        """What a micro batch costs in tokens (`runtime.micro_batches`): "packed", "padded" or "uniform"."""
        return "padded"

    def offload_states(self) -> int:
        """Between phases (while the rollout engine generates): move what the backend's offload settings name to the
        host; returns the bytes moved. No-op by default (FSDP keeps offloaded states on the host throughout)."""
        return 0

    def reload_states(self) -> int:
        """Undo `offload_states` before the engine's next use (idempotent); returns the bytes moved."""
        return 0

    @abc.abstractmethod
    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Per-token log-probs [B, T] (and entropy) of batch.input_ids, zero outside response_mask, fp32, under
        the rollout's sampling distribution (logits / rollout.temperature). Collective across DP ranks (FSDP)."""

    @abc.abstractmethod
    def train_mini_batch(self, micro_batches: List[Batch], loss_fn: TrainLoss,
                         global_scale: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        """One optimizer step minimising `loss_fn` over this rank's micro batches of a mini batch (collective across
        DP ranks).

        `global_scale` holds the mini batch's global normalisers under GLOBAL_TOKENS / GLOBAL_SEQS (and optionally
        NORM_CONST); when the counts are absent the engine all-reduces them itself. Micro batches carry what
        `loss_fn` reads (advantages; old, reference and rollout log-probs where it uses them). Returns the loss's
        metrics with `actor/grad_norm`, `actor/lr` and `actor/skipped_steps`, identical on every rank."""

    @abc.abstractmethod
    def export_weights(self, bucket_mb: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        """Full (unsharded) tensors named as in the HF model's `named_parameters()` (tied weights once), on CPU in
        `model.dtype`, in buckets of about bucket_mb. Collective: every rank iterates it in the same order."""

    @abc.abstractmethod
    def state_dict_for_checkpoint(self) -> Dict[str, Any]:
        """Model + optimizer + scheduler state for torch.distributed.checkpoint (sharded tensors as DTensors)."""

    @abc.abstractmethod
    def load_checkpoint_state(self, state: Dict[str, Any]) -> None:
        """Load what `state_dict_for_checkpoint` returned (after DCP filled it in place)."""


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, request: RolloutRequest) -> RolloutResult: ...

    @abc.abstractmethod
    def load_weights(self, buckets: Iterator[List[Tuple[str, torch.Tensor]]]) -> None:
        """Replace the engine's weights in place from HF-named tensors."""

    def sleep(self, level: int = 1) -> None:
        """Free memory while the trainer steps (level 1: KV cache; level 2: weights too). No-op by default."""

    def wake_up(self) -> None:
        """Undo sleep before the next generation. No-op by default."""


def mini_batch_scale(micro_batches: List[Batch], global_scale: Dict[str, float], dp_size: int,
                     sum_over_dp: Callable[[torch.Tensor], torch.Tensor]) -> LossScale:
    """The normalisers of one mini batch's loss: the driver's global counts when it sent them, else this rank's
    token / sequence counts summed over data parallel by `sum_over_dp`."""
    if GLOBAL_TOKENS in global_scale and GLOBAL_SEQS in global_scale:
        tokens, seqs = float(global_scale[GLOBAL_TOKENS]), float(global_scale[GLOBAL_SEQS])
    else:
        local = torch.tensor([local_batch_counts(mb.response_mask) for mb in micro_batches], dtype=torch.float64)
        tokens, seqs = sum_over_dp(local.sum(0)).tolist()
    return LossScale(global_tokens=tokens, global_seqs=seqs, dp_size=dp_size, norm_const=global_scale.get(NORM_CONST))

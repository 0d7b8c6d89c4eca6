"""Plain-python responses <-> padded `Batch` tensors, and splitting work over data-parallel ranks.

Between the driver and the workers everything travels as lists (token ids, per-token floats, advantages per
response or per token); each worker pads its own share. Layout of a padded row: the prompt left-padded to the
longest prompt of the micro batch, then the response right-padded to the longest response, so every response starts
at the same column. The token predicted at column t is input_ids[:, t]; per-token values sit in the same column.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from qwen35rl.engines.base import Batch
from qwen35rl.runtime.micro_batches import balanced_parts, fixed_groups, split_even


@dataclass
class Sequences:
    """Responses with their prompts (one row per response) and optional per-response training inputs."""

    prompt_ids: List[List[int]]
    response_ids: List[List[int]]
    old_log_probs: Optional[List[List[float]]] = None
    ref_log_probs: Optional[List[List[float]]] = None
    advantages: Optional[List[Union[float, List[float]]]] = None
    """Per response, one advantage broadcast over its tokens, or a list with one per response token (e.g. the
    off-policy correction's weights folded in, `algo.rollout_correction.fold`)."""
    images: Optional[List[Optional[List[Any]]]] = None
    """Per response, the PIL images of its prompt (image data; the prompt ids hold their image tokens)."""
    rollout_log_probs: Optional[List[List[float]]] = None
    """Per response token, the rollout engine's log-prob: given to a single on-policy update, whose one pass then
    logs the trainer / rollout gap."""
    extra: Dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, start: int, stop: int) -> "Sequences":
        def cut(x):
            return None if x is None else x[start:stop]

        return Sequences(self.prompt_ids[start:stop], self.response_ids[start:stop], cut(self.old_log_probs),
                         cut(self.ref_log_probs), cut(self.advantages), cut(self.images), cut(self.rollout_log_probs))

    def take(self, indices: Sequence[int]) -> "Sequences":
        def pick(x):
            return None if x is None else [x[i] for i in indices]

        return Sequences(pick(self.prompt_ids), pick(self.response_ids), pick(self.old_log_probs),
                         pick(self.ref_log_probs), pick(self.advantages), pick(self.images), pick(self.rollout_log_probs))

    def token_count(self) -> int:
        return sum(len(r) for r in self.response_ids)

    def lengths(self) -> List[int]:
        """Prompt + response tokens of each row."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]


def chunk(seqs: Sequences, size: int) -> List[Sequences]:
    """Consecutive pieces of at most `size` rows (fixed-size micro batches)."""
    return [seqs.take(rows) for rows in fixed_groups(len(seqs), size)]


def split_sequences(seqs: Sequences, parts: int) -> List[Sequences]:
    bounds = [0]
    for share in split_even(range(len(seqs)), parts):
        bounds.append(bounds[-1] + len(share))
    return [seqs.select(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def balanced_split(seqs: Sequences, parts: int) -> List[Sequences]:
    """`split_sequences`' share sizes, with the rows assigned so that each share's prompt + response tokens are
    close (`trainer.balance_batch`): no rank waits on one that drew the long responses."""
    return [seqs.take(rows) for rows in balanced_parts(seqs.lengths(), parts)]


PER_TOKEN = ("old_log_probs", "ref_log_probs", "advantages", "rollout_log_probs")
"""The per-token training inputs `build_batch` pads into the engine's Batch, under the same names."""


def build_batch(seqs: Sequences, pad_token_id: int, device: Any = "cpu", image_processor: Any = None) -> Batch:
    """Pad one micro batch into the engine's `Batch`; with images, their vision inputs (`image_processor` of the
    model's processor) in row order, as the image tokens appear in the batch."""
    n = len(seqs)
    p_len = max((len(p) for p in seqs.prompt_ids), default=0)
    r_len = max(max((len(r) for r in seqs.response_ids), default=0), 1)
    width = p_len + r_len
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    response_mask = torch.zeros((n, width), dtype=torch.long)
    per_token = {name: torch.zeros((n, width), dtype=torch.float32)
                 for name in PER_TOKEN if getattr(seqs, name) is not None}
    for i, (prompt, response) in enumerate(zip(seqs.prompt_ids, seqs.response_ids)):
        p0 = p_len - len(prompt)
        input_ids[i, p0:p_len] = torch.tensor(prompt, dtype=torch.long)
        input_ids[i, p_len:p_len + len(response)] = torch.tensor(response, dtype=torch.long)
        attention[i, p0:p_len + len(response)] = 1
        response_mask[i, p_len:p_len + len(response)] = 1
        for name, t in per_token.items():
            values = getattr(seqs, name)[i]
            if name == "advantages" and not isinstance(values, (list, tuple)):
                values = [values] * len(response)
            if len(values) != len(response):
                raise ValueError(f"{name}[{i}] has {len(values)} values for {len(response)} response tokens")
            t[i, p_len:p_len + len(response)] = torch.tensor(values, dtype=torch.float32)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    return Batch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        response_mask=response_mask.to(device),
        position_ids=position_ids.to(device),
        **{name: t.to(device) for name, t in per_token.items()},
        multimodal=_vision_inputs(seqs, image_processor),
    )


def _vision_inputs(seqs: Sequences, image_processor: Any) -> Dict[str, torch.Tensor]:
    if not seqs.images or not any(seqs.images):
        return {}
    if image_processor is None:
        raise ValueError("responses to image prompts need the model's image processor")
    from qwen35rl.models.processor import vision_inputs

    return vision_inputs(image_processor, [img for row in seqs.images if row for img in row])


def response_values(values: torch.Tensor, batch: Batch) -> List[List[float]]:
    """Per-response lists of a [B, T] per-token tensor, read at the response positions of `batch`."""
    mask = batch.response_mask.bool().cpu()
    values = values.detach().float().cpu()
    return [values[i][mask[i]].tolist() for i in range(values.shape[0])]

"""Fixed-size prompt batches over epochs, resumable to the exact batch."""
from __future__ import annotations

import random
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from qwen35rl.data.example import PromptExample


class PromptLoader:
    """Yields batches of `batch_size` prompts forever, epoch after epoch; the incomplete last batch of an epoch is
    dropped. Epoch e's order is a permutation drawn from (seed, e) alone, so `load_state_dict(state_dict())`
    continues with exactly the batches an uninterrupted run would have seen."""

    def __init__(self, dataset: Sequence[PromptExample], batch_size: int, seed: int, shuffle: bool = True):
        if batch_size < 1 or len(dataset) < batch_size:
            raise ValueError(f"data.train_batch_size={batch_size} needs at least that many prompts "
                             f"(the dataset has {len(dataset)})")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch = 0
        self.position = 0
        """Batches of the current epoch already handed out."""
        self._order_cache: Tuple[int, List[int]] = (-1, [])

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def _order(self, epoch: int) -> List[int]:
        if self._order_cache[0] != epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def next_batch(self) -> List[PromptExample]:
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        batch = [self.dataset[i] for i in self._order(self.epoch)[start:start + self.batch_size]]
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[List[PromptExample]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.dataset)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("size", len(self.dataset)) != len(self.dataset):
            raise ValueError(f"resumed data loader saw {state['size']} prompts, the dataset now has {len(self.dataset)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.seed = state.get("seed", self.seed)

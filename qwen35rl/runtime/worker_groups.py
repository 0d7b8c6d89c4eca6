"""What the driver asks of its workers, as methods with real signatures: `PolicyWorkers` drives the training workers
(`worker.PolicyWorker`: the train engine, the reference policy and, colocated, the rollout engine); `RolloutWorkers`
the rollout pool of `placement=split` (`rollout_worker.RolloutWorker`).

A handle wraps a worker group (`cluster.WorkerGroup` under Ray, `cluster.LocalWorkerGroup` in the driver's process),
which only moves calls. Every handle method is named after the worker method it calls, fans out to every rank of
the group and gathers the results in rank order, so a collective method always reaches all ranks together. The
GRPO loop and the launch name no worker method themselves (the groups know only the bring-up): a misspelt call
fails at the handle (AttributeError), not as a Ray error once the workers are up.

The calls that split data (`generate`, `compute_log_probs`, `update_actor`) take one share per data group, not per
worker: the ranks of one model-parallel group take the same share, and the group's first rank answers for it.
`data_shards`, asked once before any of them, says which group each worker is in.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from qwen35rl.engines.base import RolloutResult
from qwen35rl.runtime.batching import Sequences
from qwen35rl.runtime.cluster import Calls, Finished, wait_pools


class _Workers:
    """What both kinds of worker answer: their data shards, generation and memory peaks."""

    def __init__(self, group: Any):
        self.group = group
        """The transport: anything with `world`, `start(method, per_rank, kwargs, ranks)` and `shutdown()`."""
        self.rollout_group: Optional[List[int]] = None
        """Per worker (rank order), the rollout group whose prompts it generates (`data_shards`)."""

    @property
    def world(self) -> int:
        return self.group.world

    def shutdown(self) -> None:
        """Stop the workers: Ray's actors are killed and their placement freed; a local worker shuts itself down."""
        self.group.shutdown()

    def data_shards(self) -> List[Dict[str, int]]:
        """Which share of the data each worker takes, rank order; remembered for the calls that split data."""
        shards = self._fan_out("data_shards").wait()
        self.rollout_group = [s["rollout_group"] for s in shards]
        return shards

    @property
    def rollout_groups(self) -> int:
        """How many shares of prompts `generate` takes."""
        return max(self._known(self.rollout_group)) + 1

    def generate(self, prompt_ids: Sequence[List[List[int]]], params: Sequence[Dict[str, Any]]) -> List[RolloutResult]:
        """Per rollout group, its prompts and their request (`RolloutRequest` fields: n, temperature, seed, ...);
        one result per group."""
        return self._by_group("generate", self._known(self.rollout_group), list(zip(prompt_ids, params)))

    def phase_memory_gb(self) -> List[Dict[str, float]]:
        """Per worker, the device's peak per phase since the last call (empty on CPU)."""
        return self._fan_out("phase_memory_gb").wait()

    def max_memory_allocated_gb(self) -> List[float]:
        """Per worker, its memory peak of the run so far (the device allocator's; on CPU the resident set's)."""
        return self._fan_out("max_memory_allocated_gb").wait()

    # ------------------------------------------------------------------------------------------- the fan-out
    def _fan_out(self, method: str, *args: Any, shares: Optional[Sequence[tuple]] = None, rank: Optional[int] = None,
                 **kwargs: Any) -> Union[Calls, Finished]:
        """Start the worker method `method`: on every worker with the same arguments, on worker r with the positional
        arguments shares[r], or on worker `rank` alone. Returns the calls under way: `.wait()` gives the results in
        rank order, `cluster.wait_pools` those of two pools at once."""
        if rank is not None:
            return self.group.start(method, [args], kwargs, [rank])
        return self.group.start(method, [args] * self.world if shares is None else shares, kwargs)

    def _by_group(self, method: str, group_of: Sequence[int], shares: Sequence[tuple], **kwargs: Any) -> List[Any]:
        """Worker r gets shares[group_of[r]]; one result per share, from the first worker of its group."""
        results = self._fan_out(method, shares=[shares[g] for g in group_of], **kwargs).wait()
        first: Dict[int, Any] = {}
        for g, result in zip(group_of, results):
            first.setdefault(g, result)
        return [first[g] for g in range(len(shares))]

    @staticmethod
    def _known(groups: Optional[List[int]]) -> List[int]:
        if groups is None:
            raise RuntimeError("the workers' data shards are not known yet: call data_shards() first")
        return groups


class RolloutWorkers(_Workers):
    """The rollout pool of `placement=split`: generation only; its weights come from `PolicyWorkers.send_weights`."""


class PolicyWorkers(_Workers):
    """The training workers, one per device of the training pool (colocated: of the run)."""

    def __init__(self, group: Any):
        super().__init__(group)
        self.train_group: Optional[List[int]] = None
        """Per worker (rank order), its data-parallel rank (`data_shards`)."""

    def data_shards(self) -> List[Dict[str, int]]:
        shards = super().data_shards()
        self.train_group = [s["train_dp_rank"] for s in shards]
        return shards

    def engine_build_s(self) -> Dict[str, float]:
        """Rank 0's seconds per engine built (the ranks build alike)."""
        return self._fan_out("engine_build_s", rank=0).wait()[0]

    # ----------------------------------------------------------------------------------------- weight sync
    def sync_weights(self) -> None:
        """Collective, colocated: each worker streams the policy's full weights into its own rollout engine."""
        self._fan_out("sync_weights").wait()

    def join_weight_sync(self, rollout: RolloutWorkers) -> None:
        """Split placement: training rank 0 and every rollout worker join a communicator of their own, rank 0
        hosting it on its node; both pools at once, as its store waits for every member."""
        host, port = self._fan_out("rendezvous_address", rank=0).wait()[0]
        size = 1 + rollout.world
        wait_pools([self._fan_out("join_weight_sync", host, port, size),
                    rollout._fan_out("join_weight_sync", host, port, size)])

    def send_weights(self, rollout: RolloutWorkers, version: int) -> None:
        """Split placement, collective on both pools at once: the training ranks export the policy, rank 0 sends it,
        the rollout workers load it as the policy of step `version`. A failure on either side stops both at once."""
        wait_pools([self._fan_out("send_weights"), rollout._fan_out("receive_weights", version)])

    # -------------------------------------------------------------------------------------------- training
    def compute_log_probs(self, shares: Sequence[Sequences], reference: bool = False) -> List[List[List[float]]]:
        """Collective: per data-parallel rank, the response tokens' log-probs of its share under the policy (or the
        reference policy)."""
        return self._by_group("compute_log_probs", self._known(self.train_group), [(s,) for s in shares],
                              reference=reference)

    def update_actor(self, shares: Sequence[Sequences], global_scale: Dict[str, float]) -> List[Dict[str, float]]:
        """Collective: one optimizer step over a mini batch, one share per data-parallel rank, the loss normalised by
        the whole mini batch's `global_scale`; each rank's metrics."""
        return self._by_group("update_actor", self._known(self.train_group), [(s,) for s in shares],
                              global_scale=global_scale)

    # ----------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Collective: model and optimizer shards and each rank's RNG into the (temporary) checkpoint dir."""
        self._fan_out("save_checkpoint", path).wait()

    def load_checkpoint(self, path: str) -> List[bool]:
        """Collective; per worker whether its RNG state was restored (False: saved with another world size)."""
        return self._fan_out("load_checkpoint", path).wait()

    def export_hf(self, path: str) -> None:
        """Collective: the full policy in Hugging Face format, written by rank 0."""
        self._fan_out("export_hf", path).wait()

"""Ray bring-up and the worker group: one worker actor per device, placed by a placement group per node.

A local Ray cluster is started when neither `ray_address` nor RAY_ADDRESS is set (sized to the run on CPU so it
starts in seconds); otherwise the driver joins the running cluster (`ray start` on every node, see launch/).
Ranks follow (node, bundle) order, so ranks of a node are contiguous; rank 0's node hosts the torch.distributed
rendezvous.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import OmegaConf

from qwen35rl.runtime.platform import Platform

log = logging.getLogger(__name__)

CPU_OBJECT_STORE_BYTES = 256 * 1024 ** 2


class ClusterError(RuntimeError):
    pass


def ray_address(cfg: Any) -> Optional[str]:
    """The cluster to join: `ray_address`, else RAY_ADDRESS, else None (start a local one)."""
    return cfg.get("ray_address") or os.environ.get("RAY_ADDRESS") or None


def connect(cfg: Any, platform: Platform, world: int) -> bool:
    """Connect the driver to Ray. Returns True when this call started a local cluster (and must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    address = ray_address(cfg)
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)
    if address:
        ray.init(address=address, **quiet)
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private single-user cluster
    kwargs: Dict[str, Any] = dict(include_dashboard=False, **quiet)
    if platform.ray_resource == "CPU":
        # each worker is one CPU device; one spare CPU for Ray's own helpers
        kwargs.update(num_cpus=world + 1, object_store_memory=CPU_OBJECT_STORE_BYTES)
    elif platform.ray_resource not in ("GPU",):
        kwargs.update(resources={platform.ray_resource: int(cfg.hw.devices_per_node)})
    ray.init(**kwargs)
    return True


@contextlib.contextmanager
def ray_session(cfg: Any, platform: Platform, world: int):
    """Connected to Ray for the duration (yields whether this run started a local cluster, which is stopped on
    exit)."""
    import ray

    started_local = connect(cfg, platform, world)
    try:
        yield started_local
    finally:
        if started_local and ray.is_initialized():
            ray.shutdown()


def placement_groups(platform: Platform, nodes: int, devices_per_node: int, timeout_s: float) -> List[Any]:
    """One STRICT_PACK placement group per node (its devices on one host), all ready within `timeout_s` or a
    ClusterError naming what is missing."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = platform.bundle()
    groups = [placement_group([bundle for _ in range(devices_per_node)], strategy="STRICT_PACK",
                              name=f"qwen35rl-node{i}-{os.getpid()}") for i in range(nodes)]
    ready, pending = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
    if pending:
        for g in groups:
            ray.util.remove_placement_group(g)
        free, total = ray.available_resources(), ray.cluster_resources()
        have = ", ".join(f"{free.get(k, 0):g} of {total.get(k, 0):g} {k}" for k in bundle)
        raise ClusterError(
            f"placement: needs {nodes} node(s) x {devices_per_node} bundles of {bundle} (one node each), "
            f"{len(pending)} of {nodes} still unplaced after {timeout_s:g} s (trainer.placement_timeout_s); free "
            f"now: {have}. Other actors or placement groups may hold them, or no single node has "
            f"{devices_per_node} free: check `ray status` against hw.nodes / hw.devices_per_node.")
    return groups


class WorkerGroup:
    """The colocated workers of a run, rank order. Calls fan out to every worker and gather results in rank order."""

    def __init__(self, actors: List[Any], groups: List[Any]):
        self.actors, self.groups = actors, groups

    @property
    def world(self) -> int:
        return len(self.actors)

    @classmethod
    def create(cls, cfg: Any, platform: Platform, worker_cls: type, world: int, **worker_kwargs: Any) -> "WorkerGroup":
        """Place one `worker_cls(cfg, rank=, world_size=, local_rank=, **worker_kwargs)` actor per device (Ray must
        be connected) and join them in torch.distributed."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        nodes, per_node = int(cfg.hw.nodes), int(cfg.hw.devices_per_node)
        if nodes * per_node != world:
            raise ClusterError(f"layout world {world} != hw.nodes {nodes} x hw.devices_per_node {per_node}")
        groups = placement_groups(platform, nodes, per_node, float(cfg.trainer.placement_timeout_s))
        plain_cfg = OmegaConf.to_container(cfg, resolve=True)
        resources = {k: v for k, v in platform.bundle().items() if k not in ("CPU", "GPU")}
        remote_cls = ray.remote(worker_cls)
        actors = []
        for node, group in enumerate(groups):
            for local_rank in range(per_node):
                rank = node * per_node + local_rank
                actors.append(remote_cls.options(
                    num_cpus=1,
                    num_gpus=platform.bundle().get("GPU", 0),
                    resources=resources,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=local_rank),
                    runtime_env={"env_vars": platform.worker_env},
                    name=f"qwen35rl-worker-{rank}-{os.getpid()}",
                ).remote(plain_cfg, rank=rank, world_size=world, local_rank=local_rank, **worker_kwargs))
        wg = cls(actors, groups)
        master_addr, master_port = wg.call_rank(0, "rendezvous_address")
        wg.run("init_distributed", master_addr, master_port)
        return wg

    # ------------------------------------------------------------------------------------------------- calls
    def run(self, method: str, *args: Any, **kwargs: Any) -> List[Any]:
        """The same call on every worker; results in rank order."""
        import ray

        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def run_each(self, method: str, per_rank: Sequence[Sequence[Any]], **kwargs: Any) -> List[Any]:
        """Worker r gets the positional arguments per_rank[r] (and the same kwargs as the others)."""
        import ray

        if len(per_rank) != self.world:
            raise ValueError(f"{method}: {len(per_rank)} shares for {self.world} workers")
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a, args in zip(self.actors, per_rank)])

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        return ray.get(getattr(self.actors[rank], method).remote(*args, **kwargs))

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
        for g in self.groups:
            try:
                ray.util.remove_placement_group(g)
            except Exception:
                pass

"""Weight sync between the training pool and the rollout pool (`placement=split`).

One communicator of its own spans training rank 0 (sync rank 0, the sender) and every rollout worker (sync ranks
1..N). It is built from a TCPStore and a backend object directly (gloo on CPU, NCCL on GPU, HCCL on NPU), never
through `torch.distributed.init_process_group`: a training worker already has the default group of its training
world, and vLLM keeps a torch.distributed world of its own in each rollout worker, so neither can be used or
replaced.

Who sends: `TrainEngine.export_weights(bucket_mb)` is a collective on every training rank. The FSDP engine gathers
each parameter's shards into the full tensor, the Megatron engine gathers its TP/PP/EP shards and converts them to
the HF layout, so every bucket already holds full HF-named tensors. Only training rank 0 passes the buckets to
`send`; the other training ranks iterate the same export (to take part in its gathers) and drop what it yields.
Nothing is resharded on the wire: every rollout worker receives the full tensors and its engine loads them as
they come (hf copies them; a TP-sharded engine slices its own shard on load, as vLLM's weight loaders do).

Generation must not run while weights load: the driver pauses the rollout pool, syncs, then resumes it.

Wire format, per round (`send` once on rank 0, `receive` once on each other rank):
- per bucket: a header (int64 byte count, then JSON: round number, names, shapes, dtypes), then one broadcast per
  dtype of the bucket (none where its tensors are all empty): its tensors flattened into one contiguous buffer,
  sent as bytes (so every dtype, bf16 and fp8 included, goes through every backend bitwise; gloo has no int16 or
  fp8);
- after the last bucket: an end header. A failure while producing the buckets on rank 0 sends an error header, so
  the receivers raise instead of waiting out the timeout.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

Bucket = List[Tuple[str, torch.Tensor]]

_DEVICE_OF_BACKEND = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}


def collective_backend(device_type: str) -> str:
    """The collective backend of a torch device type, as the platform config states it
    (`conf/platform/<device>.yaml: collective_backend`): cpu -> gloo, cuda -> nccl, npu -> hccl."""
    from omegaconf import OmegaConf

    from qwen35rl.config.paths import config_dir

    path = config_dir() / "platform" / f"{device_type}.yaml"
    if device_type not in _DEVICE_OF_BACKEND.values() or not path.is_file():
        raise ValueError(f"collective_backend: device type {device_type!r} has no backend; expected one of "
                         f"{', '.join(sorted(_DEVICE_OF_BACKEND.values()))}")
    return str(OmegaConf.load(path).collective_backend)


@dataclass
class SyncStats:
    """One round of a sync group, as this rank saw it."""
    round: int
    """1 for the first `send`/`receive` of the group, then 2, ..."""
    buckets: int
    tensors: int
    bytes: int
    """Tensor payload (headers not counted)."""
    seconds: float
    """Wall time from the round's first header to its end header, including the time the caller spends between
    buckets (producing them on the sender, loading them on a receiver)."""

    def as_dict(self) -> Dict[str, Any]:
        return {"round": self.round, "buckets": self.buckets, "tensors": self.tensors, "bytes": self.bytes,
                "seconds": self.seconds}


class WeightSyncGroup:
    """Rank `rank` of a sync group of `world_size` processes (rank 0: training rank 0, the sender; ranks 1..: the
    rollout workers), meeting at the TCPStore that rank 0 serves on `host:port`.

    The constructor starts the store (rank 0 listens; `port=0` on rank 0 picks a free port, read it from `.port`
    and hand it to the others) or connects to it (the other ranks wait for rank 0 up to `timeout_s`). The
    communicator itself is created on the first `send`/`receive`, which every rank of the group must enter.
    `device`: where received tensors land (nccl: a cuda device, hccl: an npu device; gloo moves tensors through the
    host and then to `device`)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str, device: Any = "cpu",
                 timeout_s: float = 600.0):
        if world_size < 2:
            raise ValueError(f"WeightSyncGroup: world_size={world_size}; a sync group is training rank 0 plus at "
                             "least one rollout worker")
        if not 0 <= rank < world_size:
            raise ValueError(f"WeightSyncGroup: rank={rank} outside 0..{world_size - 1}")
        if backend not in _DEVICE_OF_BACKEND:
            raise ValueError(f"WeightSyncGroup: backend {backend!r}; expected one of {', '.join(_DEVICE_OF_BACKEND)}")
        if rank != 0 and not port:
            raise ValueError("WeightSyncGroup: only rank 0 may pass port=0; the others need the port it serves")
        self._make_backend = _backend_factory(backend)  # first: a missing torch_npu fails here, and "npu" devices
        self.device = torch.device(device)              # exist only once torch_npu is imported
        comm_type = _DEVICE_OF_BACKEND[backend]
        if backend != "gloo" and self.device.type != comm_type:
            raise ValueError(f"WeightSyncGroup: backend {backend} communicates on {comm_type} devices, got "
                             f"device={self.device}")
        self.comm_device = torch.device("cpu") if backend == "gloo" else self.device
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=float(timeout_s))
        self._store: Optional[dist.TCPStore] = dist.TCPStore(
            host, int(port), world_size, rank == 0, self.timeout, wait_for_workers=False)
        self.host, self.port = host, int(self._store.port)
        self._pg: Any = None
        self._round = 0
        self._receiving = False
        self.last_stats: Optional[SyncStats] = None

    # ------------------------------------------------------------------------------------------ rank 0
    def send(self, buckets: Iterable[Bucket]) -> SyncStats:
        """Broadcast every bucket (lists of (name, tensor), on any device), then the end header. Rank 0 only."""
        if self.rank != 0:
            raise RuntimeError(f"WeightSyncGroup.send on rank {self.rank}: only rank 0 (training rank 0) sends")
        pg = self._connected()
        self._round += 1
        start = time.perf_counter()
        stats = SyncStats(self._round, 0, 0, 0, 0.0)
        between_buckets = True  # the receivers wait for a header (not inside a bucket's payload)
        try:
            for bucket in buckets:
                bucket = list(bucket)
                entries = [_entry(name, t) for name, t in bucket]
                self._header(pg, {"round": self._round, "tensors": entries})
                between_buckets = False
                for dtype, members in _by_dtype(entries):
                    total = sum(_numel(entries[i][1]) for i in members)
                    if total == 0:
                        continue
                    flat = torch.empty(total, dtype=dtype, device=self.comm_device)
                    offset = 0
                    for i in members:
                        t = bucket[i][1].detach()
                        flat[offset:offset + t.numel()].copy_(t.reshape(-1))
                        offset += t.numel()
                    self._broadcast(pg, flat.view(torch.uint8))
                    stats.bytes += flat.numel() * flat.element_size()
                between_buckets = True
                stats.buckets += 1
                stats.tensors += len(entries)
        except BaseException as e:
            if between_buckets:  # else the receivers wait for a payload and time out
                try:
                    self._header(pg, {"round": self._round, "error": f"{type(e).__name__}: {e}"})
                except Exception:  # the communicator itself failed: the receivers time out
                    pass
            raise
        self._header(pg, {"round": self._round, "end": True})
        self._synchronize()
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return stats

    # ------------------------------------------------------------------------------------------ rollout ranks
    def receive(self) -> Iterator[Bucket]:
        """The buckets of one round, one at a time (each is received when the caller asks for it), as lists of
        (name, tensor on `device`); stops at the end header. Consume it to the end: a round left half-read puts
        this rank out of step with the sender, and the next `receive` refuses to start. The round's SyncStats is
        the generator's return value and `last_stats` afterwards."""
        if self.rank == 0:
            raise RuntimeError("WeightSyncGroup.receive on rank 0: rank 0 (training rank 0) is the sender")
        if self._receiving:
            raise RuntimeError(f"WeightSyncGroup.receive: round {self._round} was not read to its end header; "
                               "this rank is out of step with the sender (rebuild the group)")
        pg = self._connected()
        return self._receive(pg)

    def _receive(self, pg: Any) -> Iterator[Bucket]:
        self._receiving = True
        self._round += 1
        start = time.perf_counter()
        stats = SyncStats(self._round, 0, 0, 0, 0.0)
        while True:
            header = self._header(pg, None)
            if header.get("round") != self._round:
                raise RuntimeError(f"WeightSyncGroup.receive: expected round {self._round}, the sender is in round "
                                   f"{header.get('round')}")
            if "error" in header:
                self._receiving = False
                raise RuntimeError(f"WeightSyncGroup: the sender failed in round {self._round}: {header['error']}")
            if header.get("end"):
                break
            entries = [(name, tuple(shape), _dtype(dtype)) for name, shape, dtype in header["tensors"]]
            out: List[Optional[torch.Tensor]] = [None] * len(entries)
            for dtype, members in _by_dtype(entries):
                total = sum(_numel(entries[i][1]) for i in members)
                typed = torch.empty(total, dtype=dtype, device=self.comm_device)
                if total:
                    self._broadcast(pg, typed.view(torch.uint8))
                    stats.bytes += typed.numel() * typed.element_size()
                typed = typed.to(self.device)
                offset = 0
                for i in members:
                    n = _numel(entries[i][1])
                    out[i] = typed[offset:offset + n].view(entries[i][1])
                    offset += n
            stats.buckets += 1
            stats.tensors += len(entries)
            yield [(name, t) for (name, _, _), t in zip(entries, out)]
        self._receiving = False
        self._synchronize()
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return stats

    # ------------------------------------------------------------------------------------------ both
    def close(self) -> None:
        """Shut the communicator down and drop the store (rank 0 stops serving it). Idempotent."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()

    def __enter__(self) -> "WeightSyncGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _connected(self) -> Any:
        if self._store is None:
            raise RuntimeError("WeightSyncGroup: used after close()")
        if self._pg is None:
            self._pg = self._make_backend(self._store, self.rank, self.world_size, self.timeout)
        return self._pg

    def _broadcast(self, pg: Any, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        pg.broadcast([tensor], opts).wait()

    def _header(self, pg: Any, header: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """Rank 0 broadcasts `header`; the others get it back."""
        if self.rank == 0:
            payload = json.dumps(header).encode()
            length = torch.tensor([len(payload)], dtype=torch.int64, device=self.comm_device)
            self._broadcast(pg, length)
            self._broadcast(pg, torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.comm_device))
            return header
        length = torch.empty(1, dtype=torch.int64, device=self.comm_device)
        self._broadcast(pg, length)
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.comm_device)
        self._broadcast(pg, payload)
        return json.loads(payload.cpu().numpy().tobytes().decode())

    def _synchronize(self) -> None:
        if self.comm_device.type != "cpu":
            getattr(torch, self.comm_device.type).synchronize(self.comm_device)


def _backend_factory(backend: str):
    """A function (store, rank, size, timeout) -> the backend object of `backend`."""
    if backend == "gloo":
        # this overload picks the host's device itself (GLOO_SOCKET_IFNAME if set, else the default device)
        return lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("WeightSyncGroup: backend nccl, but this torch has no NCCL (install a CUDA build of "
                               "torch, or use gloo on CPU)")

        def nccl(store, rank, size, timeout):
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, size, options)
        return nccl
    from qwen35rl.runtime.platform import Platform, require_stack

    require_stack(Platform(device_type="npu", collective_backend="hccl", ray_resource="NPU"), rollout_engine="hf")
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    def hccl(store, rank, size, timeout):
        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, size, options)
    return hccl


def _entry(name: Any, tensor: Any) -> List[Any]:
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise TypeError(f"WeightSyncGroup.send: a bucket holds (name: str, tensor) pairs, got "
                        f"({type(name).__name__}, {type(tensor).__name__})")
    return [name, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"WeightSyncGroup.receive: the sender sent dtype {name!r}, unknown to this torch")
    return dtype


def _by_dtype(entries: List[Any]) -> List[Tuple[torch.dtype, List[int]]]:
    """Entry indices grouped by dtype, dtypes in order of first appearance (the same order on every rank)."""
    groups: Dict[torch.dtype, List[int]] = {}
    for i, (_, _, dtype) in enumerate(entries):
        groups.setdefault(dtype if isinstance(dtype, torch.dtype) else _dtype(dtype), []).append(i)
    return list(groups.items())


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n

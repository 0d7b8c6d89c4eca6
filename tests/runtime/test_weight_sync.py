"""The weight-sync group between the training pool and the rollout pool, over gloo on CPU: a sender and two
receivers in their own processes, two of them with a default process group of their own."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import queue
import sys
import threading
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen35rl.runtime.weight_sync import WeightSyncGroup, collective_backend

HOST = "127.0.0.1"
RECEIVERS = 2
JOIN_S = 120  # generous: a slow machine must not turn into a failure


def _buckets(step):
    """The weights of policy version `step`: mixed dtypes and shapes (0-dim, empty, non-contiguous, large)."""
    g = torch.Generator().manual_seed(step)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 1e-42, step])
    return [
        [("embed.weight", torch.randn(64, 32, generator=g)),
         ("norm.weight", torch.randn(32, generator=g).to(torch.bfloat16)),
         ("version", torch.tensor(step, dtype=torch.int64)),
         ("scale", torch.tensor(1.5 * step))],
        [("empty.fp32", torch.empty(0, 4)),
         ("special", special),
         ("special.bf16", special.to(torch.bfloat16)),
         ("ids", torch.arange(10 * step, dtype=torch.int64).reshape(2, -1)),
         ("proj.t", torch.randn(6, 8, generator=g).t())],
        [("big", torch.randn(1024, 1024, generator=g)),
         ("big.bf16", torch.randn(512, 1024, generator=g).to(torch.bfloat16))],
        [("only.empty", torch.empty(0, 3, dtype=torch.bfloat16))],
    ]


def _same_bits(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)))


def _default_group(tmp, rank):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/default_group_{rank}", rank=0, world_size=1)


def _default_group_works():
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_world_size() == 1 and float(t) == 1.0


def _sender(tmp, port_q, out):
    try:
        torch.set_num_threads(1)
        _default_group(tmp, 0)
        group = WeightSyncGroup(HOST, 0, 0, 1 + RECEIVERS, "gloo", "cpu", timeout_s=JOIN_S)
        port_q.put(group.port)

        def export(step):  # as the trainer's export: a default-group collective before each bucket
            for bucket in _buckets(step):
                assert _default_group_works()
                yield bucket

        stats = [group.send(export(step)).as_dict() for step in (1, 2)]
        group.close()
        group.close()
        ok = _default_group_works()
        dist.destroy_process_group()
        out.put((0, {"stats": stats, "default_group_ok": ok}))
    except BaseException:
        out.put((0, {"error": traceback.format_exc()}))


def _receiver(tmp, port, rank, out):
    try:
        torch.set_num_threads(1)
        if rank == 1:
            _default_group(tmp, rank)
        group = WeightSyncGroup(HOST, port, rank, 1 + RECEIVERS, "gloo", "cpu", timeout_s=JOIN_S)
        rounds = []
        for step in (1, 2):
            expected = _buckets(step)
            seen = []
            received = group.receive()
            assert not isinstance(received, list)
            for i, bucket in enumerate(received):  # ends by itself at the end header
                want = expected[i] if i < len(expected) else []
                seen.append({"names": [n for n, _ in bucket],
                             "bitwise": len(bucket) == len(want) and all(
                                 n == wn and _same_bits(t, wt) for (n, t), (wn, wt) in zip(bucket, want)),
                             "devices": sorted({str(t.device) for _, t in bucket})})
                if rank == 1:
                    assert _default_group_works()
            rounds.append({"buckets": seen, "stats": group.last_stats.as_dict()})
        group.close()
        result = {"rounds": rounds}
        if rank == 1:
            result["default_group_ok"] = _default_group_works()
            dist.destroy_process_group()
        out.put((rank, result))
    except BaseException:
        out.put((rank, {"error": traceback.format_exc()}))


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """Two sync rounds (weights of step 1, then step 2) from one sender to two receivers; per rank, what it saw."""
    tmp = tmp_path_factory.mktemp("weight_sync")
    ctx = mp.get_context("spawn")
    port_q, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(str(tmp), port_q, out), daemon=True)]
    procs[0].start()
    results = {}
    try:
        try:
            port = port_q.get(timeout=JOIN_S)
        except queue.Empty:
            port = None
        if port is not None:
            for rank in range(1, 1 + RECEIVERS):
                procs.append(ctx.Process(target=_receiver, args=(str(tmp), port, rank, out), daemon=True))
                procs[-1].start()
        while len(results) < (1 + RECEIVERS if port is not None else 1):
            try:
                rank, result = out.get(timeout=JOIN_S)
            except queue.Empty:
                break
            results[rank] = result
            if "error" in result:
                break
        for p in procs:
            p.join(timeout=JOIN_S if not any("error" in r for r in results.values()) else 5)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
    assert sorted(results) == list(range(1 + RECEIVERS)), (
        f"ranks that answered: {sorted(results)}; exit codes {[p.exitcode for p in procs]}")
    assert [p.exitcode for p in procs] == [0] * (1 + RECEIVERS)
    return results


def test_receivers_get_every_bucket_bitwise(synced):
    for rank in range(1, 1 + RECEIVERS):
        for step, rnd in zip((1, 2), synced[rank]["rounds"]):
            expected = _buckets(step)
            assert [b["names"] for b in rnd["buckets"]] == [[n for n, _ in b] for b in expected]
            assert all(b["bitwise"] for b in rnd["buckets"]), (rank, step, rnd["buckets"])
            assert all(b["devices"] in ([], ["cpu"]) for b in rnd["buckets"])


def test_two_rounds_and_their_stats(synced):
    sent = synced[0]["stats"]
    assert [s["round"] for s in sent] == [1, 2]
    for step, s in zip((1, 2), sent):
        buckets = _buckets(step)
        assert s["buckets"] == len(buckets)
        assert s["tensors"] == sum(len(b) for b in buckets)
        assert s["bytes"] == sum(t.numel() * t.element_size() for b in buckets for _, t in b)
        assert s["seconds"] >= 0
    for rank in range(1, 1 + RECEIVERS):
        got = [r["stats"] for r in synced[rank]["rounds"]]
        assert [{k: v for k, v in g.items() if k != "seconds"} for g in got] == \
               [{k: v for k, v in s.items() if k != "seconds"} for s in sent]


def test_sync_group_is_independent_of_the_default_group(synced):
    assert synced[0]["default_group_ok"] and synced[1]["default_group_ok"]


# ---------------------------------------------------------------------------------------------- in one process
def _pair():
    """Both ranks of a two-rank sync group, in this process (each round: one of them in a thread)."""
    g0 = WeightSyncGroup(HOST, 0, 0, 2, "gloo", "cpu", timeout_s=60)
    return g0, WeightSyncGroup(HOST, g0.port, 1, 2, "gloo", "cpu", timeout_s=60)


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_roles_and_a_half_read_round_refused():
    g0, g1 = _pair()
    try:
        with pytest.raises(RuntimeError, match="rank 0 .* is the sender"):
            g0.receive()
        with pytest.raises(RuntimeError, match="only rank 0"):
            g1.send([])
        t, box = _in_thread(lambda: g0.send(_buckets(1)))
        received = g1.receive()
        first = next(received)
        assert [n for n, _ in first] == [n for n, _ in _buckets(1)[0]]
        rest = list(received)  # read the round to its end so that the sender finishes
        t.join(timeout=60)
        assert "error" not in box and len(rest) == len(_buckets(1)) - 1

        t, box = _in_thread(lambda: g0.send(_buckets(2)))
        received = g1.receive()
        next(received)
        with pytest.raises(RuntimeError, match="out of step"):
            g1.receive()
        list(received)
        t.join(timeout=60)
    finally:
        g0.close()
        g1.close()
    with pytest.raises(RuntimeError, match="after close"):
        g0.send([])


def test_a_failing_export_reaches_the_receivers():
    g0, g1 = _pair()

    def export():
        yield _buckets(1)[0]
        raise ValueError("gather failed")
    try:
        t, box = _in_thread(lambda: g0.send(export()))
        got = []
        with pytest.raises(RuntimeError, match="sender failed in round 1: ValueError: gather failed"):
            for bucket in g1.receive():
                got.append(bucket)
        t.join(timeout=60)
        assert isinstance(box.get("error"), ValueError) and len(got) == 1
        t, box = _in_thread(lambda: g0.send(_buckets(2)[:1]))  # the group stays usable
        assert [n for b in g1.receive() for n, _ in b] == [n for n, _ in _buckets(2)[0]]
        t.join(timeout=60)
        assert "error" not in box
    finally:
        g0.close()
        g1.close()


# ---------------------------------------------------------------------------------------------- no network
def test_collective_backend():
    assert [collective_backend(d) for d in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(ValueError, match="expected one of cpu, cuda, npu"):
        collective_backend("tpu")


def test_hccl_without_torch_npu_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` raises ImportError
    with pytest.raises(RuntimeError, match=r"needs torch_npu.*pip install 'qwen35rl\[npu\]'"):
        WeightSyncGroup(HOST, 0, 0, 2, "hccl", "npu")


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one rollout worker"):
        WeightSyncGroup(HOST, 0, 0, 1, "gloo", "cpu")
    with pytest.raises(ValueError, match="backend 'mpi'"):
        WeightSyncGroup(HOST, 0, 0, 2, "mpi", "cpu")
    with pytest.raises(ValueError, match="only rank 0 may pass port=0"):
        WeightSyncGroup(HOST, 0, 1, 2, "gloo", "cpu")
    if not dist.is_nccl_available():
        with pytest.raises(RuntimeError, match="no NCCL"):
            WeightSyncGroup(HOST, 0, 0, 2, "nccl", "cuda")
    else:
        with pytest.raises(ValueError, match="communicates on cuda"):
            WeightSyncGroup(HOST, 0, 0, 2, "nccl", "cpu")

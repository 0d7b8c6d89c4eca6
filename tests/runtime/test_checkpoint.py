"""Checkpoint directory handling: only committed checkpoints count, a half-written save is ignored and cleaned,
resume modes, pruning, and RNG state round trips."""
import os
import random

import numpy as np
import pytest
import torch

from qwen35rl.runtime import checkpoint as ckpt


def _save(mgr, step, payload=b"x"):
    tmp = mgr.begin(step)
    (tmp / "blob").write_bytes(payload)
    return mgr.commit(tmp, step)


def test_commit_is_what_makes_a_checkpoint(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path / "checkpoints", max_keep=0)
    assert mgr.latest() is None
    _save(mgr, 3)
    half = mgr.begin(6)                       # a save killed before its commit
    (half / "blob").write_bytes(b"partial")
    assert mgr.latest().name == "step_3"
    assert mgr.resolve("auto").name == "step_3"
    # a step_N directory without meta.json (e.g. copied by hand, incomplete) is not picked up either
    (tmp_path / "checkpoints" / "step_9").mkdir()
    assert mgr.latest().name == "step_3"
    mgr.remove_partial()
    assert not half.exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3", "step_9"]


def test_steps_sort_numerically_and_prune(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path, max_keep=2)
    for step in (2, 10, 4):
        _save(mgr, step)
    assert [p.name for p in mgr.completed()] == ["step_4", "step_10"]
    assert not (tmp_path / "step_2").exists()


def test_recommit_same_step_replaces(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path, max_keep=0)
    _save(mgr, 5, b"old")
    final = _save(mgr, 5, b"new")
    assert (final / "blob").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["step_5"]
    assert ckpt.read_meta(final)["step"] == 5


def test_resume_modes(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path / "c")
    assert mgr.resolve("never") is None
    assert mgr.resolve("auto") is None
    path = _save(mgr, 1)
    assert mgr.resolve("never") is None
    assert mgr.resolve(str(path)) == path
    with pytest.raises(ckpt.CheckpointError, match="not a finished checkpoint"):
        mgr.resolve(str(tmp_path / "nowhere"))


def test_rng_round_trip(tmp_path):
    ckpt.save_rng(tmp_path, rank=1)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)   # move every generator on
    assert ckpt.load_rng(tmp_path, rank=1)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert not ckpt.load_rng(tmp_path, rank=0)   # no state for a rank that did not save


def test_trainer_state_round_trip(tmp_path):
    state = {"step": 7, "loader": {"epoch": 1, "position": 3}, "rng": ckpt.rng_state()}
    ckpt.save_trainer_state(tmp_path, state)
    back = ckpt.load_trainer_state(tmp_path)
    assert back["step"] == 7 and back["loader"] == {"epoch": 1, "position": 3}


def test_a_megatron_checkpoint_resumes_only_on_its_own_layout(tmp_path, caplog):
    """Refused before any worker starts, with both layouts named; FSDP checkpoints reshard (DCP) and pass."""
    from qwen35rl.config import capabilities
    from qwen35rl.config.compose import compose
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.config.problems import EXIT_CONFIG
    from qwen35rl.runtime.driver import run_training

    def record(*overrides):
        cfg = compose(list(overrides))
        return capabilities.checkpoint_layout(cfg, derive_layout(cfg))

    tp2 = ["backend=megatron", "hw.devices_per_node=2", "parallelism.tp=2"]
    mgr = ckpt.CheckpointManager(tmp_path / "checkpoints")
    mgr.commit(mgr.begin(1), 1, {"checkpoint_layout": record(*tp2)})
    cfg = compose(["backend=megatron", "hw.devices_per_node=2", "trainer.resume=auto"])
    assert run_training(cfg, tmp_path) == EXIT_CONFIG
    assert "resume_needs_saved_layout" in caplog.text and "tp: 2 -> 1" in caplog.text
    assert mgr.latest().name == "step_1"  # nothing lost

    assert capabilities.resume_problem(record(*tp2), record(*tp2)) is None
    moved = capabilities.resume_problem(record(*tp2, "backend.optimizer_cpu_offload=false"), record(*tp2))
    assert moved.code == "resume_needs_saved_layout" and "optimizer_cpu_offload" in moved.message
    fsdp4, fsdp2 = record("backend=fsdp", "hw.devices_per_node=4"), record("backend=fsdp", "parallelism.sp=2")
    assert capabilities.resume_problem(fsdp4, fsdp2) is None
    assert capabilities.resume_problem(record(*tp2), fsdp2).code == "resume_across_engines"
    assert capabilities.resume_problem(None, fsdp2) is None  # older checkpoints recorded no layout: FSDP reshards
    assert capabilities.resume_problem(None, record(*tp2)).code == "resume_layout_unknown"


# ------------------------------------------------------------------------------------------- verified on load
def _real(mgr, step):
    """A checkpoint shaped like the trainer's: DCP-like shard files, per-rank RNG, trainer state."""
    tmp = mgr.begin(step)
    (tmp / ckpt.MODEL_DIR).mkdir()
    (tmp / ckpt.MODEL_DIR / "__0_0.distcp").write_bytes(os.urandom(4096))
    (tmp / ckpt.MODEL_DIR / ".metadata").write_bytes(b"m" * 100)
    ckpt.save_rng(tmp, rank=0)
    ckpt.save_trainer_state(tmp, {"step": step})
    return mgr.commit(tmp, step)


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, said", [
    (lambda c: _truncate(c / "model" / "__0_0.distcp"), "model/__0_0.distcp is 2048 bytes, 4096 when saved"),
    (lambda c: _truncate(c / "trainer_state.pt"), "trainer_state.pt is"),
    (lambda c: (c / "meta.json").write_text(""), "meta.json is empty"),
    (lambda c: (c / "meta.json").write_text('{"step": 3, "fil'), "meta.json is not valid JSON"),
    (lambda c: (c / "rng" / "rank_0.pt").unlink(), "rng/rank_0.pt is missing"),
    (lambda c: (c / "model" / ".metadata").write_bytes(b"n" * 100), "model/.metadata does not match its checksum"),
])
def test_a_damaged_newest_checkpoint_is_named_moved_aside_and_skipped_for_the_older_one(tmp_path, caplog, damage,
                                                                                        said):
    mgr = ckpt.CheckpointManager(tmp_path, max_keep=0)
    _real(mgr, 2)
    newest = _real(mgr, 3)
    assert ckpt.verify(newest) is None
    damage(newest)
    files = sorted(str(p.relative_to(newest)) for p in newest.rglob("*"))
    with caplog.at_level("WARNING", logger="qwen35rl.runtime.checkpoint"):
        assert mgr.resolve("auto").name == "step_2"
    (moved,) = tmp_path.glob("step_3.incomplete-*")
    assert not newest.exists() and sorted(str(p.relative_to(moved)) for p in moved.rglob("*")) == files  # kept whole
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {newest} skipped: {said}")
    assert lines[0].endswith(f"; moved aside to {moved} (kept, not deleted)")
    assert [p.name for p in mgr.completed()] == ["step_2"]
    with pytest.raises(ckpt.CheckpointError, match=f"damaged: {said}.*trainer.resume=.*step_2"):
        mgr.resolve(str(moved))


def test_only_damaged_checkpoints_resume_from_scratch(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path, max_keep=0)
    _truncate(_real(mgr, 1) / "trainer_state.pt")
    assert mgr.resolve("auto") is None and mgr.latest(verified=False) is None
    assert [p.name.split(".")[0] for p in tmp_path.glob("step_1.incomplete-*")] == ["step_1"]


def test_an_incomplete_step_directory_is_moved_aside_never_overwritten(tmp_path, caplog):
    """step_4 without meta.json (its meta.json deleted, or copied in part) and step_3 with a missing shard: the
    resume names both and moves them aside; saving steps 3 and 4 again writes new directories beside them."""
    mgr = ckpt.CheckpointManager(tmp_path, max_keep=0)
    for step in (2, 3, 4):
        _real(mgr, step)
    (tmp_path / "step_4" / "meta.json").unlink()
    (tmp_path / "step_3" / "rng" / "rank_0.pt").unlink()
    with caplog.at_level("WARNING", logger="qwen35rl.runtime.checkpoint"):
        assert mgr.resolve("auto") == tmp_path / "step_2"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2
    assert said[0].startswith(f"checkpoint {tmp_path / 'step_4'} skipped: no meta.json (a copy made in part, or its "
                              f"meta.json deleted); moved aside to {tmp_path / 'step_4.incomplete-'}")
    assert said[1].startswith(f"checkpoint {tmp_path / 'step_3'} skipped: rng/rank_0.pt is missing; moved aside")
    aside = sorted(tmp_path.glob("*.incomplete-*"))
    for step in (3, 4):
        _real(mgr, step)
    assert sorted(tmp_path.glob("*.incomplete-*")) == aside
    assert (aside[1] / "model" / "__0_0.distcp").is_file() and not (aside[1] / "meta.json").exists()
    assert [p.name for p in mgr.completed()] == ["step_2", "step_3", "step_4"]


def test_a_save_that_finds_an_incomplete_directory_in_its_way_moves_it_aside(tmp_path, caplog):
    """An explicit trainer.resume of an older checkpoint does not look at newer ones; the save of the same step
    still never writes over a directory without meta.json."""
    mgr = ckpt.CheckpointManager(tmp_path, max_keep=0)
    stray = tmp_path / "step_5"
    (stray / "model").mkdir(parents=True)
    (stray / "model" / "__0_0.distcp").write_bytes(b"x" * 10)
    with caplog.at_level("WARNING", logger="qwen35rl.runtime.checkpoint"):
        saved = _real(mgr, 5)
    (aside,) = tmp_path.glob("step_5.incomplete-*")
    assert (aside / "model" / "__0_0.distcp").read_bytes() == b"x" * 10
    assert ckpt.verify(saved) is None and "moved aside" in caplog.text


def test_a_checkpoint_written_before_file_lists_still_loads(tmp_path):
    """meta.json without `files`: accepted when its trainer state loads; a truncated one is still caught."""
    import json

    mgr = ckpt.CheckpointManager(tmp_path, max_keep=0)
    path = _real(mgr, 4)
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    (path / "meta.json").write_text(json.dumps(meta))
    assert ckpt.verify(path) is None and mgr.resolve("auto") == path
    _truncate(path / "trainer_state.pt")
    assert ckpt.verify(path).startswith("trainer_state.pt does not load")


def test_meta_lists_files_and_is_written_atomically(tmp_path):
    import time

    mgr = ckpt.CheckpointManager(tmp_path, max_keep=0)
    path = _real(mgr, 1)
    files = ckpt.read_meta(path)["files"]
    assert sorted(files) == ["model/.metadata", "model/__0_0.distcp", "rng/rank_0.pt", "trainer_state.pt"]
    assert files["model/__0_0.distcp"]["size"] == 4096
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model", "rng", "trainer_state.pt"]  # no temp
    t0 = time.perf_counter()
    assert ckpt.verify(path) is None
    assert time.perf_counter() - t0 < 0.5


def test_explicit_resume_of_a_damaged_checkpoint_exits_2_before_anything_starts(tmp_path, caplog, monkeypatch):
    from qwen35rl.config.compose import compose
    from qwen35rl.runtime import driver

    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(driver, "launcher", no_launch)
    mgr = ckpt.CheckpointManager(tmp_path / "checkpoints")
    bad = _real(mgr, 1)
    (bad / "meta.json").write_text("")
    cfg = compose(["trainer.launcher=local", "hw.devices_per_node=1", f"trainer.resume={bad}"])
    assert driver.run_training(cfg, tmp_path) == 2
    assert f"trainer.resume={bad}: the checkpoint is damaged: meta.json is empty" in caplog.text


# ------------------------------------------------------------------------- DCP failures, raised as what they are
def _dcp_failure(exc):
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def raise_it():
        raise CheckpointException("CheckpointException ranks:[0]", {0: _wrap_exception(exc)})
    return raise_it


def test_a_dcp_write_cut_by_the_stop_timeout_raises_the_stop_itself():
    try:  # as torch.save's zip writer does: the interrupt, then its own error while closing the file
        try:
            raise KeyboardInterrupt("SIGINT, and the step did not finish within 75 s (trainer.stop_timeout_s)")
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:
        write_error = e
    with pytest.raises(KeyboardInterrupt, match="stop_timeout_s"):
        ckpt._dcp(_dcp_failure(write_error), "writing x")


def test_a_dcp_failure_is_an_exception_and_a_full_disk_stays_one(tmp_path):
    import errno

    from qwen35rl.runtime.disk_full import disk_full

    with pytest.raises(RuntimeError, match=r"writing x failed on rank\(s\) \[0\]: OSError") as e:
        ckpt._dcp(_dcp_failure(OSError(errno.ENOSPC, "No space left on device")), "writing x")
    assert disk_full(e.value)
    with pytest.raises(RuntimeError, match="ValueError: bad shard"):
        ckpt._dcp(_dcp_failure(ValueError("bad shard")), "reading y")


def test_a_real_dcp_save_into_an_impossible_place_is_an_exception(tmp_path):
    class Engine:
        def state_dict_for_checkpoint(self):
            return {"w": torch.ones(3)}

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(Exception, match="writing .*failed"):  # an Exception: the driver's failure block reports it
        ckpt.save_engine_state(blocker / "step_1", Engine())

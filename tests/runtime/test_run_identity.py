"""Run identity: which config changes a resume refuses (the experiment), allows and shows (hardware, layout, engine
knobs, length, paths) or ignores (trackers, names, launcher, timeouts); `trainer.resume=never|force`; a finished
run is "already complete"; a fresh start moves an earlier run's outputs aside."""
import json
import logging

from qwen35rl.config.compose import compose
from qwen35rl.config.problems import EXIT_CONFIG
from qwen35rl.runtime import checkpoint as ckpt
from qwen35rl.runtime import provenance, run_identity
from qwen35rl.runtime.run_identity import settle

BASE = ["trainer.launcher=local", "hw.devices_per_node=1", "trainer.total_steps=2"]


def _keys(changes):
    return {c.key for c in changes}


def test_a_change_is_experiment_allowed_or_ignored():
    saved = compose(BASE)
    now = compose([*BASE, "algorithm=dr_grpo", "data.train_batch_size=4", "rollout.temperature=0.7", "trainer.seed=3",
                   "backend.lr=0.0005", "data.max_response_length=6",                        # the experiment
                   "hw.devices_per_node=2", "trainer.launcher=ray", "trainer.total_steps=9",  # how / bookkeeping
                   "backend.micro_batch_size_per_device=4", "rollout.max_num_seqs=8", "trainer.save_freq=5",
                   "trainer.trackers=[console]", "trainer.run_name=other", "data.reward_timeout_s=3",
                   "trainer.placement_timeout_s=9", "+hw.env.NCCL_DEBUG=INFO"])
    from omegaconf import OmegaConf

    experiment, allowed = run_identity.compare(OmegaConf.to_container(saved, resolve=True),
                                               OmegaConf.to_container(now, resolve=True))
    assert _keys(experiment) == {"algorithm.name", "algorithm.loss_agg_mode", "algorithm.norm_adv_by_std",
                                 "data.train_batch_size", "rollout.temperature", "trainer.seed", "backend.lr",
                                 "data.max_response_length"}
    assert _keys(allowed) == {"hw.devices_per_node", "trainer.total_steps", "backend.micro_batch_size_per_device",
                              "rollout.max_num_seqs", "trainer.save_freq"}
    by_key = {c.key: c for c in experiment}
    assert by_key["algorithm.norm_adv_by_std"].render() == "algorithm.norm_adv_by_std: true -> false"
    # a tokenizer directory that moved is a path; another built-in tokenizer is another experiment
    assert run_identity.key_class("model.tokenizer", "/a/tok", "/b/tok") == run_identity.HOW
    assert run_identity.key_class("model.tokenizer", "byte", "qwen") == run_identity.EXPERIMENT


def _run_dir(tmp_path, overrides, step=2, export=True):
    """A run directory as a finished (or interrupted) run leaves it: its start's config, a checkpoint naming that
    start, an export."""
    run = tmp_path / "run"
    start = provenance.record_start(run, compose(overrides), argv=["qwen35rl-train"])
    mgr = ckpt.CheckpointManager(run / "checkpoints")
    tmp = mgr.begin(step)
    ckpt.save_trainer_state(tmp, {"step": step})
    mgr.commit(tmp, step, {"total_steps": 2, run_identity.PROVENANCE_KEY: start.name})
    if export:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "critic/score/mean": s / 10,
                                                           "timing_s/step": 1.0, "perf/total_num_tokens": 100.0})
                                               + "\n" for s in range(1, step + 1)))
    return run


def test_a_changed_experiment_is_refused_with_the_diff_and_the_ways_out(tmp_path, caplog):
    run = _run_dir(tmp_path, BASE, step=1)
    changed = [*BASE, "algorithm=dr_grpo", "hw.devices_per_node=2", "trainer.launcher=ray"]
    with caplog.at_level(logging.INFO):
        d = run_identity.decide(compose(changed), run)
    assert d.exit_code == EXIT_CONFIG and d.checkpoint == run / "checkpoints" / "step_1"
    block = caplog.text
    assert f"{run} holds a run made with another config; resuming its checkpoint step_1" in block
    assert f"saved in {run}/provenance/start-001/config.yaml -> now" in block
    assert "algorithm.name: grpo -> dr_grpo" in block and "hw.devices_per_node: 1 -> 2" in block
    assert "trainer.launcher" not in block
    for way_out in ("trainer.resume=never", "trainer.run_name=<name>", "trainer.resume=force"):
        assert way_out in block

    caplog.clear()
    with caplog.at_level(logging.INFO):
        forced = run_identity.decide(compose([*changed, "trainer.resume=force"]), run)
    assert forced.exit_code is None and forced.checkpoint == run / "checkpoints" / "step_1"
    assert "although the experiment changed" in caplog.text and "algorithm.name: grpo -> dr_grpo" in caplog.text
    assert run_identity.decide(compose([*changed, "trainer.resume=never"]), run).checkpoint is None

    caplog.clear()  # only what a resume allows: shown, resumed
    with caplog.at_level(logging.INFO):
        moved = run_identity.decide(compose([*BASE, "hw.devices_per_node=2", "trainer.total_steps=4"]), run)
    assert moved.exit_code is None and _keys(moved.allowed) == {"hw.devices_per_node", "trainer.total_steps"}
    assert "resuming with changes the run allows" in caplog.text and "trainer.total_steps: 2 -> 4" in caplog.text


def test_a_finished_run_is_already_complete(tmp_path, caplog):
    run = _run_dir(tmp_path, BASE)
    with caplog.at_level(logging.INFO):
        d = settle(compose(BASE), run)
    assert (d.exit_code, d.complete) == (0, (2, 2))
    err = caplog.text
    assert "already complete (step 2 of 2)" in err
    assert "critic/score/mean 0.1 at step 1 -> 0.2 at step 2" in err and "/final/ (Hugging Face format)" in err
    # more steps, or no export yet: not complete (the run goes on from its checkpoint)
    assert settle(compose([*BASE, "trainer.total_steps=3"]), run).exit_code is None
    assert settle(compose(BASE), _run_dir(tmp_path / "b", BASE, export=False)).exit_code is None
    assert settle(compose([*BASE, "trainer.export_hf=false"]), _run_dir(tmp_path / "c", BASE, export=False)).complete


def test_a_fresh_start_moves_the_earlier_run_aside(tmp_path):
    run = _run_dir(tmp_path, BASE)
    (run / "train.log").write_text("kept\n")
    dest = run_identity.start_over(run)
    assert dest.parent == run / "superseded"
    assert sorted(p.name for p in dest.iterdir()) == ["checkpoints", "final", "metrics.jsonl", "provenance"]
    assert sorted(p.name for p in run.iterdir()) == ["superseded", "train.log"]
    assert run_identity.start_over(run) is None  # nothing left to move


def test_a_wandb_run_id_stays_over_resumes_and_changes_after_a_start_over(tmp_path):
    from qwen35rl.runtime.tracking import _stable_id

    run = _run_dir(tmp_path, BASE)
    first = _stable_id(run)
    assert first == provenance.run_id(run / "provenance") and len(first) == 16
    resumed = provenance.record_start(run, compose(BASE), start_step=2)  # a resume: start-002
    assert _stable_id(run) == first == json.loads((resumed / "run.json").read_text())["run_id"]
    run_identity.start_over(run)
    provenance.record_start(run, compose(BASE))  # the new run's start-001
    assert _stable_id(run) != first


def test_checkpoints_in_a_directory_of_their_own_are_resumed_and_named(tmp_path):
    from qwen35rl.runtime.signals import last_checkpoint

    elsewhere = tmp_path / "store" / "ckpts"
    mine = [*BASE, f"trainer.checkpoint_dir={elsewhere}"]
    run = tmp_path / "run"
    start = provenance.record_start(run, compose(mine), argv=["qwen35rl-train"])
    root = ckpt.checkpoint_dir(run, compose(mine))
    assert root == elsewhere
    mgr = ckpt.CheckpointManager(root)
    tmp = mgr.begin(1)
    ckpt.save_trainer_state(tmp, {"step": 1})
    mgr.commit(tmp, 1, {"total_steps": 2, run_identity.PROVENANCE_KEY: start.name})
    assert not (run / "checkpoints").exists()

    resumed = run_identity.decide(compose(mine), run)  # trainer.resume=auto looks there
    assert resumed.exit_code is None and resumed.checkpoint == elsewhere / "step_1"
    refused = run_identity.decide(compose([*mine, "algorithm=dr_grpo"]), run)  # compared with the run's own record
    assert refused.exit_code == EXIT_CONFIG and refused.saved_file == run / "provenance" / "start-001" / "config.yaml"
    assert str(elsewhere / "step_1") in last_checkpoint(run)  # the reports that know only the run directory
    assert run_identity.decide(compose(BASE), run).checkpoint is None  # null: the run directory's checkpoints/

    dest = run_identity.start_over(run, elsewhere)  # a fresh start: the directory stays, its steps move aside
    assert dest.parent == run / "superseded"
    aside = [p for p in (elsewhere / "superseded").iterdir()]
    assert len(aside) == 1 and [p.name for p in aside[0].iterdir()] == ["step_1"]
    assert ckpt.CheckpointManager(elsewhere).latest() is None

"""`qwen35rl-train`'s jobs: a single run is composed, resolved and checked once (the Hydra job takes the config `main`
checked; a job whose config differs is checked on its own), and a sweep stopped by a signal starts no further job."""
import pytest

from qwen35rl.cli import train as T
from qwen35rl.config import layout_search


@pytest.fixture
def counted(monkeypatch, tmp_path):
    calls = {"search": 0, "trained": []}
    search = layout_search.search

    def counting(*a, **k):
        calls["search"] += 1
        return search(*a, **k)

    monkeypatch.setattr(layout_search, "search", counting)
    import qwen35rl.runtime.entry as entry

    monkeypatch.setattr(entry, "train", lambda run, run_dir: calls["trained"].append((run, run_dir)) or 0)
    monkeypatch.chdir(tmp_path)
    return calls


def test_a_single_run_searches_its_layout_once(counted, tmp_path):
    assert T.main(["parallelism=auto", f"trainer.output_root={tmp_path}/runs"]) == 0
    assert counted["search"] == 1
    ((run, run_dir),) = counted["trained"]
    cfg = run.cfg
    assert cfg.parallelism.auto is False and str(cfg.parallelism.name).startswith("auto/")  # the searched layout
    assert run.candidates and run.run_dir == str(run_dir)  # the job's directory, where main only foresaw it
    assert T._checked == {}  # nothing is kept for a later call


def test_a_job_with_another_config_is_checked_on_its_own(counted, tmp_path, monkeypatch):
    original = T._train_job

    def job(cfg):  # as if Hydra's job had composed something else than main checked
        composed, resolved, problems = T._checked["run"]
        T._checked["run"] = ({**composed, "seed_of_another_config": 1}, resolved, problems)
        return original(cfg)

    monkeypatch.setattr(T, "_train_job", job)
    assert T.main(["parallelism=auto", f"trainer.output_root={tmp_path}/runs"]) == 0
    assert counted["search"] == 2 and len(counted["trained"]) == 1


def test_a_sweep_stopped_by_a_signal_starts_no_further_job(counted, tmp_path, monkeypatch, capsys):
    import qwen35rl.runtime.entry as entry
    from qwen35rl.exit_codes import EXIT_TERMINATED

    monkeypatch.setattr(entry, "train", lambda run, run_dir: counted["trained"].append(run) or EXIT_TERMINATED)
    code = T.main(["-m", "trainer.seed=1,2,3", f"trainer.output_root={tmp_path}/runs",
                   f"hydra.sweep.dir={tmp_path}/sweep"])
    assert len(counted["trained"]) == 1 and T._exit_codes == [EXIT_TERMINATED] * 3
    assert code == EXIT_TERMINATED and "the sweep was stopped" in capsys.readouterr().err

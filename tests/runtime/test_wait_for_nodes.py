"""The bring-up scripts' wait for Ray nodes: returns once enough nodes are up, fails with a count otherwise."""
import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ray = pytest.importorskip("ray")

from qwen35rl.runtime.wait_for_nodes import main  # noqa: E402


def test_waits_for_nodes_and_reports_a_shortfall(capsys):
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        assert main(["1"]) == 0
        assert "1 Ray node(s) up" in capsys.readouterr().out
        with pytest.raises(SystemExit, match="only 1 of 2 Ray nodes joined"):
            main(["2", "auto", "0"])
    finally:
        ray.shutdown()

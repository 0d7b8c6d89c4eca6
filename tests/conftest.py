"""Test-wide settings: one torch thread (2-thread torch on a busy 2-core machine is many times slower), no Ray
token auth, and the repository root on sys.path."""
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(session, config, items):
    """The vllm suite's environment starts building in the background as soon as its test is selected."""
    if any(item.nodeid.startswith("tests/test_vllm_suite.py") for item in items):
        from tests import vllm_build

        vllm_build.start()


def pytest_sessionfinish(session, exitstatus):
    from tests import vllm_build

    vllm_build.stop()


@pytest.fixture(autouse=True)
def _logging_restored():
    """Commands run in-process (a Hydra multirun configures job logging per job) leave file handlers on the root
    logger pointing into that test's temporary directory; later tests would log into it. Each test gets the logging
    it started with back."""
    import logging

    loggers = [logging.getLogger()] + [
        logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith("qwen35rl")
    ]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers]
    yield
    for lg, handlers, level, propagate, disabled in saved:
        for h in lg.handlers:
            if h not in handlers and isinstance(h, logging.FileHandler):
                h.close()
        lg.handlers[:] = handlers
        lg.level, lg.propagate, lg.disabled = level, propagate, disabled

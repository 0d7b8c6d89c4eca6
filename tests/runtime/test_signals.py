"""StopRequest: during start-up a signal stops at once; in the loop the first one lets the step finish within
trainer.stop_timeout_s, after which (or at a second signal) the main thread is interrupted wherever it waits; while
the run shuts down a signal is only noted."""
import os
import signal
import time

import pytest

from qwen35rl.runtime.signals import StopRequest, last_checkpoint


def test_during_start_up_a_signal_stops_at_once():
    with StopRequest(timeout_s=30) as stop:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    assert stop.exit_code == 143 and stop.abandoned and stop.reason == "SIGTERM"


def test_in_the_loop_the_step_gets_its_time_then_the_wait_is_interrupted():
    with StopRequest(timeout_s=1) as stop:
        stop.run_loop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and not stop.abandoned  # noted: the step goes on
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            time.sleep(120)  # a step that would not finish: a blocking wait, as in a worker call or a hung reward
        waited = time.monotonic() - t0
    assert 0.5 < waited < 60, waited
    assert stop.abandoned and stop.exit_code == 143
    assert stop.reason == "SIGTERM, and the step did not finish within 1 s (trainer.stop_timeout_s)"


def test_a_second_signal_interrupts_at_once_and_a_finished_step_cancels_the_timeout():
    with StopRequest(timeout_s=1) as stop:
        stop.run_loop()
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
    assert stop.reason == "a second SIGINT" and stop.exit_code == 130

    with StopRequest(timeout_s=1) as stop:
        stop.run_loop()
        os.kill(os.getpid(), signal.SIGTERM)
        stop.ending()  # the step and its checkpoint were done in time: the run shuts down
        time.sleep(2)  # past the timeout: nothing interrupts the clean-up
    assert stop.requested and not stop.abandoned and stop.exit_code == 143


def test_while_shutting_down_a_signal_is_noted_and_only_a_second_one_interrupts():
    with StopRequest(timeout_s=1) as stop:
        stop.run_loop()
        stop.ending()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        assert stop.requested and stop.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)


def test_the_last_checkpoint_is_named(tmp_path):
    assert last_checkpoint(tmp_path) == "no checkpoint yet: the same command starts again at step 0"
    step = tmp_path / "checkpoints" / "step_7"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 7}')
    assert last_checkpoint(tmp_path) == f"the same command resumes from the last checkpoint, {step} (step 7)"

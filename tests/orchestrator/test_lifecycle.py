"""RunLifecycle: how a run ends decides how it leaves Ray and closes its reporter, and the signal handlers it
installed are the process's old ones again, whatever the end."""
import signal
from contextlib import nullcontext

import pytest

import hacpo_megatron.orchestrator.lifecycle as lifecycle_module
from hacpo_megatron.orchestrator.lifecycle import RunLifecycle
from hacpo_megatron.orchestrator.preemption import Preempted


class Reporter:
    failed = None

    def close(self, failed: bool) -> None:
        self.failed = failed


def previous_handler(signum, frame):  # stands for what the process had installed before the run
    raise AssertionError("never called")


@pytest.mark.parametrize("ending, orderly", [
    (None, True),  # the last step done
    (Preempted("SIGTERM", 3, "out/checkpoints/step_00000003"), True),  # stopped at a step boundary, checkpoint written
    (RuntimeError("an engine failed four times"), False),
    (SystemExit(2), False),  # e.g. no intact checkpoint to resume from, before the first step
])
def test_the_end_decides_how_ray_is_left_and_the_reporter_closed(monkeypatch, ending, orderly):
    left = []
    monkeypatch.setattr(lifecycle_module, "leave_ray",
                        lambda runtime, reward_actor, *, orderly: left.append((runtime, reward_actor, orderly)))
    before = signal.signal(signal.SIGTERM, previous_handler)
    try:
        reporter = Reporter()
        with pytest.raises(type(ending)) if ending is not None else nullcontext():
            with RunLifecycle(ray_address=None) as lifecycle:
                assert lifecycle.reporting(reporter) is reporter
                lifecycle.watch_signals()
                assert signal.getsignal(signal.SIGTERM) is not previous_handler  # the guard's, during the run
                if ending is not None:
                    raise ending
        assert left == [(None, None, orderly)]  # no Ray started here: nothing to stop, but every rank leaves
        assert reporter.failed is (not orderly)
        assert signal.getsignal(signal.SIGTERM) is previous_handler
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_failure_before_the_signal_handlers_and_the_reporter_still_leaves_ray(monkeypatch):
    left = []
    monkeypatch.setattr(lifecycle_module, "leave_ray", lambda *args, orderly: left.append(orderly))
    with pytest.raises(FileNotFoundError):
        with RunLifecycle(ray_address=None):
            raise FileNotFoundError("train.jsonl")  # e.g. the prompt sets, read after Ray started
    assert left == [False]

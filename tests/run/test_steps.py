"""The profiler's recorders on CPU: named steps partition a call (no nesting), the unprofiled recorder
costs nothing (the clock offsets: tests/run/test_clocks.py)."""

from __future__ import annotations

import time

import pytest
import torch

from commbench.run.steps import NO_STEPS, StepRecorder


def test_steps_are_recorded_in_order_with_their_durations() -> None:
    recorder = StepRecorder(torch.device("cpu"))
    recorder.begin()
    with recorder("pack"):
        time.sleep(0.01)
    with recorder("payload transfer"):
        time.sleep(0.02)
    recorder.peer_arrival(3)
    recorder.peer_arrival(3)  # the first sighting counts
    recorder.end()
    (iteration,) = recorder.take()
    assert [name for name, _, _ in iteration.steps] == ["pack", "payload transfer"]
    durations = [end - start for _, start, end in iteration.steps]
    assert 0.009 < durations[0] < 0.05 and 0.019 < durations[1] < 0.06
    assert iteration.steps[0][2] <= iteration.steps[1][1]  # one after the other
    assert list(iteration.peer_arrivals) == [3]
    assert recorder.take() == []


def test_steps_do_not_nest_and_the_unprofiled_recorder_is_free() -> None:
    recorder = StepRecorder(torch.device("cpu"))
    recorder.begin()
    with pytest.raises(RuntimeError, match="inside step 'pack'"), recorder("pack"), recorder("inner"):
        pass
    assert NO_STEPS("anything") is NO_STEPS("other")  # one shared no-op context
    with NO_STEPS("pack"):
        NO_STEPS.peer_arrival(1)
    assert not NO_STEPS.enabled


@pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")
def test_cuda_steps_are_timed_by_events_and_marked_with_nvtx() -> None:
    device = torch.device("cuda", 0)
    recorder = StepRecorder(device)
    matrix = torch.randn(2048, 2048, device=device)
    recorder.begin()
    with recorder("pack"):
        product = matrix @ matrix
    with recorder("payload transfer"):
        product = product @ matrix
    torch.cuda.synchronize(device)
    recorder.end()
    (iteration,) = recorder.take()
    assert [name for name, _, _ in iteration.steps] == ["pack", "payload transfer"]
    durations = [end - start for _, start, end in iteration.steps]
    assert all(0 < duration < 5.0 for duration in durations)  # GPU time of one 2048^3 matmul each
    assert iteration.steps[0][2] <= iteration.steps[1][1] + 1e-6  # in stream order

"""The profiler's recorders on CPU: named steps partition a call (no nesting), the unprofiled recorder
costs nothing, and the clock offsets of ranks on one host come out at 0 within their uncertainty."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from commbench.run.clocks import ClockOffsets, estimate_offsets
from commbench.run.dist import launch
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


def _offsets(comm: Any) -> ClockOffsets:
    return estimate_offsets(comm, rounds=5)


def test_ranks_of_one_host_have_zero_offset_within_the_uncertainty() -> None:
    offsets = launch(3, _offsets, (), "gloo", 60)
    assert offsets.offset_s[0] == 0.0 and offsets.uncertainty_s[0] == 0.0
    for rank in (1, 2):
        # One CLOCK_MONOTONIC per host: the estimate is 0 up to half a round trip (plus scheduling slack).
        assert 0 < offsets.uncertainty_s[rank] < 0.05
        assert abs(offsets.offset_s[rank]) <= offsets.uncertainty_s[rank] + 0.002
    assert offsets.to_reference(1, 10.0) == pytest.approx(10.0 - offsets.offset_s[1])


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

"""A timed loop's own bookkeeping: each timed call's arrival and wait (``TimedCalls``), and the garbage
collector paused while the loop runs (``collector_paused``)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from commbench.run import torch_profiler
from commbench.run.phases import Phase
from commbench.run.steps import StepRecorder


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the timed loop, as ``timeit`` times: a full pass over rank
    0's heap (pandas and matplotlib loaded) took 21-97 ms here, more than a whole window of small calls.
    The loop allocates next to nothing, and the collector is back on (as it was) when it ends."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class TimedCalls:
    """The phase's timed calls on this rank: each call's arrival (host seconds from ``mark()`` until the
    call begins; the injected delay of ``--inject-delay`` sleeps first) and its wait (from entering the call
    until ``left()``: the call's own work plus the time it waited for its peers)."""

    def __init__(self, phase: Phase, delay_s: float) -> None:
        self.phase = phase
        self.delay_s = delay_s
        self.arrivals: list[float] = []
        self.waits: list[float] = []
        self.entered_at: list[float] = []  # host clock when each call began (the profiler's arrivals)
        self.left_at: list[float] = []
        self.recorder: StepRecorder | None = None  # --profile: the backend's steps of each call
        self._mark = self._entered = time.perf_counter()

    def mark(self) -> None:
        """The start every rank shares: right after the barrier (or the previous call's return)."""
        self._mark = time.perf_counter()

    def __call__(self) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        self._entered = time.perf_counter()
        self.arrivals.append(self._entered - self._mark)
        self.entered_at.append(self._entered)
        if self.recorder is not None:
            self.recorder.begin()
        with torch_profiler.measured(self.phase.label):  # a no-op unless --torch-profiler captures
            return self.phase.call()

    def left(self) -> None:
        """The call is over (iteration timing: after the device synchronized; a window: when it returned)."""
        now = time.perf_counter()
        self.waits.append(now - self._entered)
        self.left_at.append(now)
        if self.recorder is not None:
            self.recorder.end()

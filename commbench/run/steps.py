"""Named steps inside a phase call (the profiler): backends mark "pack", "payload transfer", "signal wait"...
and the harness gets, per timed iteration, each step's duration, its start and end on this rank's clock,
and (where a backend sees it) when each source's data arrived.

A backend wraps the parts of its calls in ``with self.steps("name"):``. By default ``steps`` is the
``NO_STEPS`` recorder, which does nothing (a shared no-op context manager: the unprofiled hot path stays as
it was). Profiling (``--profile``) gives each backend a ``StepRecorder``:

- on CPU, each step's start and end are ``time.perf_counter()`` readings after the work is issued (CPU work
  is synchronous, so the reading is its end); on a GPU, CUDA events on the current stream (resolved after
  the iteration's synchronize, so the recorder never waits inside a timed call) and an NVTX range of the
  same name (Nsight Systems shows it);
- a step inside another is not allowed (steps partition the call; what they do not cover is reported as
  "other": Python glue, buffer growth, the rest of the call);
- ``peer_arrival(src)`` (shmem-emu's signal wait) records when the data of source rank ``src`` was seen.

Times are host seconds on ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process of a host);
``run.clocks`` maps them onto rank 0's clock across hosts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class IterationSteps:
    """One timed iteration's steps on this rank: (name, start, end) host seconds, and per-source arrivals."""

    steps: list[tuple[str, float, float]] = field(default_factory=list)
    peer_arrivals: dict[int, float] = field(default_factory=dict)


class _NoSteps:
    """The recorder of an unprofiled run: every call is free."""

    enabled = False
    _null = contextlib.nullcontext()

    def __call__(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self._null

    def peer_arrival(self, src: int) -> None:
        pass


NO_STEPS = _NoSteps()


class StepRecorder:
    """Records the named steps of this rank's timed calls (module docstring): ``begin()`` before a timed
    call, the backend's ``with recorder(name):`` blocks inside it, ``end()`` after the call synchronized."""

    enabled = True

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.iterations: list[IterationSteps] = []
        self._open: list[tuple[str, Any, Any]] = []  # this iteration's (name, start, end) markers
        self._arrivals: dict[int, float] = {}
        self._anchor: tuple[float, Any] | None = None  # (host time, CUDA event) at begin()
        self._inside = ""

    def begin(self) -> None:
        """A timed call starts: its steps are collected from here."""
        self._open = []
        self._arrivals = {}
        if self.cuda:
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record(torch.cuda.current_stream(self.device))
            self._anchor = (time.perf_counter(), anchor)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self._inside:
            raise RuntimeError(f"profiler step {name!r} inside step {self._inside!r}: steps do not nest")
        self._inside = name
        try:
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda.nvtx.range_push(name)
                start.record(torch.cuda.current_stream(self.device))
                try:
                    yield
                finally:
                    end.record(torch.cuda.current_stream(self.device))
                    torch.cuda.nvtx.range_pop()
                self._open.append((name, start, end))
            else:
                start_s = time.perf_counter()
                yield
                self._open.append((name, start_s, time.perf_counter()))
        finally:
            self._inside = ""

    def peer_arrival(self, src: int) -> None:
        """The data of source rank ``src`` was seen now (host clock); the first sighting counts."""
        self._arrivals.setdefault(int(src), time.perf_counter())

    def end(self) -> None:
        """The timed call is over and synchronized: resolve this iteration's markers into host seconds."""
        steps = []
        if self.cuda and self._anchor is not None:
            host0, anchor = self._anchor
            for name, start, end in self._open:
                begin_s = host0 + anchor.elapsed_time(start) / 1e3
                steps.append((name, begin_s, begin_s + start.elapsed_time(end) / 1e3))
        else:
            steps = [(name, float(start), float(end)) for name, start, end in self._open]
        self.iterations.append(IterationSteps(steps, dict(self._arrivals)))
        self._open = []

    def take(self) -> list[IterationSteps]:
        """Every recorded iteration since the last take (the next phase starts afresh)."""
        taken, self.iterations = self.iterations, []
        return taken

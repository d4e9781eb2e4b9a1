"""What the profiler (``--profile``) keeps of one phase: every rank's timed calls on rank 0's clock, their
named steps, and the long-form rows the report reads (profile.csv, arrivals.csv, trace.json).

Per rank and timed iteration: the host time the rank entered the call and left it (after the device
synchronized), the timer's phase time (CUDA events on GPU), and the backend's steps (``run.steps``). All host
times are mapped onto rank 0's clock with the launch's ``ClockOffsets`` (``run.clocks``) so that arrivals of
different hosts compare. "other" is the phase time the steps do not cover (Python glue, buffer growth, what
a backend does not mark).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from commbench.run.clocks import ClockOffsets
from commbench.run.steps import IterationSteps
from commbench.traffic.nodes import STAGES

OTHER_STEP = "other"
# The steps that move the payload itself (the rest prepares or finishes it): "transfer time" beside the
# API time (the whole phase), as Hybrid-EP and NCCL EP users compare them.
TRANSFER_STEPS = ("payload transfer", "send-back", "put issue", "signal wait")


def is_transfer(step: str) -> bool:
    """Whether ``step`` moves the payload: one of TRANSFER_STEPS, also as a node-mode stage's step
    ("scaleout payload transfer": ``run.nodes`` names each stage's steps after it)."""
    stage, _, inner = step.partition(" ")
    return step in TRANSFER_STEPS or (stage in STAGES and inner in TRANSFER_STEPS)


@dataclass
class RankProfile:
    """One rank's timed calls of one phase, on its own clock (seconds)."""

    entered: list[float] = field(default_factory=list)
    left: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # the timer's time of each call
    iterations: list[IterationSteps] = field(default_factory=list)


@dataclass
class PhaseProfile:
    """Every rank's ``RankProfile`` of one phase (gathered on rank 0) and what identifies the phase."""

    case: dict[str, Any]  # the results row's case columns (run.case.CASE_FIELDS)
    ranks: list[RankProfile]
    offsets: ClockOffsets
    bytes_sent: list[int] = field(default_factory=list)  # per rank: its bytes of the phase (trace arguments)

    def step_rows(self) -> list[dict[str, Any]]:
        """profile.csv rows: one per (rank, iteration, step) with its microseconds, "other" included, and
        the phase time (step "phase") and its transfer part ("transfer")."""
        rows = []
        for rank, profile in enumerate(self.ranks):
            for index, (steps, seconds) in enumerate(zip(profile.iterations, profile.seconds, strict=False)):
                spent: dict[str, float] = {}
                for name, start, end in steps.steps:
                    spent[name] = spent.get(name, 0.0) + (end - start)
                covered = sum(spent.values())
                transfer = sum(value for name, value in spent.items() if is_transfer(name))
                values = {**spent, OTHER_STEP: max(seconds - covered, 0.0), "phase": seconds}
                values["transfer"] = transfer
                rows += [
                    {**self.case, "rank": rank, "iteration": index, "step": name, "us": 1e6 * value}
                    for name, value in values.items()
                ]
        return rows

    def arrival_rows(self) -> list[dict[str, Any]]:
        """arrivals.csv rows: per (rank, iteration) its entry and exit on rank 0's clock (us from the
        iteration's first entry), how late it came (us after the first rank) and how long it waited for the
        last one (us from its entry until the last rank entered)."""
        rows = []
        iterations = min((len(p.entered) for p in self.ranks), default=0)
        for index in range(iterations):
            entered = [self.offsets.to_reference(r, p.entered[index]) for r, p in enumerate(self.ranks)]
            left = [self.offsets.to_reference(r, p.left[index]) for r, p in enumerate(self.ranks)]
            first, last = min(entered), max(entered)
            for rank in range(len(self.ranks)):
                rows.append(
                    {
                        **self.case, "rank": rank, "iteration": index,
                        "entered_us": 1e6 * (entered[rank] - first), "left_us": 1e6 * (left[rank] - first),
                        "waited_us": 1e6 * (last - entered[rank]),
                        "uncertainty_us": 1e6 * self.offsets.uncertainty_s[rank],
                    }
                )  # fmt: skip
        return rows

    def peer_rows(self) -> list[dict[str, Any]]:
        """Per (receiver, sender, iteration): when the sender's data was seen by the receiver, us after the
        receiver entered the call (only backends that see per-source completion: shmem-emu's signals)."""
        rows = []
        for dst, profile in enumerate(self.ranks):
            for index, steps in enumerate(profile.iterations):
                if index >= len(profile.entered):
                    break
                for src, seen in steps.peer_arrivals.items():
                    us = 1e6 * (seen - profile.entered[index])
                    rows.append({**self.case, "src": src, "dst": dst, "iteration": index, "seen_us": us})
        return rows

    def trace_spans(self) -> list[dict[str, Any]]:
        """Every step and phase as (rank, track, name, start s, duration s, args) on rank 0's clock."""
        spans = []
        for rank, profile in enumerate(self.ranks):
            label = f"{self.case.get('pattern')} {self.case.get('phase')}"
            sent = self.bytes_sent[rank] if rank < len(self.bytes_sent) else None
            for index, (start, end) in enumerate(zip(profile.entered, profile.left, strict=False)):
                args = {"iteration": index, "bytes_sent": sent, **_plain_case(self.case)}
                begin = float(self.offsets.to_reference(rank, start))
                spans.append({"rank": rank, "track": "phase", "name": label, "start": begin,
                              "duration": end - start, "args": args})  # fmt: skip
                if index < len(profile.iterations):
                    for name, step_start, step_end in profile.iterations[index].steps:
                        spans.append({
                            "rank": rank, "track": name, "name": name,
                            "start": float(self.offsets.to_reference(rank, step_start)),
                            "duration": step_end - step_start, "args": {"iteration": index, "phase": label},
                        })  # fmt: skip
        return spans


def _plain_case(case: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value for key, value in case.items() if isinstance(value, str | int | float) or value is None
    }


def gathered_profile(parts: Sequence[Any]) -> list[RankProfile]:
    """The per-rank ``RankProfile`` objects out of the harness's gather (``None`` where not profiled)."""
    return [part if isinstance(part, RankProfile) else RankProfile() for part in parts]

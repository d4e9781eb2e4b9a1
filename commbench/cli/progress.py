"""Progress lines of a launch on stderr (rank 0): one per finished phase, with elapsed time and an estimate
of what is left."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import click

from commbench.plain import knobs_text

if TYPE_CHECKING:
    import pandas as pd

    from commbench.inputs.specs import SystemSpec


class Progress:
    """'[3/7] deepseek-v3 zipf:1.2 dispatch ...' lines on stderr after each finished phase (rank 0)."""

    def __init__(self, total: int, spec: SystemSpec, swept_keys: tuple[str, ...] = ()) -> None:
        self.total = total
        self.spec = spec
        self.done = 0
        self.swept_keys = swept_keys
        self.started = time.monotonic()
        self.first_done: float | None = None  # when the first phase finished

    def _clock(self) -> str:
        """Elapsed time and what is left, estimated from the phases measured after the first one (the
        first carries the connection set-up and warm-up; phases differ in size, so it is a rough figure
        that settles as the run goes): "estimating" until a phase after the first has finished."""
        now = time.monotonic()
        elapsed = now - self.started
        if self.first_done is None:
            self.first_done = now
        if self.done < 2 or self.done >= self.total:
            left = "estimating" if self.done < self.total else "done"
            return f"{_duration(elapsed)} elapsed, {left}"
        per_phase = (now - self.first_done) / (self.done - 1)
        return f"{_duration(elapsed)} elapsed, ~{_duration(per_phase * (self.total - self.done))} left"

    def _setting(self, row: dict[str, Any]) -> str:
        """The swept knobs of a row (effective values) for its progress line, e.g. " [chunk_rows=4]"."""
        knobs = row.get("knobs") or {}
        prefix = f"{row.get('backend_name')}_"  # sim and mock report their options as "<name>_<option>"
        keys = (*self.swept_keys, "replicas")  # --replicas: the case with EPLB replicas says so
        values = {key: knobs.get(key, knobs.get(prefix + key)) for key in keys}
        shown = knobs_text({key: value for key, value in values.items() if value is not None})
        return f" [{shown}]" if shown else ""

    def __call__(self, rows: list[dict[str, Any]], frame: pd.DataFrame | None = None) -> None:
        """A line per finished row; ``frame``: the rows' ``results_frame`` when the caller has it."""
        from commbench.report import format_bandwidth, results_frame
        from commbench.report.pages.tables import fmt_wrong

        if not rows:
            return
        frame = results_frame(rows, self.spec) if frame is None else frame
        for row, record in zip(rows, frame.to_dict("records"), strict=True):
            self.done += 1
            phase = record.get("phase")
            skew = record.get("skew")
            known = isinstance(skew, str) and skew != ""  # trace calls (--pattern kineto) have none
            case = "alltoall" if phase == "alltoall" else f"{skew} {phase}" if known else str(phase)
            repeat = f" repeat {row['repeat']}" if row.get("repeat") else ""
            click.echo(
                f"[{self.done}/{self.total}] {record.get('pattern')} {case}{repeat}{self._setting(row)}: "
                f"size {int(record['size_bytes'])} B, {record['time_us_p50']:.1f} us, "
                f"busbw {format_bandwidth(record['busbw_GBps'])} GB/s, "
                f"#wrong {fmt_wrong(record.get('wrong'))} ({self._clock()})",
                err=True,
            )


def _duration(seconds: float) -> str:
    """12 s, 3 min 05 s, 1 h 02 min."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"

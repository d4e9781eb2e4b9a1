"""Progress lines: one per finished phase, the estimate of what is left only from measured phases."""

from __future__ import annotations

import pytest

from commbench.cli import progress as progress_module
from commbench.cli.progress import Progress
from commbench.inputs.specs import no_spec


def _row(size: int) -> dict:
    return {
        "pattern": "balanced", "phase": "alltoall", "size_bytes": size, "time_us_p50": 10.0,
        "time_us_mean": 10.0, "max_send_link_bytes": size, "max_recv_link_bytes": size, "wrong": 0,
    }  # fmt: skip


def test_the_estimate_waits_for_a_phase_after_the_first(monkeypatch, capsys) -> None:
    clock = iter([0.0, 30.0, 32.0, 34.0])  # start; the first phase takes 30 s (set-up), then 2 s each
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    progress = Progress(4, no_spec("test"))
    for size in (1024, 2048, 4096):
        progress([_row(size)])
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("[1/4]") and lines[0].endswith("(30 s elapsed, estimating)")
    assert lines[1].endswith("(32 s elapsed, ~4 s left)")  # 2 phases left x 2 s, not x 16 s
    assert lines[2].endswith("(34 s elapsed, ~2 s left)")


@pytest.mark.parametrize("total", [1, 2])
def test_the_last_phase_says_done(monkeypatch, capsys, total) -> None:
    clock = iter([0.0, 5.0, 6.0])
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    progress = Progress(total, no_spec("test"))
    for _ in range(total):
        progress([_row(1024)])
    assert capsys.readouterr().err.splitlines()[-1].endswith("elapsed, done)")

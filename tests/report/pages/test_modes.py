"""report.modes: the rows' timing and check modes in words (no timing value: timed per iteration)."""

from __future__ import annotations

import pandas as pd

from commbench.report.pages.modes import (
    CHECK_TEXT,
    TIMING_TEXT,
    WINDOW_WAITS,
    check_text,
    mixes_timing,
    timing_modes,
    timing_text,
    with_timing,
)


def test_rows_without_timing_were_timed_per_iteration() -> None:
    old = pd.DataFrame({"phase": ["alltoall", "dispatch"]})
    assert timing_modes(old) == ["iteration"] and not mixes_timing(old)
    assert timing_text(old) == TIMING_TEXT["iteration"]
    assert timing_modes(pd.DataFrame()) == [] and timing_text(pd.DataFrame()) is None


def test_mixed_timing_is_named_row_by_row() -> None:
    frame = pd.DataFrame({"timing": ["window", None, "window"]})
    assert timing_modes(frame) == ["window", "iteration"] and mixes_timing(frame)
    assert with_timing(frame)["timing"].tolist() == ["window", "iteration", "window"]
    assert timing_text(frame) == f"{TIMING_TEXT['window']}; {TIMING_TEXT['iteration']}"
    assert "back to back in one window" in TIMING_TEXT["window"]


def test_a_window_says_how_the_host_waited_for_its_calls() -> None:
    frame = pd.DataFrame({"timing": ["window", "iteration"]})
    for blocking in (0, 1):
        text = timing_text(frame, blocking)
        assert f"--blocking {blocking}, nccl-tests -z {blocking}" in text
        assert text.count(WINDOW_WAITS[blocking]) == 1  # the window's, not the iteration's
        assert text.endswith(TIMING_TEXT["iteration"])
    assert WINDOW_WAITS[0] != WINDOW_WAITS[1]
    assert timing_text(frame) == f"{TIMING_TEXT['window']}; {TIMING_TEXT['iteration']}"  # not recorded


def test_check_text_names_window_last() -> None:
    frame = pd.DataFrame({"check": ["window-last", "n/a", None]})
    assert check_text(frame) == f"{CHECK_TEXT['window-last']}; {CHECK_TEXT['n/a']}"
    assert "window's final output verified byte for byte" in CHECK_TEXT["window-last"]
    assert check_text(pd.DataFrame({"phase": ["x"]})) is None

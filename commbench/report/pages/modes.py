"""What the rows' timing and check modes mean, in words, for every table and page that shows them.

Every result row carries ``check`` (how its timed iterations were verified) and, from the harness that times
both ways, ``timing`` ("window": nccl-tests' back-to-back iterations in one timed window; "iteration": a
barrier before each timed iteration; "graph": ``--cuda-graph N``, N calls captured into one CUDA graph
and the graph replayed back to back in one window, N in the rows' ``graph_calls``). Rows without a
``timing`` value (older report folders) were timed per iteration, the only way commbench timed them then.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from commbench.plain import is_missing

# Rows written before the timing column existed were timed per iteration.
DEFAULT_TIMING = "iteration"

# How each value of the rows' ``timing`` column times, and the time a row then holds (see CONVENTIONS).
TIMING_HOW = {
    "window": "as nccl-tests: the timed iterations back to back in one window, no barrier between them",
    "iteration": "a barrier before each timed iteration",
    "graph": "--cuda-graph: the calls captured into one CUDA graph on a side stream and the graph replayed "
    "back to back in one window, no host launch per call (nccl-tests -G)",
}
TIMING_TIME = {
    "window": "the max across ranks of window / iterations",
    "iteration": "each iteration's max across ranks: min, p50, p99 and mean over the timed iterations",
    "graph": "the max across ranks of window / (replays x calls per graph)",
}
TIMING_TEXT = {mode: f"{mode} ({TIMING_HOW[mode]}; time = {TIMING_TIME[mode]})" for mode in TIMING_HOW}
# How the host waited for a window's calls (RunOptions.blocking, in meta.json; folders written before the
# option say neither).
WINDOW_WAITS = {
    0: "the host waits for them once, at the window's end (--blocking 0, nccl-tests -z 0)",
    1: "the host waits for each one before issuing the next (--blocking 1, nccl-tests -z 1)",
}

# What each value of the rows' ``check`` column means (RunOptions.check; "n/a": nothing moved).
CHECK_TEXT = {
    "checksum": "checksum (receive buffers poisoned before every timed iteration; every iteration "
    "checksummed, the last verified byte for byte)",
    "every": "every (receive buffers poisoned before every timed iteration; every iteration verified "
    "byte for byte: slower)",
    "window-last": "window-last (receive buffers poisoned once before the timed window; the back-to-back "
    "iterations overwrite the same buffers, as in nccl-tests; the window's final output verified byte "
    "for byte)",
    "n/a": "n/a (no data moved: #wrong n/a)",
    "off": "off (benchmark baseline: nothing verified, #wrong n/a)",
}


def timing_modes(frame: pd.DataFrame) -> list[str]:
    """The timing modes of the rows, in order of appearance; a row without one counts as "iteration"."""
    if frame.empty:
        return []
    if "timing" not in frame.columns:
        return [DEFAULT_TIMING]
    return list(dict.fromkeys(DEFAULT_TIMING if is_missing(mode) else str(mode) for mode in frame["timing"]))


def graph_calls(frame: pd.DataFrame) -> list[int]:
    """The calls per CUDA graph of the rows timed as graphs (``graph_calls``), in order of appearance."""
    if frame.empty or "graph_calls" not in frame.columns or "timing" not in frame.columns:
        return []
    graphed = frame.loc[frame["timing"].astype(str) == "graph", "graph_calls"]
    return [int(calls) for calls in dict.fromkeys(graphed) if not is_missing(calls)]


def graph_label(calls: Sequence[int]) -> str:
    """ "CUDA graph of N calls" (several Ns joined: "of 10 or 20 calls")."""
    return f"CUDA graph of {' or '.join(map(str, calls)) or 'N'} calls"


def timing_how(frame: pd.DataFrame, mode: str, blocking: int | None = None) -> str:
    """How ``mode`` times, in words ("" for a mode it does not know); a graph says how many calls the rows'
    graphs held, a window how the host waited for its calls (``blocking``: the run's --blocking)."""
    how = TIMING_HOW.get(mode, "")
    if mode == "graph":
        return f"{graph_label(graph_calls(frame))}: {how}"
    if mode == "window" and blocking in WINDOW_WAITS:
        return f"{how}; {WINDOW_WAITS[blocking]}"
    return how


def timing_text(frame: pd.DataFrame, blocking: int | None = None) -> str | None:
    """How the rows were timed, in words ("; " between modes, each with the time it gives); None without
    rows. ``blocking``: the run's --blocking (``timing_how``)."""
    texts = []
    for mode in timing_modes(frame):
        how = timing_how(frame, mode, blocking)
        texts.append(f"{mode} ({how}; time = {TIMING_TIME[mode]})" if how else mode)
    return "; ".join(texts) or None


def with_timing(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a ``timing`` column in every row ("iteration" where a row has none), so that a table
    can show which rows were timed how."""
    if frame.empty:
        return frame
    values = frame["timing"] if "timing" in frame.columns else pd.Series(None, index=frame.index)
    return frame.assign(timing=[DEFAULT_TIMING if is_missing(v) else str(v) for v in values])


def mixes_timing(frame: pd.DataFrame) -> bool:
    """Whether the rows were timed in more than one way (then the tables show a ``timing`` column)."""
    return len(timing_modes(frame)) > 1


def check_modes(frame: pd.DataFrame) -> list[str]:
    """The check modes of the rows, in order of appearance (rows without one are left out)."""
    if "check" not in frame.columns:
        return []
    return [str(mode) for mode in dict.fromkeys(frame["check"]) if not is_missing(mode)]


def check_text(frame: pd.DataFrame) -> str | None:
    """How the rows' timed iterations were verified (their ``check`` column), in words; None without it."""
    return "; ".join(CHECK_TEXT.get(mode, mode) for mode in check_modes(frame)) or None

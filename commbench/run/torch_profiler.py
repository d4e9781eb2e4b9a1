"""--torch-profiler: a torch.profiler (Kineto) trace of a rank's run, saved as <out_dir>/kineto/rank<R>.json.

``capture(enabled, out_dir, rank)`` wraps the part of a rank's run to profile (CPU activity, plus CUDA
activity where CUDA is available; ``record_shapes``); ``measured(label)`` marks the measured calls inside it
as ``commbench.measured/<label>`` ranges (a no-op when no capture is running), so that
``report.kineto_overlap`` counts only the GPU work those calls launched, not warm-up, barriers or checks.

The capture never fails the benchmark: a profiler that cannot start, stop or export is one line on stderr
and the run goes on unprofiled. The trace is exported to a temporary name in the same folder and renamed,
so a reader never sees half a file. torch is imported only when a capture is asked for.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_FOLDER = "kineto"
MEASURED_PREFIX = "commbench.measured/"  # record_function names that mark measured calls
_NO_MARK = nullcontext()

_lock = threading.Lock()
_active: TraceCapture | None = None  # one profiler per process: thread ranks share it (the first one wins)


@dataclass
class TraceCapture:
    """What ``capture`` yields: where the trace goes and, after the ``with`` block, whether it was written."""

    path: Path
    written: bool = False


def trace_path(out_dir: str | os.PathLike[str], rank: int) -> Path:
    """The trace file of ``rank`` under a report folder: <out_dir>/kineto/rank<R>.json."""
    return Path(out_dir) / TRACE_FOLDER / f"rank{int(rank)}.json"


def _warn(rank: int, text: str) -> None:
    print(f"commbench: --torch-profiler (rank {rank}): {text}", file=sys.stderr, flush=True)


@contextmanager
def capture(
    enabled: bool, out_dir: str | os.PathLike[str] | None, rank: int
) -> Iterator[TraceCapture | None]:
    """Profile the ``with`` block on this rank and export its Chrome trace to ``trace_path(out_dir, rank)``.

    Yields a ``TraceCapture`` (``written`` is set once the file is in place) or None when nothing is
    captured: disabled, no folder to write to, another capture already running in this process (thread
    ranks), or the profiler did not start. Exceptions of the block pass through unchanged (the trace is then
    not exported); the profiler's own failures are one stderr line each, never an exception."""
    global _active
    if not enabled:
        yield None
        return
    if out_dir is None:
        _warn(rank, "no report folder to write the trace to; not profiling")
        yield None
        return
    handle = TraceCapture(trace_path(out_dir, rank))
    with _lock:
        if _active is not None:
            _warn(rank, "another rank of this process is being profiled; not profiling this one")
            handle = None
        else:
            _active = handle
    if handle is None:
        yield None
        return
    try:
        profiler = _start(rank)
        if profiler is None:
            with _lock:
                _active = None  # nothing records: measured() stays the no-op
            yield None
            return
        try:
            yield handle
        except BaseException:
            _stop(profiler, rank)
            raise
        if _stop(profiler, rank):
            handle.written = _export(profiler, handle.path, rank)
    finally:
        with _lock:
            _active = None


def measured(label: str) -> AbstractContextManager[Any]:
    """A ``commbench.measured/<label>`` range around one measured call while a capture runs; otherwise a
    shared no-op context (nothing imported, nothing recorded: cheap inside a timed loop)."""
    if _active is None:
        return _NO_MARK
    from torch.profiler import record_function

    return record_function(MEASURED_PREFIX + label)


def _start(rank: int) -> Any:
    """A started torch.profiler.profile, or None (one stderr line) when it cannot start."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        profiler = profile(activities=activities, record_shapes=True)
        profiler.start()
        return profiler
    except Exception as exc:  # an already-enabled profiler, a Kineto/CUPTI failure: the run goes on
        _warn(rank, f"the profiler did not start ({_brief(exc)}); not profiling")
        return None


def _stop(profiler: Any, rank: int) -> bool:
    """Stop the profiler; False (one stderr line) when stopping failed."""
    try:
        profiler.stop()
        return True
    except Exception as exc:
        _warn(rank, f"the profiler did not stop cleanly ({_brief(exc)}); no trace written")
        return False


def _export(profiler: Any, path: Path, rank: int) -> bool:
    """Export the Chrome trace to a temporary name beside ``path``, then rename it to ``path``; False (one
    stderr line, no file left behind) on failure."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(tmp))  # not ".gz": torch would compress it
        os.replace(tmp, path)
        return True
    except Exception as exc:
        with suppress(OSError):
            tmp.unlink()
        _warn(rank, f"the trace could not be written to {path} ({_brief(exc)})")
        return False


def _brief(exc: BaseException) -> str:
    """One line of an exception: its type and the first line of its message, bounded."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__

"""The ``--skew`` grammar: uniform | zipf:S | hot:N:F | rank-imbalance:R | trace:PATH.

``load_trace`` reads and validates a routing trace (top-k expert ids per token) for ``trace:PATH``.
"""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from commbench.errors import UsageError

SKEW_FORMS = "uniform, zipf:S, hot:N:F, rank-imbalance:R or trace:PATH"


@dataclass(frozen=True)
class SkewSpec:
    kind: str  # "uniform", "zipf", "hot", "rank-imbalance", "trace"
    text: str  # the user's spelling, for reports
    zipf_s: float = 0.0
    hot_experts: int = 0
    hot_fraction: float = 0.0
    imbalance_ratio: float = 1.0
    trace_path: str = ""


def _number(text: str, what: str, spelling: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--skew {spelling}: {what} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"--skew {spelling}: {what} must be finite, got {text!r}")
    return value


def parse_skew(text: str) -> SkewSpec:
    """Parse a --skew value; raises UsageError naming the accepted forms."""
    spelling = text.strip()
    kind, _, rest = spelling.partition(":")
    kind = kind.lower()
    if kind == "uniform" and not rest:
        return SkewSpec(kind="uniform", text=spelling)
    if kind == "zipf" and rest:
        exponent = _number(rest, "the exponent S", spelling)
        if exponent <= 0:
            raise UsageError(f"--skew {spelling}: the exponent S must be > 0 (zipf:1.2 is typical)")
        return SkewSpec(kind="zipf", text=spelling, zipf_s=exponent)
    if kind == "hot" and rest.count(":") == 1:
        count_text, fraction_text = rest.split(":")
        if not count_text.isdigit() or int(count_text) < 1:
            raise UsageError(f"--skew {spelling}: N (hot experts) must be a positive integer, e.g. hot:4:0.3")
        fraction = _number(fraction_text, "the fraction F", spelling)
        if not 0 < fraction < 1:
            raise UsageError(f"--skew {spelling}: the fraction F must be in (0, 1), e.g. hot:4:0.3")
        return SkewSpec(kind="hot", text=spelling, hot_experts=int(count_text), hot_fraction=fraction)
    if kind == "rank-imbalance" and rest:
        ratio = _number(rest, "the ratio R", spelling)
        if ratio < 1:
            raise UsageError(f"--skew {spelling}: the ratio R must be >= 1 (the hot rank receives R x)")
        return SkewSpec(kind="rank-imbalance", text=spelling, imbalance_ratio=ratio)
    if kind == "trace" and rest:
        # The shell does not expand ~ after "trace:", so do it here.
        return SkewSpec(kind="trace", text=spelling, trace_path=os.path.expanduser(rest))
    raise UsageError(f"--skew {spelling!r} not understood; use {SKEW_FORMS}")


@dataclass(frozen=True)
class Trace:
    """A routing trace: ``topk_ids`` int64 [T, k], optional ``topk_weights`` float32 [T, k]."""

    path: str
    topk_ids: np.ndarray
    topk_weights: np.ndarray | None


def load_trace(path: str, num_experts: int, topk: int) -> Trace:
    """Read ``.npz`` (key ``topk_ids``, optional ``topk_weights``) or ``.parquet`` (list column ``topk_ids``
    or columns ``topk_0..topk_{k-1}``; weights likewise ``topk_weights`` or ``topk_weight_0..``) and validate
    it against the model. Never unpickles. Raises UsageError naming the file and the problem."""
    stat = _stat(path)
    return _load_trace_cached(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size, num_experts, topk)


def _stat(path: str) -> os.stat_result:
    try:
        stat = os.stat(path)
    except OSError:
        raise UsageError(f"trace file {path} not found") from None
    if not Path(path).is_file():
        raise UsageError(f"trace {path} is not a file")
    return stat


# One trace per process is typical; the key includes mtime and size so an edited file is re-read.
_TRACE_CACHE: dict[tuple, Trace] = {}


def _load_trace_cached(path: str, mtime_ns: int, size: int, num_experts: int, topk: int) -> Trace:
    key = (path, mtime_ns, size, num_experts, topk)
    if key not in _TRACE_CACHE:
        _TRACE_CACHE.clear()
        _TRACE_CACHE[key] = _read_trace(path, num_experts, topk)
    return _TRACE_CACHE[key]


def _read_trace(path: str, num_experts: int, topk: int) -> Trace:
    suffix = Path(path).suffix.lower()
    if suffix == ".npz":
        ids, weights = _read_npz(path)
    elif suffix == ".parquet":
        ids, weights = _read_parquet(path)
    else:
        raise UsageError(f"trace {path}: unsupported file type {suffix or '(none)'}; use .npz or .parquet")
    ids = _check_ids(path, ids, num_experts, topk)
    if weights is not None:
        weights = _check_weights(path, weights, ids.shape)
        weights.setflags(write=False)
    ids.setflags(write=False)  # traces are cached and shared: read-only
    return Trace(path=path, topk_ids=ids, topk_weights=weights)


def _read_npz(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    if not zipfile.is_zipfile(path):  # np.load would take any other file for a pickle
        raise UsageError(f"trace {path}: unreadable .npz (not a zip archive written by numpy.savez)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            if "topk_ids" not in archive.files:
                raise UsageError(
                    f"trace {path}: no 'topk_ids' array (found: {', '.join(archive.files) or 'none'})"
                )
            ids = archive["topk_ids"]
            weights = archive["topk_weights"] if "topk_weights" in archive.files else None
    except UsageError:
        raise
    except zlib.error as exc:  # a corrupted compressed member (savez_compressed)
        raise UsageError(f"trace {path}: unreadable .npz ({exc})") from None
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise UsageError(f"trace {path}: holds pickled object arrays, which are never loaded") from None
        raise UsageError(f"trace {path}: unreadable .npz ({exc})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise UsageError(f"trace {path}: unreadable .npz ({exc})") from None
    # NpzFile hands back raw bytes for a member that is not a .npy array.
    for name, value in (("topk_ids", ids), ("topk_weights", weights)):
        if value is not None and not isinstance(value, np.ndarray):
            raise UsageError(f"trace {path}: member {name} is not a numpy array (write it with numpy.savez)")
    return ids, weights


def _read_parquet(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise UsageError(f"trace {path}: unreadable .parquet ({exc})") from None
    ids = _parquet_matrix(path, table, "topk_ids", "topk_")
    if ids is None:
        raise UsageError(f"trace {path}: needs a list column 'topk_ids' or columns topk_0 .. topk_<k-1>")
    weights = _parquet_matrix(path, table, "topk_weights", "topk_weight_")
    return ids, weights


def _parquet_matrix(path: str, table, list_name: str, prefix: str) -> np.ndarray | None:
    """A [rows, k] array from a list column, or from numbered scalar columns prefix0, prefix1, ..."""
    import pyarrow as pa

    if list_name in table.column_names:
        column = table.column(list_name).combine_chunks()
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise UsageError(f"trace {path}: column {list_name} must be a list column")
        if column.null_count:
            raise UsageError(f"trace {path}: column {list_name} has null rows")
        lengths = column.value_lengths().to_numpy(zero_copy_only=False)
        width = int(lengths[0]) if len(lengths) else 0
        if len(lengths) and (lengths != width).any():
            raise UsageError(f"trace {path}: rows of {list_name} have different lengths")
        values = column.flatten()
        if values.null_count:
            raise UsageError(f"trace {path}: column {list_name} holds nulls")
        return values.to_numpy(zero_copy_only=False).reshape(len(lengths), width)
    numbered = []
    while f"{prefix}{len(numbered)}" in table.column_names:
        column = table.column(f"{prefix}{len(numbered)}")
        if column.null_count:
            raise UsageError(f"trace {path}: column {prefix}{len(numbered)} holds nulls")
        numbered.append(column.to_numpy())
    return np.stack(numbered, axis=1) if numbered else None


def _check_ids(path: str, ids: np.ndarray, num_experts: int, topk: int) -> np.ndarray:
    if ids.dtype == object or not np.issubdtype(ids.dtype, np.integer):
        raise UsageError(f"trace {path}: topk_ids must be integers, got dtype {ids.dtype}")
    if ids.ndim != 2 or ids.shape[1] != topk:
        raise UsageError(
            f"trace {path}: topk_ids has shape {list(ids.shape)}; the model needs [tokens, {topk}]"
        )
    if ids.shape[0] == 0:
        raise UsageError(f"trace {path}: topk_ids has no tokens")
    ids = np.array(ids, dtype=np.int64, order="C")  # own copy: parquet buffers are read-only views
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_experts:
        raise UsageError(
            f"trace {path}: expert ids span {low}..{high}; the model has experts 0..{num_experts - 1}"
        )
    ordered = np.sort(ids, axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if repeated.any():
        token = int(np.flatnonzero(repeated)[0])
        raise UsageError(
            f"trace {path}: token {token} repeats an expert id; each token's top-k must be distinct"
        )
    return ids


def _check_weights(path: str, weights: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if weights.dtype == object or not np.issubdtype(weights.dtype, np.number):
        raise UsageError(f"trace {path}: topk_weights must be numbers, got dtype {weights.dtype}")
    if weights.shape != shape:
        raise UsageError(
            f"trace {path}: topk_weights has shape {list(weights.shape)}; expected {list(shape)}"
        )
    weights = np.array(weights, dtype=np.float32, order="C")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise UsageError(f"trace {path}: topk_weights must be finite and >= 0")
    return weights

"""The ``--skew`` grammar: uniform | zipf:S | hot:N:F | rank-imbalance:R | trace:PATH | load:PATH[:LAYER].

``load_trace`` reads and validates a routing trace (top-k expert ids per token) for ``trace:PATH``;
``load:PATH[:LAYER]`` names a per-layer expert-load table (``inputs.expert_load``), read when routing starts.
"""

from __future__ import annotations

import math
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from commbench.errors import UsageError
from commbench.inputs.userfiles import clip, describe_keys, show_path

SKEW_FORMS = "uniform, zipf:S, hot:N:F, rank-imbalance:R or trace:PATH (or load:PATH[:LAYER], expert loads)"


@dataclass(frozen=True)
class SkewSpec:
    kind: str  # "uniform", "zipf", "hot", "rank-imbalance", "trace", "load"
    text: str  # the user's spelling, for reports
    zipf_s: float = 0.0
    hot_experts: int = 0
    hot_fraction: float = 0.0
    imbalance_ratio: float = 1.0
    trace_path: str = ""
    load_path: str = ""  # load:PATH[:LAYER]: an expert-load table (inputs.expert_load)
    load_layer: int | None = None  # its layer; None: the sum over every layer


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
    if kind == "load" and rest:
        # A trailing ":N" names the layer; a path that itself ends in ":<digits>" needs the layer spelled out.
        path, colon, layer = rest.rpartition(":")
        if not (colon and path and layer.strip().isdigit()):
            path, layer = rest, ""
        elif len(layer.strip()) > 9:
            raise UsageError(f"--skew {spelling}: the layer must be a whole number below 10^9")
        return SkewSpec(
            kind="load",
            text=spelling,
            load_path=os.path.expanduser(path),
            load_layer=int(layer) if layer else None,
        )
    raise UsageError(f"--skew {spelling!r} not understood; use {SKEW_FORMS}")


# Bounds of a trace, checked from file metadata before any array is read or decompressed. A real trace is
# tokens x top-k ids (DeepSeek-V3, 64 ranks x 4096 tokens x top-8: 2M selections, 16 MiB as int64); these
# leave 30x room yet keep what one process holds (ids + weights + a sorted copy) to ~1.5 GiB.
MAX_TRACE_FILE_BYTES = 1 << 30
# A trace's id of a selection that was dropped (DeepEP's topk_idx convention, as --mask-ratio and
# --capacity-factor produce): the selection moves no traffic.
DROPPED_ID = -1
MAX_TRACE_SELECTIONS = 1 << 26  # elements of topk_ids (and of topk_weights)
MAX_TRACE_TOKENS = 1 << 24
_MAX_NPZ_MEMBERS = 64  # topk_ids and topk_weights; more is not a trace (and each costs zipfile memory)
_MAX_PARQUET_CHUNKS = 1 << 20  # row groups x columns walked in the footer


@dataclass(frozen=True)
class Trace:
    """A routing trace: ``topk_ids`` int64 [T, k] (``DROPPED_ID`` = a dropped selection), optional
    ``topk_weights`` float32 [T, k]."""

    path: str
    topk_ids: np.ndarray
    topk_weights: np.ndarray | None


def load_trace(path: str, num_experts: int, topk: int) -> Trace:
    """Read ``.npz`` (key ``topk_ids``, optional ``topk_weights``) or ``.parquet`` (list column ``topk_ids``
    or columns ``topk_0..topk_{k-1}``; weights likewise ``topk_weights`` or ``topk_weight_0..``) and validate
    it against the model. Never unpickles; sizes are checked before anything is read. Raises UsageError
    naming the file and the problem."""
    stat = _stat(path)
    return _load_trace_cached(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size, num_experts, topk)


def _stat(path: str) -> os.stat_result:
    where = f"trace {show_path(path)}"
    try:
        stat = os.stat(path)
    except (OSError, ValueError):
        raise UsageError(f"trace file {show_path(path)} not found; check the path after trace:") from None
    if not Path(path).is_file():
        raise UsageError(f"{where} is not a file (a folder, device or pipe); pass a .npz or .parquet file")
    if stat.st_size == 0:
        raise UsageError(f"{where} is empty; pass a trace written by numpy.savez or pyarrow")
    if stat.st_size > MAX_TRACE_FILE_BYTES:
        raise UsageError(
            f"{where} is {stat.st_size / 2**30:.1f} GiB, above the {MAX_TRACE_FILE_BYTES >> 30} GiB limit "
            "for a trace; keep fewer tokens (the trace is replayed cyclically)"
        )
    try:
        with open(path, "rb"):  # readable? (zipfile.is_zipfile would say "not a zip" for a permission error)
            pass
    except OSError as exc:
        raise UsageError(f"{where} cannot be read ({clip(exc.strerror or str(exc))}); check it") from None
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
        raise UsageError(
            f"trace {show_path(path)}: unsupported file type {clip(suffix) or '(none)'}; use .npz or .parquet"
        )
    ids = _check_ids(path, ids, num_experts, topk)
    if weights is not None:
        weights = _check_weights(path, weights, ids.shape)
        weights.setflags(write=False)
    ids.setflags(write=False)  # traces are cached and shared: read-only
    return Trace(path=path, topk_ids=ids, topk_weights=weights)


def _too_big(path: str, what: str, count: int, limit: int, unit: str) -> UsageError:
    return UsageError(
        f"trace {show_path(path)}: {what} holds {count} {unit}, above the limit {limit}; keep fewer tokens "
        "(the trace is replayed cyclically)"
    )


def _zip_member_count(path: str) -> int:
    """Entries the zip's end-of-central-directory record declares (read before zipfile lists them all)."""
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - (1 << 16) - 22))  # the record (22 bytes) ends the file, after a comment
        tail = handle.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) < at + 22:
        return -1  # no record: not a zip
    return struct.unpack_from("<H", tail, at + 10)[0]  # total entries (0xFFFF: more, in a zip64 record)


def _check_npy_member(path: str, archive: zipfile.ZipFile, name: str) -> None:
    """Refuse a member whose .npy header declares more than MAX_TRACE_SELECTIONS elements, before numpy
    allocates for it. A member that is not .npy, or an object array, is left to np.load
    (allow_pickle=False)."""
    member = next((m for m in (f"{name}.npy", name) if m in archive.namelist()), None)
    if member is None:
        return
    with archive.open(member) as stream:
        try:
            version = np.lib.format.read_magic(stream)
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read_header is None:
                raise UsageError(
                    f"trace {show_path(path)}: member {name} uses .npy format {version}; write it with "
                    "numpy.savez"
                )
            shape, _, _ = read_header(stream)
        except ValueError:
            return  # not an .npy member: np.load hands back bytes, refused below
    count = math.prod(shape)
    if count > MAX_TRACE_SELECTIONS:
        raise _too_big(path, name, count, MAX_TRACE_SELECTIONS, "elements")


def _read_npz(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    where = f"trace {show_path(path)}"
    members = _zip_member_count(path)
    if members < 0 or not zipfile.is_zipfile(path):  # np.load would take any other file for a pickle
        raise UsageError(f"{where}: unreadable .npz (not a zip archive written by numpy.savez)")
    if members > _MAX_NPZ_MEMBERS:
        raise UsageError(
            f"{where}: a .npz of {members} members; a trace holds topk_ids and optionally topk_weights"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            for name in ("topk_ids", "topk_weights"):
                _check_npy_member(path, archive, name)
        with np.load(path, allow_pickle=False) as archive:  # never True: a pickle runs code when loaded
            if "topk_ids" not in archive.files:
                raise UsageError(
                    f"{where}: no 'topk_ids' array (found: {describe_keys(archive.files) or 'none'})"
                )
            ids = archive["topk_ids"]
            weights = archive["topk_weights"] if "topk_weights" in archive.files else None
    except UsageError:
        raise
    except zlib.error as exc:  # a corrupted compressed member (savez_compressed)
        raise UsageError(f"{where}: unreadable .npz ({clip(str(exc))})") from None
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise UsageError(f"{where}: holds pickled object arrays, which are never loaded") from None
        raise UsageError(f"{where}: unreadable .npz ({clip(str(exc))})") from None
    except (OSError, zipfile.BadZipFile, EOFError, NotImplementedError, RuntimeError) as exc:
        raise UsageError(f"{where}: unreadable .npz ({clip(str(exc))})") from None
    # NpzFile hands back raw bytes for a member that is not a .npy array.
    for name, value in (("topk_ids", ids), ("topk_weights", weights)):
        if value is not None and not isinstance(value, np.ndarray):
            raise UsageError(f"{where}: member {name} is not a numpy array (write it with numpy.savez)")
    return ids, weights


def _read_parquet(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = f"trace {show_path(path)}"
    try:
        parquet = pq.ParquetFile(path)
        meta = parquet.metadata
        wanted = [
            name
            for name in parquet.schema_arrow.names
            if name in ("topk_ids", "topk_weights") or name.startswith(("topk_", "topk_weight_"))
        ]
        if meta.num_rows > MAX_TRACE_TOKENS:
            raise _too_big(path, "the table", meta.num_rows, MAX_TRACE_TOKENS, "rows (tokens)")
        if meta.num_row_groups * meta.num_columns > _MAX_PARQUET_CHUNKS:
            raise UsageError(
                f"{where}: {meta.num_row_groups} row groups x {meta.num_columns} columns; write the trace as "
                "one table of its topk columns"
            )
        # Values per column from the footer, before anything is decompressed (list columns included).
        for index in range(meta.num_columns):
            column = meta.schema.column(index).path.split(".")[0]
            if column in wanted:
                values = sum(meta.row_group(g).column(index).num_values for g in range(meta.num_row_groups))
                if values > MAX_TRACE_SELECTIONS:
                    raise _too_big(path, f"column {clip(column)}", values, MAX_TRACE_SELECTIONS, "values")
        # One thread: a refusal right after a threaded read could end the process with "terminate called
        # without an active exception" (exit 134) while Arrow's pool threads were still winding down.
        table = parquet.read(columns=wanted, use_threads=False)
    except UsageError:
        raise
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise UsageError(f"{where}: unreadable .parquet ({clip(str(exc))})") from None
    ids = _parquet_matrix(path, table, "topk_ids", "topk_")
    if ids is None:
        raise UsageError(f"{where}: needs a list column 'topk_ids' or columns topk_0 .. topk_<k-1>")
    weights = _parquet_matrix(path, table, "topk_weights", "topk_weight_")
    return ids, weights


def _parquet_matrix(path: str, table, list_name: str, prefix: str) -> np.ndarray | None:
    """A [rows, k] array from a list column, or from numbered scalar columns prefix0, prefix1, ..."""
    import pyarrow as pa

    where = f"trace {show_path(path)}"
    if list_name in table.column_names:
        column = table.column(list_name).combine_chunks()
        if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)):
            raise UsageError(f"{where}: column {list_name} must be a list column")
        if column.null_count:
            raise UsageError(f"{where}: column {list_name} has null rows")
        lengths = column.value_lengths().to_numpy(zero_copy_only=False)
        width = int(lengths[0]) if len(lengths) else 0
        if len(lengths) and (lengths != width).any():
            raise UsageError(f"{where}: rows of {list_name} have different lengths")
        values = column.flatten()
        if values.null_count:
            raise UsageError(f"{where}: column {list_name} holds nulls")
        return values.to_numpy(zero_copy_only=False).reshape(len(lengths), width)
    numbered = []
    while f"{prefix}{len(numbered)}" in table.column_names:
        column = table.column(f"{prefix}{len(numbered)}")
        if column.null_count:
            raise UsageError(f"{where}: column {prefix}{len(numbered)} holds nulls")
        numbered.append(column.to_numpy())
    return np.stack(numbered, axis=1) if numbered else None


def _check_ids(path: str, ids: np.ndarray, num_experts: int, topk: int) -> np.ndarray:
    where = f"trace {show_path(path)}"
    if ids.dtype == object or not np.issubdtype(ids.dtype, np.integer):
        raise UsageError(
            f"{where}: topk_ids must be integer expert ids, got dtype {ids.dtype} (a float column may hide "
            "NaN or fractional ids); write them as int32 or int64"
        )
    if ids.ndim != 2 or ids.shape[1] != topk:
        raise UsageError(
            f"{where}: topk_ids has shape {list(ids.shape)}; the model needs [tokens, {topk}] (its top-k)"
        )
    if ids.shape[0] == 0:
        raise UsageError(f"{where}: topk_ids has no tokens")
    if ids.shape[0] > MAX_TRACE_TOKENS:
        raise _too_big(path, "topk_ids", ids.shape[0], MAX_TRACE_TOKENS, "tokens")
    # Range on the file's own dtype: a uint64 id above 2^63 would wrap negative once cast to int64.
    low, high = ids.min(), ids.max()
    if low < DROPPED_ID or high >= num_experts:
        raise UsageError(
            f"{where}: expert ids span {low}..{high}; the model has experts 0..{num_experts - 1}, and "
            f"{DROPPED_ID} marks a dropped selection (was the trace recorded with another model?)"
        )
    ids = np.array(ids, dtype=np.int64, order="C")  # own copy: parquet buffers are read-only views
    # Dropped selections (-1) may repeat within a token: each gets its own stand-in below -1 for the test.
    stand_in = DROPPED_ID - 1 - np.arange(ids.shape[1], dtype=np.int64)
    ordered = np.sort(np.where(ids >= 0, ids, stand_in), axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if repeated.any():
        token = int(np.flatnonzero(repeated)[0])
        raise UsageError(f"{where}: token {token} repeats an expert id; each token's top-k must be distinct")
    return ids


def _check_weights(path: str, weights: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    where = f"trace {show_path(path)}"
    real = np.issubdtype(weights.dtype, np.floating) or np.issubdtype(weights.dtype, np.integer)
    if weights.dtype == object or not real:
        raise UsageError(f"{where}: topk_weights must be real numbers, got dtype {weights.dtype}")
    if weights.shape != shape:
        raise UsageError(f"{where}: topk_weights has shape {list(weights.shape)}; expected {list(shape)}")
    with np.errstate(over="ignore"):  # a float64 weight beyond float32 becomes inf, refused just below
        weights = np.array(weights, dtype=np.float32, order="C")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise UsageError(f"{where}: topk_weights must be finite and >= 0 (found NaN, inf or a negative)")
    return weights

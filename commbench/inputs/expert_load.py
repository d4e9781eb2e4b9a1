"""Per-layer expert-load tables (layer, expert, tokens) as routers log them, read safely for --skew load.

A table is CSV (a header row naming the columns) or Parquet, with integer columns ``layer`` and ``expert``
and a numeric column ``tokens`` (other columns are ignored; rows of the same layer and expert add up, so a
log of several steps is their sum). ``expert_weights`` turns one layer's loads, or the sum over every layer,
into the popularity weights the routing generator samples experts by (``traffic.routing``): weight ~ tokens,
mean 1. An expert with no tokens keeps a tiny weight (``ZERO_LOAD_WEIGHT``) rather than none, so a token can
still pick ``k`` distinct experts inside its groups. Because a token's experts are distinct, the shares a
routing draws follow the weights closely but flatten the hottest ones slightly (as with ``zipf:S``).

Files are read bounded (``MAX_LOAD_FILE_BYTES``, ``MAX_LOAD_ROWS``) and never unpickled; a missing column, a
value that is not a number, a negative count, an unknown layer or an expert out of range for the model is a
one-line UsageError naming the file (and the row where there is one).
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from commbench.errors import UsageError
from commbench.inputs.userfiles import clip, decode_user_text, read_user_bytes, show_path

COLUMNS = ("layer", "expert", "tokens")
# 61 layers x 384 experts is ~23k rows; a log of many steps may repeat them: 4M rows is ample, and the file
# (64 MiB) stays a few seconds of parsing.
MAX_LOAD_FILE_BYTES = 64 << 20
MAX_LOAD_ROWS = 1 << 22
MAX_ID = 1 << 31  # layers and experts are small integers
# Tokens of one (layer, expert) row: more than any training run routes, and rows x this stay finite.
MAX_ROW_TOKENS = 1e15
ZERO_LOAD_WEIGHT = 1e-6  # of the mean: an expert the table never saw is picked only when nothing else can be


@dataclass(frozen=True)
class ExpertLoad:
    """A load table's rows (int64 layer, int64 expert, float64 tokens), in file order."""

    path: str
    layer: np.ndarray
    expert: np.ndarray
    tokens: np.ndarray

    @property
    def layers(self) -> list[int]:
        """The layers the table has, ascending."""
        return [int(value) for value in np.unique(self.layer)]


def _where(path: str) -> str:
    return f"expert-load table {show_path(path)}"


def _columns(names: list[str], where: str) -> list[int]:
    """Positions of layer, expert, tokens among a header's names (case and spaces ignored)."""
    found = [name.strip().lower() for name in names]
    missing = [column for column in COLUMNS if column not in found]
    if missing:
        shown = ", ".join(clip(name, 20) for name in names[:8]) or "none"
        raise UsageError(
            f"{where}: no column {', '.join(missing)} (columns: {shown}); it needs {', '.join(COLUMNS)}"
        )
    return [found.index(column) for column in COLUMNS]


def _read_csv(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import pandas as pd

    where = _where(path)
    text = decode_user_text(read_user_bytes(path, "expert-load table", MAX_LOAD_FILE_BYTES), where)
    header = next(csv.reader(io.StringIO(text[: 1 << 16].split("\n", 1)[0])), [])
    positions = _columns(header, where)
    try:
        frame = pd.read_csv(
            io.StringIO(text),
            usecols=positions,
            dtype=str,
            keep_default_na=False,
            skipinitialspace=True,
            nrows=MAX_LOAD_ROWS + 1,
        )
    except (ValueError, pd.errors.ParserError) as exc:
        raise UsageError(
            f"{where}: not a readable CSV table ({clip(str(exc).splitlines()[0] if str(exc) else '')})"
        ) from None
    if len(frame) > MAX_LOAD_ROWS:
        raise UsageError(
            f"{where}: more than {MAX_LOAD_ROWS} rows; sum the steps (rows of a layer and expert add up)"
        )
    # usecols keeps the file's column order: look each one up by the header's position.
    by_position = dict(zip(sorted(positions), frame.columns, strict=True))
    values = []
    for column, position in zip(COLUMNS, positions, strict=True):
        texts = frame[by_position[position]].str.strip()
        numbers = pd.to_numeric(texts, errors="coerce").to_numpy(dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(numbers))
        if bad.size:
            row = int(bad[0])
            raise UsageError(
                f"{where}: row {row + 1}: {column} {clip(repr(texts.iloc[row]), 30)} is not a number; write "
                "whole numbers (tokens may be fractional)"
            )
        values.append(numbers)
    return values[0], values[1], values[2]


def _read_parquet(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = _where(path)
    data = read_user_bytes(path, "expert-load table", MAX_LOAD_FILE_BYTES)
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        names = parquet.schema_arrow.names
        positions = _columns(names, where)
        if parquet.metadata.num_rows > MAX_LOAD_ROWS:
            raise UsageError(
                f"{where}: more than {MAX_LOAD_ROWS} rows; sum the steps (rows of a layer and expert add up)"
            )
        # One thread: a refusal right after a threaded read could abort the process at exit (exit 134).
        table = parquet.read(columns=[names[position] for position in positions], use_threads=False)
    except UsageError:
        raise
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise UsageError(f"{where}: not a readable Parquet table ({clip(str(exc))})") from None
    values = []
    for column, array in zip(COLUMNS, table.columns, strict=True):
        if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)):
            raise UsageError(f"{where}: column {column} holds {clip(str(array.type), 30)}, not numbers")
        if array.null_count:
            raise UsageError(f"{where}: column {column} has empty (null) values")
        values.append(array.to_numpy().astype(np.float64))
    return values[0], values[1], values[2]


def _check(path: str, layer: np.ndarray, expert: np.ndarray, tokens: np.ndarray) -> ExpertLoad:
    """Whole non-negative layer and expert ids, finite non-negative tokens; UsageError naming the row."""
    where = _where(path)
    if not layer.size:
        raise UsageError(f"{where}: has no rows; it needs one row per (layer, expert) with its tokens")
    for column, values, whole in (
        ("layer", layer, True),
        ("expert", expert, True),
        ("tokens", tokens, False),
    ):
        bad = ~np.isfinite(values) | (values < 0)
        if whole:
            bad |= (values != np.floor(values)) | (values >= MAX_ID)
        else:
            bad |= values > MAX_ROW_TOKENS  # 1.7e308 tokens would overflow the sum into inf
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            count = f"a number >= 0 and <= {MAX_ROW_TOKENS:.0e} (a count of tokens)"
            kind = "a whole number >= 0" if whole else count
            raise UsageError(f"{where}: row {row + 1}: {column} {values[row]:g} must be {kind}")
    return ExpertLoad(path, layer.astype(np.int64), expert.astype(np.int64), tokens)


def read_expert_load(path: str | os.PathLike[str]) -> ExpertLoad:
    """A load table from ``.csv`` or ``.parquet`` (checked as the module docstring says)."""
    text = os.path.expanduser(os.fspath(path))
    suffix = Path(text).suffix.lower()
    if suffix == ".parquet":
        columns = _read_parquet(text)
    elif suffix in (".csv", ".txt"):
        columns = _read_csv(text)
    else:
        raise UsageError(
            f"{_where(text)}: unsupported file type {clip(suffix) or '(none)'}; use .csv or .parquet"
        )
    return _check(text, *columns)


def layer_loads(
    table: ExpertLoad, num_experts: int, layer: int | None = None, model: str = "the model"
) -> np.ndarray:
    """float64 [num_experts]: tokens per expert of ``layer`` (None: summed over every layer). UsageError for
    an expert id out of range for ``num_experts``, an unknown layer, or a layer without tokens."""
    where = _where(table.path)
    if table.expert.size and int(table.expert.max()) >= num_experts:
        row = int(np.argmax(table.expert))
        raise UsageError(
            f"{where}: row {row + 1}: expert {int(table.expert[row])} is out of range for {model}'s "
            f"{num_experts} experts (ids 0..{num_experts - 1}); was it logged for another model?"
        )
    chosen = np.ones(table.layer.shape, dtype=bool) if layer is None else table.layer == layer
    if not chosen.any():
        layers = table.layers
        shown = ", ".join(str(value) for value in layers[:8]) + (", ..." if len(layers) > 8 else "")
        raise UsageError(f"{where}: no layer {layer} (layers: {shown}); pick one after load:PATH:")
    loads = np.bincount(table.expert[chosen], weights=table.tokens[chosen], minlength=num_experts)
    if not loads.sum() > 0:
        which = "any layer" if layer is None else f"layer {layer}"
        raise UsageError(f"{where}: {which} has no tokens; pick a layer with a load")
    return loads


def expert_weights(
    path: str, num_experts: int, layer: int | None = None, model: str = "the model"
) -> np.ndarray:
    """Popularity weights float64 [num_experts], mean 1, proportional to the layer's tokens per expert (a
    floor of ZERO_LOAD_WEIGHT for experts without tokens)."""
    loads = layer_loads(read_expert_load(path), num_experts, layer, model)
    # Scaled by the largest first: loads of 1e-320 (subnormal) or 1e15 keep their ratios instead of
    # overflowing into inf or underflowing into a uniform routing.
    loads = loads / loads.max()
    weights = loads * (num_experts / loads.sum())
    weights = np.maximum(weights, ZERO_LOAD_WEIGHT)
    return weights * (num_experts / weights.sum())

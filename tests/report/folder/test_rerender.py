"""Re-rendering a saved run (``commbench report DIR``) never changes its data files.

A run's pages and a re-render's come from the same place: the folder's files read back typed
(``report.folder.reading``) through ``render_folder``, so results.json and results.parquet are written the
same both times, and the typed read-back holds each column once in one type.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from commbench.inputs.specs import load_spec
from commbench.report import rank_frame, read_report, render_report, results_frame
from commbench.report.folder.writer import ReportWriter
from tests.report.rows import (
    DISPATCH,
    TWO_DOMAINS,
    balanced_matrix,
    balanced_row,
    rank_rows_from_matrix,
    row_from_matrix,
)

HGX = load_spec("hgx-h100")
# Written once by the run, never by a re-render.
SOURCES = ("results.csv", "ranks.csv", "meta.json")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _files(out: Path) -> dict[str, tuple[bytes, int, int]]:
    """(bytes, inode, mtime) of the data files: a rewrite with the same bytes still shows (write_atomic
    replaces the file)."""
    files = {}
    for name in (*SOURCES, "results.json", "results.parquet"):
        stat = (out / name).stat()
        files[name] = ((out / name).read_bytes(), stat.st_ino, stat.st_mtime_ns)
    return files


def assert_rerender_keeps_the_data_files(out: Path) -> None:
    before = _files(out)
    render_report(out)
    after = _files(out)
    for name in SOURCES:  # never written: same bytes, same file, same time
        assert after[name] == before[name], name
    assert after["results.json"][0].decode() == before["results.json"][0].decode()
    new, old = after["results.parquet"][0], before["results.parquet"][0]
    first, again = pq.read_table(io.BytesIO(old)), pq.read_table(io.BytesIO(new))
    # Types column by column (e.g. string vs large_string, null vs double), then the values.
    assert [(f.name, str(f.type)) for f in again.schema] == [(f.name, str(f.type)) for f in first.schema]
    assert again.equals(first)
    pd.testing.assert_frame_equal(pd.read_parquet(io.BytesIO(new)), pd.read_parquet(io.BytesIO(old)))
    assert new == old  # byte for byte: both renders write the frame of the same read-back


# ---------------------------------------------------------------------------------------------------------
# Rows with every kind of column that a CSV cannot hold as it is


def _rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A balanced row in one domain (no MoE case: None in skew, tokens_per_rank, maxvio...; nothing crosses
    scale-out; its rank rows repeat size_bytes) and an MoE phase over two domains (its rank rows have
    size_bytes None), with backend knob columns whose values a CSV cell cannot keep as they are."""
    balanced = balanced_row(4, 4096, 10.0, tokens_per_rank=None, maxvio=None, send_mode=None)
    moe = row_from_matrix(
        DISPATCH, 100.0, pattern="toy", phase="dispatch", domains=TWO_DOMAINS, skew="zipf:1.2",
        tokens_per_rank=64, maxvio=1.5, send_mode="token",
    )  # fmt: skip
    knobs = (
        {"chunk": 4, "never_set": None, "flag": True, "knobs": {"chunk": 4, "signal": "chunk"}},
        {"chunk": "auto", "never_set": None, "flag": None, "knobs": {"chunk": "auto", "signal": "chunk"}},
    )
    rows = [{**balanced, **knobs[0]}, {**moe, **knobs[1]}]
    rank_rows = []
    layouts = ((balanced_matrix(4, 4096), np.zeros(4, dtype=np.int64)), (DISPATCH, TWO_DOMAINS))
    for row, (matrix, domains) in zip(rows, layouts, strict=True):
        for record in rank_rows_from_matrix(row, matrix, domains):
            size = row["size_bytes"] if row["phase"] == "alltoall" else None
            rank_rows.append({**record, "size_bytes": size, "arrival_us_p50": None})
    return rows, rank_rows


def test_the_run_and_a_rerender_render_the_same_typed_rows(tmp_path: Path) -> None:
    rows, rank_rows = _rows()
    writer = ReportWriter(tmp_path / "run", {"args": {}}, HGX)
    for row in rows:  # one phase at a time, as the harness adds them
        writer.add([row], [r for r in rank_rows if r["phase"] == row["phase"]])
    finished = writer.finalize()
    _, results, ranks = read_report(tmp_path / "run")

    read_back = results_frame(results, HGX)
    pd.testing.assert_frame_equal(finished, read_back, check_exact=True)
    # The typed read-back: each column in one type, whatever the harness's rows held in memory.
    assert read_back["knobs"].tolist() == ["chunk=4 signal=chunk", "chunk=auto signal=chunk"]
    assert read_back["chunk"].tolist() == ["4", "auto"]  # mixed kinds: the text of each
    assert read_back["flag"].tolist() == [True, None]
    assert read_back["emulated"].dtype == bool
    assert read_back["never_set"].dtype == float and read_back["never_set"].isna().all()
    assert read_back["tokens_per_rank"].dtype == float and read_back["maxvio"].dtype == float
    assert read_back["skew"].isna().tolist() == [True, False]
    assert pd.api.types.is_string_dtype(read_back["send_mode"])
    assert read_back["scaleout_bottleneck_dir"].tolist() == ["", "recv"]  # "" where nothing crossed
    assert rank_frame(ranks)["size_bytes"].dtype == float

    first = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    assert [result["scaleout_bottleneck_dir"] for result in first] == ["", "recv"]  # "", never null

    assert_rerender_keeps_the_data_files(tmp_path / "run")
    again = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    assert [result["scaleout_bottleneck_dir"] for result in again] == ["", "recv"]


# ---------------------------------------------------------------------------------------------------------
# End to end: real runs on gloo (two ranks: a few seconds each)


def _run(out: Path, *args: str) -> None:
    env = {key: value for key, value in os.environ.items() if key not in TORCHRUN_VARIABLES}
    env.pop("COMMBENCH_DEBUG", None)
    command = [sys.executable, "-m", "commbench", "run", *args, "--world-size", "2", "--backend", "gloo"]
    command += ["--warmup", "1", "--iters", "2", "--out", str(out)]
    done = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_rerender_of_a_moe_run_keeps_its_data_files(tmp_path: Path) -> None:
    # One rank per domain: every link byte crosses scale-out (its direction filled), NVLink carries
    # nothing (its direction ""); the imbalance cost fills the balanced_* columns.
    out = tmp_path / "moe"
    moe = ("--model", "deepseek-v3", "--skew", "zipf:1.2", "--tokens", "32", "--imbalance-cost")
    _run(out, *moe, "--ranks-per-domain", "1")
    results = pd.read_csv(out / "results.csv", keep_default_na=False)
    assert set(results["scaleout_bottleneck_dir"]) <= {"send", "recv"}
    assert set(results["nvlink_bottleneck_dir"]) == {""} and (results["uniform_ref_time_us_p50"] > 0).all()
    assert_rerender_keeps_the_data_files(out)


def test_rerender_of_a_balanced_run_keeps_its_data_files(tmp_path: Path) -> None:
    # One domain: nothing crosses scale-out; no MoE case (skew, tokens, maxvio... empty in every row).
    out = tmp_path / "balanced"
    _run(out, "--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "4K")
    results = pd.read_csv(out / "results.csv", keep_default_na=False)
    assert set(results["scaleout_bottleneck_dir"]) == {""} and set(results["skew"]) == {""}
    assert_rerender_keeps_the_data_files(out)

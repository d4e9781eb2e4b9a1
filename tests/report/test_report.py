"""Report stage on synthetic harness rows: bandwidth math, tables, writer, re-render."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from commbench.errors import UsageError
from commbench.report import (
    CONVENTIONS,
    DERIVED_COLUMNS,
    BandwidthSpec,
    ReportWriter,
    average_bus_bandwidth,
    format_bandwidth,
    format_table,
    markdown_table,
    render_report,
    results_frame,
    results_json,
)


def row_from_matrix(
    matrix: np.ndarray, time_us: float, *, pattern: str, phase: str, size_bytes: int | None = None, **extra
) -> dict:
    """A harness-like result row from a [src][dst] bytes matrix (self traffic on the diagonal)."""
    sent, recv, self_bytes = matrix.sum(1), matrix.sum(0), np.diag(matrix)
    if size_bytes is None:  # MoE rows: the bottleneck rank's max(sent, received), self included
        size_bytes = int(np.maximum(sent, recv).max())
    return {
        "pattern": pattern,
        "phase": phase,
        "backend": "gloo",
        "backend_name": "gloo",
        "emulated": False,
        "world_size": matrix.shape[0],
        "skew": extra.pop("skew", None),
        "size_bytes": size_bytes,
        "total_bytes": int(matrix.sum()),
        "self_bytes": int(self_bytes.sum()),
        "link_bytes": int(matrix.sum() - self_bytes.sum()),
        "max_send_bytes": int(sent.max()),
        "max_recv_bytes": int(recv.max()),
        "max_send_link_bytes": int((sent - self_bytes).max()),
        "max_recv_link_bytes": int((recv - self_bytes).max()),
        "time_us_min": time_us * 0.9,
        "time_us_p50": time_us,
        "time_us_p99": time_us * 1.2,
        "time_us_mean": time_us,
        "wrong": 0,
        **extra,
    }


def balanced_row(world: int, size_bytes: int, time_us: float) -> dict:
    matrix = np.full((world, world), size_bytes // world, dtype=np.int64)
    return row_from_matrix(matrix, time_us, pattern="balanced", phase="alltoall", size_bytes=size_bytes)


def skewed_rows(time_us: float = 100.0) -> list[dict]:
    # Rank 2 is the hot destination in dispatch; combine is the transpose.
    dispatch = (
        np.array([[10, 20, 300, 5], [7, 11, 290, 3], [4, 6, 400, 2], [9, 1, 250, 8]], dtype=np.int64) * 1000
    )
    common = dict(pattern="toy", skew="hot:1:0.5", send_mode="token", tokens_per_rank=64, maxvio=1.5)
    return [
        row_from_matrix(dispatch, time_us, phase="dispatch", **common),
        row_from_matrix(dispatch.T.copy() * 2, 2 * time_us, phase="combine", **common),
    ]


def rank_rows_for(row: dict, world: int) -> list[dict]:
    return [
        {
            "pattern": row["pattern"],
            "skew": row.get("skew"),
            "phase": row["phase"],
            "rank": rank,
            "sent_bytes": 1000 * (rank + 1),
            "recv_bytes": 2000 * (world - rank),
            "self_bytes": 100,
            "time_us_p50": row["time_us_p50"],
        }
        for rank in range(world)
    ]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_balanced_busbw_is_nccl_tests_busbw(world: int) -> None:
    sizes = [world * 1024, world * 1 << 20]
    frame = results_frame([balanced_row(world, size, time_us=250.0) for size in sizes])
    for size, (_, row) in zip(sizes, frame.iterrows(), strict=True):
        algbw = size / 250e-6 / 1e9
        assert row["algbw_GBps"] == pytest.approx(algbw, rel=1e-12)
        assert row["busbw_GBps"] == pytest.approx(algbw * (world - 1) / world, rel=1e-12)
        assert row["per_gpu_GBps"] == row["busbw_GBps"]


def test_skewed_bandwidth_uses_bottleneck_rank_and_one_direction() -> None:
    frame = results_frame(skewed_rows(time_us=100.0))
    dispatch, combine = frame.iloc[0], frame.iloc[1]
    # Rank 2 receives 1,240,000 B in dispatch, 400,000 of it from itself: link bytes 840,000.
    assert dispatch["size_bytes"] == 1_240_000
    assert dispatch["algbw_GBps"] == pytest.approx(1_240_000 / 100e-6 / 1e9)
    assert dispatch["busbw_GBps"] == pytest.approx(840_000 / 100e-6 / 1e9)
    total = sum([10, 20, 300, 5, 7, 11, 290, 3, 4, 6, 400, 2, 9, 1, 250, 8]) * 1000
    link = total - (10 + 11 + 400 + 8) * 1000
    assert dispatch["agg_GBps"] == pytest.approx(link / 100e-6 / 1e9)
    # Combine: the transpose (x2 bytes, 2x time): rank 2 now sends the most; same bandwidth.
    assert combine["busbw_GBps"] == pytest.approx(dispatch["busbw_GBps"])


def test_spec_columns_default_and_custom() -> None:
    frame = results_frame([balanced_row(4, 4 << 20, 100.0)])
    row = frame.iloc[0]
    assert row["spec_GBps"] == 900.0
    assert row["pct_spec"] == pytest.approx(100 * row["busbw_GBps"] / 900.0)
    # 130 TB/s bidirectional for 72 GPUs -> one direction, 4 ranks' share.
    assert row["agg_spec_GBps"] == pytest.approx(130_000 * 4 / 72 / 2)
    assert row["pct_agg_spec"] == pytest.approx(100 * row["agg_GBps"] / row["agg_spec_GBps"])
    hgx = BandwidthSpec("NVLink 4 (HGX H100)", 450.0, 8, 7200.0)
    custom = results_frame([balanced_row(4, 4 << 20, 100.0)], hgx).iloc[0]
    assert custom["spec_name"] == "NVLink 4 (HGX H100)"
    assert custom["pct_spec"] == pytest.approx(100 * custom["busbw_GBps"] / 450.0)
    assert custom["agg_spec_GBps"] == pytest.approx(7200.0 * 4 / 8 / 2)
    assert BandwidthSpec.from_dict({"name": "x", "per_gpu_GBps_per_direction": 1.0, "future": 3}).name == "x"


def test_results_frame_columns_zero_time_and_empty() -> None:
    row = balanced_row(2, 2048, 0.0)
    frame = results_frame([row])
    assert set(DERIVED_COLUMNS) <= set(frame.columns)
    assert set(row) <= set(frame.columns)
    assert math.isnan(frame.iloc[0]["algbw_GBps"]) and math.isnan(frame.iloc[0]["busbw_GBps"])
    assert math.isnan(average_bus_bandwidth(frame))
    empty = results_frame([])
    assert empty.empty and set(DERIVED_COLUMNS) <= set(empty.columns)
    with pytest.raises(UsageError, match="size_bytes"):
        results_frame([{"pattern": "x", "time_us_p50": 1.0}])


def test_results_frame_recomputes_stale_derived_columns() -> None:
    frame = results_frame([balanced_row(4, 4096, 10.0)])
    stale = frame.assign(busbw_GBps=123456.0, pct_spec=-1.0)
    again = results_frame(stale)
    assert again.iloc[0]["busbw_GBps"] == pytest.approx(frame.iloc[0]["busbw_GBps"])
    assert again.iloc[0]["pct_spec"] == pytest.approx(frame.iloc[0]["pct_spec"])


def test_format_table_has_columns_and_average_footer() -> None:
    rows = [balanced_row(4, 4096, 10.0), balanced_row(4, 8192, 12.0), *skewed_rows()]
    frame = results_frame(rows)
    text = format_table(frame)
    for header in (
        "pattern",
        "phase",
        "size(B)",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "%spec",
        "#wrong",
    ):
        assert header in text
    expected_avg = frame["busbw_GBps"].mean()
    assert f"# Avg bus bandwidth    : {format_bandwidth(expected_avg)} GB/s" in text
    assert float(format_bandwidth(expected_avg)) == pytest.approx(expected_avg, rel=5e-3)
    assert "hot:1:0.5" in text and "dispatch" in text and "combine" in text
    assert len([line for line in text.splitlines() if not line.startswith("#")]) == len(rows)


def test_markdown_table_alignment() -> None:
    text = markdown_table(["name", "GB/s"], [["a", "1.50"], ["bb", "10.25"]])
    lines = text.splitlines()
    assert lines[0] == "| name |  GB/s |"
    assert lines[1] == "|------|------:|"
    assert lines[3] == "| bb   | 10.25 |"


def test_writer_refuses_non_empty_dir_and_touches_nothing(tmp_path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.csv").write_text("precious\n")
    with pytest.raises(UsageError, match="not empty"):
        ReportWriter(out, {"args": {}})
    assert sorted(p.name for p in out.iterdir()) == ["results.csv"]
    assert (out / "results.csv").read_text() == "precious\n"
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match="not a folder"):
        ReportWriter(afile, {})


def test_writer_appends_incrementally_and_finalizes(tmp_path) -> None:
    out = tmp_path / "nested" / "run"
    writer = ReportWriter(
        out, {"args": {"world_size": 4}, "env": {"hostname": "h", "versions": {"nccl": None}}}
    )
    assert json.loads((out / "meta.json").read_text())["spec"]["per_gpu_GBps_per_direction"] == 900.0

    first = [balanced_row(4, 4096, 10.0)]
    writer.add(first, rank_rows_for(first[0], 4))
    saved = pd.read_csv(out / "results.csv")
    assert len(saved) == 1 and saved.iloc[0]["busbw_GBps"] == pytest.approx(4096 * 3 / 4 / 10e-6 / 1e9)
    assert len(pd.read_csv(out / "ranks.csv")) == 4

    # A later phase with an extra (knob) column: the file is rewritten with the wider header, no row lost.
    second = [dict(r, num_blocks=24) for r in skewed_rows()]
    writer.add(second, [r for row in second for r in rank_rows_for(row, 4)])
    saved = pd.read_csv(out / "results.csv")
    assert len(saved) == 3
    assert list(saved.columns).count("pattern") == 1
    assert math.isnan(saved.iloc[0]["num_blocks"]) and saved.iloc[2]["num_blocks"] == 24
    assert len(pd.read_csv(out / "ranks.csv")) == 12
    writer.add([], [])

    frame = writer.finalize()
    assert len(frame) == 3
    for name in ("results.parquet", "results.json", "summary.md", "report.html"):
        assert (out / name).stat().st_size > 0
    parquet = pd.read_parquet(out / "results.parquet")
    assert parquet["busbw_GBps"].tolist() == pytest.approx(frame["busbw_GBps"].tolist())

    data = json.loads((out / "results.json").read_text())
    assert data["conventions"] == CONVENTIONS
    assert data["args"] == {"world_size": 4}
    assert data["env"]["hostname"] == "h"
    assert len(data["results"]) == 3
    first_result = data["results"][0]
    assert first_result["size"] == 4096 and first_result["time"] == 10.0
    assert first_result["bus_bw"] == pytest.approx(frame.iloc[0]["busbw_GBps"])
    assert first_result["alg_bw"] == pytest.approx(frame.iloc[0]["algbw_GBps"])
    assert first_result["wrong"] == 0
    assert data["average_bus_bandwidth"] == pytest.approx(frame["busbw_GBps"].mean())

    summary = (out / "summary.md").read_text()
    assert CONVENTIONS in summary
    assert "### balanced" in summary and "### toy" in summary
    assert "| backend |" in summary
    html_text = (out / "report.html").read_text()
    assert "data:image/png;base64," in html_text
    assert html_text.count("<img") >= 3  # balanced sweep, per-GPU vs spec, per-rank bytes
    assert "Conventions" in html_text


def test_results_json_reads_like_nccl_tests_json() -> None:
    # nccl-tests -J nests each row's figures under out_of_place {time, alg_bw, bus_bw, nwrong}.
    rows = [balanced_row(4, 4096, 10.0), {**balanced_row(4, 8192, 16.0), "wrong": 3}]
    spec = BandwidthSpec()
    data = results_json(results_frame(rows, spec), {"args": {}}, spec)
    for result, wrong in zip(data["results"], (0, 3), strict=True):
        nested = result["out_of_place"]
        assert set(nested) == {"time", "alg_bw", "bus_bw", "nwrong"}
        assert nested["nwrong"] == result["wrong"] == wrong
        assert nested["time"] == result["time"] and nested["bus_bw"] == result["bus_bw"]
        assert nested["alg_bw"] == pytest.approx(result["size"] / (result["time"] * 1e3))
        assert result["in_place"] is None


def test_render_report_roundtrip(tmp_path) -> None:
    out = tmp_path / "run"
    writer = ReportWriter(out, {"args": {"tokens": 64}}, spec=BandwidthSpec("NVLink 4", 450.0, 8, 7200.0))
    rows = [balanced_row(4, 4096, 10.0), *skewed_rows()]
    writer.add(rows, [r for row in rows for r in rank_rows_for(row, 4)])
    original = writer.finalize()
    for name in ("results.parquet", "results.json", "summary.md", "report.html"):
        (out / name).unlink()

    again = render_report(out)
    columns = ["size_bytes", "time_us_p50", "algbw_GBps", "busbw_GBps", "pct_spec", "agg_spec_GBps"]
    np.testing.assert_allclose(again[columns].to_numpy(float), original[columns].to_numpy(float))
    assert (again["spec_name"] == "NVLink 4").all()  # the spec comes back from meta.json
    assert again["skew"].tolist()[1:] == ["hot:1:0.5", "hot:1:0.5"]
    for name in ("results.parquet", "results.json", "summary.md", "report.html"):
        assert (out / name).is_file()
    assert json.loads((out / "results.json").read_text())["args"] == {"tokens": 64}


def test_render_report_errors(tmp_path) -> None:
    with pytest.raises(UsageError, match="results.csv"):
        render_report(tmp_path)
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UsageError, match="lack column"):
        render_report(tmp_path)


def link_class_row(time_us: float = 1000.0) -> dict:
    """4 ranks in domains {0, 1}, {2, 3}; M[src][dst] = (4 src + dst) x 1e6 B (as in tests/test_links.py)."""
    from commbench.traffic.links import link_class_byte_columns

    matrix = np.arange(16, dtype=np.int64).reshape(4, 4) * 1_000_000
    row = row_from_matrix(matrix, time_us, pattern="toy", phase="dispatch", skew="zipf:1.2")
    return {**row, **link_class_byte_columns(matrix, np.array([0, 0, 1, 1]))}


def test_link_class_bandwidths_against_class_specs() -> None:
    from commbench.inputs.specs import load_spec

    spec = BandwidthSpec.from_system(load_spec("gb200-nvl72"))
    assert spec.nic_GBps_per_direction == 50.0 and spec.per_gpu_GBps_per_direction == 900.0
    row = results_frame([link_class_row(1000.0)], spec).iloc[0]  # 1 ms: GB/s = bytes / 1e6
    # NVLink bottleneck: 14e6 B (rank 2 receives from rank 3); scale-out: rank 3 sends 25e6 B.
    assert row["nvlink_GBps"] == pytest.approx(14.0) and row["scaleout_GBps"] == pytest.approx(25.0)
    assert row["nvlink_spec_GBps"] == 900.0 and row["scaleout_spec_GBps"] == 50.0  # per direction
    assert row["nvlink_pct_spec"] == pytest.approx(100 * 14 / 900)
    assert row["scaleout_pct_spec"] == pytest.approx(50.0)
    assert row["nvlink_agg_GBps"] == pytest.approx(30.0) and row["scaleout_agg_GBps"] == pytest.approx(60.0)
    assert row["nvlink_agg_spec_GBps"] == pytest.approx(130000 / 2 * 4 / 72)
    assert row["scaleout_agg_spec_GBps"] == pytest.approx(4 * 50.0)
    # algbw (self included) and link bandwidth (busbw, self excluded) side by side.
    assert row["algbw_GBps"] == pytest.approx(54.0) and row["busbw_GBps"] == pytest.approx(39.0)
    # Rows without link-class bytes (older results) get NaN, not an error.
    old = results_frame([balanced_row(4, 4096, 10.0)]).iloc[0]
    assert math.isnan(old["nvlink_GBps"]) and math.isnan(old["skew_cost"])


def test_summary_has_link_class_and_skew_cost_tables(tmp_path) -> None:
    out = tmp_path / "run"
    meta = {"topology": {"description": "4 ranks in NVLink domains of 2 x 2 ranks; found by override"}}
    writer = ReportWriter(out, meta)
    row = {
        **link_class_row(1000.0),
        "balanced_size_bytes": 28_000_000,
        "balanced_total_bytes": 112_000_000,
        "balanced_time_us_p50": 500.0,
    }
    writer.add([row], rank_rows_for(row, 4))
    frame = writer.finalize()
    assert frame.iloc[0]["skew_cost"] == pytest.approx(2.0)
    assert frame.iloc[0]["skew_bw_loss_pct"] == pytest.approx(100 * (1 - (120 / 1000) / (112 / 500)))
    summary = (out / "summary.md").read_text()
    assert "Topology: 4 ranks in NVLink domains of 2 x 2 ranks; found by override." in summary
    assert "## By link class" in summary and "NIC 100 GB/s" in summary
    header = next(line for line in summary.splitlines() if "NVLink/GPU(GB/s)" in line)
    for name in ("algbw self incl.(GB/s)", "link bw self excl.(GB/s)", "%NIC spec", "scale-out neck"):
        assert name in header
    assert " 3 send |" in summary  # the scale-out bottleneck: rank 3 sending
    assert "## What skew costs" in summary and "2.00" in summary
    assert "never compared with a bidirectional spec" in " ".join(CONVENTIONS.split())
    html_text = (out / "report.html").read_text()
    assert "By link class" in html_text and "What skew costs" in html_text

"""A library's bandwidth as it prints it, from commbench's row columns, beside busbw; the conversion table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from commbench.report.frame import results_frame
from commbench.report.interop.vocabulary import library_figures, vocabulary_table, with_library_columns
from commbench.run.rows import byte_columns, time_columns


def _row(backend: str, phase: str, knobs, matrix: np.ndarray, time_us: float, **extra) -> dict:
    seconds = np.full((matrix.shape[0], 3), time_us * 1e-6)
    return {
        "pattern": "tiny",
        "phase": phase,
        "backend": backend,
        "backend_name": backend,
        "world_size": matrix.shape[0],
        "row_bytes": 100,
        **byte_columns(matrix),
        **time_columns(seconds),
        "knobs": knobs,
        **extra,
    }


# 2 ranks; rank 1 receives 3000 B of which 1000 B from itself: DeepEP counts the 1000, busbw does not.
MATRIX = np.array([[500, 2000], [700, 1000]])


def test_deepep_normal_counts_received_rows_with_self_traffic_over_the_call():
    frame = results_frame([_row("deep-ep", "dispatch", {"mode": "normal"}, MATRIX, 2.0)])
    (figure,) = library_figures(frame).to_dict("records")
    assert figure["library"] == "DeepEP" and figure["library_figure"] == "GB/s (NVL)"
    assert figure["library_GBps"] == pytest.approx(3000 / 2.0e3)  # bytes / (us * 1e3) = GB/s
    assert figure["busbw_GBps"] == pytest.approx(2000 / 2.0e3)  # the bottleneck's link bytes, self excluded
    assert "max_recv_bytes" in figure["library_bytes"] and "time_us_mean" in figure["library_time"]


def test_the_mode_knob_picks_the_figure_from_memory_or_from_a_files_text():
    rows = [
        _row("deep-ep", "dispatch", {"mode": "low_latency", "num_rdma_bytes": 1}, MATRIX, 1.0),
        _row("deep-ep", "combine", "mode=normal num_sms=24", MATRIX.T.copy(), 4.0),
        _row("gloo", "dispatch", {}, MATRIX, 1.0),
        _row("pplx", "combine", {"mode": "internode"}, MATRIX, 1.0),
    ]
    frame = with_library_columns(results_frame(rows))
    assert list(frame["library_figure"]) == [
        "DeepEP Dispatch bandwidth",
        "DeepEP GB/s (NVL)",
        "",
        "pplx-kernels Combine_bw",
    ]
    # low_latency dispatch: the rank's selections sent (2500 B = 25 rows of 100 B, self included), each
    # message with DeepEP's 16-byte header, over 1 us.
    assert frame["library_GBps"].iloc[0] == pytest.approx(2.5 + 25 * 16 / 1e3)
    assert frame["library_GBps"].iloc[1] == pytest.approx(3000 / 4.0e3)  # combine: the most rows sent back
    assert math.isnan(frame["library_GBps"].iloc[2])
    assert frame["library_GBps"].iloc[3] == pytest.approx(3.0)


def test_a_backend_without_a_library_figure_gives_no_rows():
    frame = results_frame([_row("gloo", "dispatch", {}, MATRIX, 1.0)])
    assert library_figures(frame).empty


def test_every_definition_reads_columns_the_harness_writes():
    from commbench.backends import loaded_backends

    written = set(byte_columns(MATRIX)) | set(time_columns(np.ones((2, 2))))
    declared = {name: cls.bandwidth_vocabulary for name, cls in loaded_backends() if cls.bandwidth_vocabulary}
    assert set(declared) >= {"deep-ep", "uccl-ep", "pplx", "nccl-ep"}  # each adapter carries its library's
    for figures in declared.values():
        for item in figures:
            assert item.bytes_column in written and item.time_column in written, item
            assert item.phase in ("dispatch", "combine")


def test_the_conversion_table_lists_every_library_and_mode():
    table = vocabulary_table()
    for text in (
        "DeepEP GB/s (NVL)",
        "DeepEP Dispatch bandwidth",
        "UCCL-EP",
        "pplx-kernels Dispatch_bw",
        "NCCL EP total_recv",
        "NCCL EP dispatch throughput",
        "max_recv_bytes / time_us_mean",
    ):
        assert text in table
    assert table.startswith("| backend | mode")
    assert "<table>" in vocabulary_table("html")


def test_each_low_latency_figure_counts_the_bytes_its_own_test_counts():
    """DeepEP's test_low_latency.py:218-224 counts a dispatch message as the kernel's num_bytes_per_msg, the
    row plus a 16-byte int4 header (internode_ll.cu:180); UCCL-EP's test_low_latency.py:424-430 counts a BF16
    dispatch as hidden x 2 bytes, no header; NCCL EP's ep_bench.cu:1933-1938 BF16 bytes per selection. The
    combine (BF16 rows, no header) alike for all three. 10 rows of 100 B, 1 us."""
    matrix = np.array([[600, 400], [0, 0]])
    rows = [
        _row("deep-ep", "dispatch", {"mode": "low_latency"}, matrix, 1.0),
        _row("uccl-ep", "dispatch", {"mode": "low_latency"}, matrix, 1.0),
        _row("nccl-ep", "dispatch", {"mode": "ll"}, matrix, 1.0),
        _row("deep-ep", "combine", {"mode": "low_latency"}, matrix.T.copy(), 1.0),
    ]
    frame = with_library_columns(results_frame(rows))
    assert list(frame["library_GBps"]) == pytest.approx([1.16, 1.0, 1.0, 1.0])


def test_deepep_v2_counts_each_tokens_top_k_ids_and_weights():
    """DeepEP V2's tests/elastic/test_ep.py:253-262: count_bytes(recv_x, recv_topk_idx, recv_topk_weights)
    per received token, "GB/s (SU)": the row's token_meta_bytes (its top-k ids and weights, 4 x (8 + 4) B
    here) on each of the 20 rows the busiest rank received; the combine counts the BF16 rows only."""
    matrix = np.array([[1000, 2000], [1000, 0]])
    rows = [
        _row("deep-ep", "dispatch", {"mode": "elastic"}, matrix, 2.0, token_meta_bytes=48),
        _row("deep-ep", "combine", {"mode": "elastic"}, matrix.T.copy(), 2.0, token_meta_bytes=48),
    ]
    figures = library_figures(results_frame(rows)).to_dict("records")
    assert [f["library_figure"] for f in figures] == ["GB/s (SU)", "GB/s (SU)"]
    assert figures[0]["library_GBps"] == pytest.approx((2000 + 20 * 48) / 2e3)
    assert figures[1]["library_GBps"] == pytest.approx(2000 / 2e3)
    assert "row_bytes + token_meta_bytes" in figures[0]["library_bytes"]

"""A library's bandwidth as it prints it, from commbench's row columns, beside busbw; the conversion table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from commbench.report.frame import results_frame
from commbench.report.interop.vocabulary import library_figures, vocabulary_table, with_library_columns
from commbench.run.rows import byte_columns, time_columns


def _row(backend: str, phase: str, knobs, matrix: np.ndarray, time_us: float) -> dict:
    seconds = np.full((matrix.shape[0], 3), time_us * 1e-6)
    return {
        "pattern": "tiny",
        "phase": phase,
        "backend": backend,
        "backend_name": backend,
        "world_size": matrix.shape[0],
        **byte_columns(matrix),
        **time_columns(seconds),
        "knobs": knobs,
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
    # low_latency dispatch: the rank's selections sent (2500 B, self included) over 1 us.
    assert frame["library_GBps"].iloc[0] == pytest.approx(2.5)
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

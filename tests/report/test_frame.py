"""report.frame: every GB/s, %spec and aggregate of result and rank rows, against a SystemSpec."""

from __future__ import annotations

import math

import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.inputs.specs import load_spec
from commbench.report import (
    DERIVED_COLUMNS,
    RANK_DERIVED_COLUMNS,
    average_bus_bandwidth,
    rank_frame,
    results_frame,
)
from tests.report.rows import (
    DISPATCH,
    TWO_DOMAINS,
    balanced_row,
    rank_rows_from_matrix,
    row_from_matrix,
    skewed_rows,
)

GB300 = load_spec("gb300-nvl72")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_balanced_busbw_is_nccl_tests_busbw(world: int) -> None:
    sizes = [world * 1024, world * 1 << 20]
    frame = results_frame([balanced_row(world, size, time_us=250.0) for size in sizes], GB300)
    for size, (_, row) in zip(sizes, frame.iterrows(), strict=True):
        algbw = size / 250e-6 / 1e9
        assert row["algbw_GBps"] == pytest.approx(algbw, rel=1e-12)
        assert row["busbw_GBps"] == pytest.approx(algbw * (world - 1) / world, rel=1e-12)
        assert row["per_gpu_GBps"] == row["busbw_GBps"]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_mean_bandwidths_use_nccl_tests_time(world: int) -> None:
    # nccl-tests' time is the mean over its iterations; p50-based columns stay for the MoE tables.
    row = results_frame([balanced_row(world, world << 20, 250.0, time_us_mean=400.0)], GB300).iloc[0]
    algbw = (world << 20) / 400e-6 / 1e9
    assert row["algbw_mean_GBps"] == pytest.approx(algbw, rel=1e-12)
    assert row["busbw_mean_GBps"] == pytest.approx(algbw * (world - 1) / world, rel=1e-12)
    assert row["pct_spec_mean"] == pytest.approx(100 * row["busbw_mean_GBps"] / 900.0)
    assert row["busbw_GBps"] == pytest.approx((world << 20) * (world - 1) / world / 250e-6 / 1e9)
    old = {k: v for k, v in balanced_row(world, 4096, 10.0).items() if k != "time_us_mean"}
    assert math.isnan(results_frame([old], GB300).iloc[0]["busbw_mean_GBps"])  # no mean: no figure


def test_average_bus_bandwidth_is_over_the_balanced_rows_alone() -> None:
    balanced = [
        balanced_row(4, 4096, 10.0, time_us_mean=20.0),
        balanced_row(4, 8192, 10.0, time_us_mean=40.0),
    ]
    frame = results_frame([*balanced, *skewed_rows(time_us=1.0)], GB300)
    # Both balanced rows: 4096 x 3/4 B / 20 us = 0.1536 GB/s; the fast MoE phases are not averaged in.
    assert average_bus_bandwidth(frame) == pytest.approx(4096 * 3 / 4 / 20e-6 / 1e9)
    assert math.isnan(average_bus_bandwidth(results_frame(skewed_rows(), GB300)))


def test_skewed_bandwidth_uses_bottleneck_rank_and_one_direction() -> None:
    frame = results_frame(skewed_rows(time_us=100.0), GB300)
    dispatch, combine = frame.iloc[0], frame.iloc[1]
    # Rank 2 receives 1,240,000 B in dispatch, 400,000 of it from itself: link bytes 840,000.
    assert dispatch["size_bytes"] == 1_240_000
    assert dispatch["algbw_GBps"] == pytest.approx(1_240_000 / 100e-6 / 1e9)
    assert dispatch["busbw_GBps"] == pytest.approx(840_000 / 100e-6 / 1e9)
    link = int(DISPATCH.sum() - np.trace(DISPATCH))
    assert dispatch["agg_GBps"] == pytest.approx(link / 100e-6 / 1e9)
    # Combine: the transpose (x2 bytes, 2x time): rank 2 now sends the most; same bandwidth.
    assert combine["busbw_GBps"] == pytest.approx(dispatch["busbw_GBps"])


@pytest.mark.parametrize(
    ("name", "per_gpu", "aggregate_per_rank"),
    [("gb300-nvl72", 900.0, 130_000 / 72 / 2), ("hgx-h100", 450.0, 7200 / 8 / 2)],
)
def test_spec_columns_follow_the_system_spec(name: str, per_gpu: float, aggregate_per_rank: float) -> None:
    row = results_frame([balanced_row(4, 4 << 20, 100.0)], load_spec(name)).iloc[0]
    assert row["spec_name"] == name
    assert row["spec_GBps"] == per_gpu  # per direction, never the bidirectional figure
    assert row["pct_spec"] == pytest.approx(100 * row["busbw_GBps"] / per_gpu)
    # The domain aggregate, one direction, the 4 ranks' share.
    assert row["agg_spec_GBps"] == pytest.approx(aggregate_per_rank * 4)
    assert row["pct_agg_spec"] == pytest.approx(100 * row["agg_GBps"] / row["agg_spec_GBps"])


def test_default_spec_is_the_catalogue_default() -> None:
    assert results_frame([balanced_row(4, 4096, 10.0)]).iloc[0]["spec_name"] == "gb300-nvl72"


def test_results_frame_columns_zero_time_and_empty() -> None:
    row = balanced_row(2, 2048, 0.0)
    frame = results_frame([row], GB300)
    assert set(DERIVED_COLUMNS) <= set(frame.columns)
    assert set(row) <= set(frame.columns)
    first = frame.iloc[0]
    for column in ("algbw_GBps", "busbw_GBps", "nvlink_GBps", "nvlink_spec_GBps", "nvlink_agg_GBps"):
        assert math.isnan(first[column]), column
    assert math.isnan(average_bus_bandwidth(frame))
    empty = results_frame([], GB300)
    assert empty.empty and set(DERIVED_COLUMNS) <= set(empty.columns)
    with pytest.raises(UsageError, match="size_bytes"):
        results_frame([{"pattern": "x", "time_us_p50": 1.0}], GB300)


def test_results_frame_recomputes_stale_derived_columns() -> None:
    frame = results_frame([balanced_row(4, 4096, 10.0)], GB300)
    stale = frame.assign(busbw_GBps=123456.0, pct_spec=-1.0, spec_GBps=1.0)
    again = results_frame(stale, load_spec("hgx-h100")).iloc[0]
    assert again["busbw_GBps"] == pytest.approx(frame.iloc[0]["busbw_GBps"])
    assert again["spec_GBps"] == 450.0
    assert again["pct_spec"] == pytest.approx(100 * again["busbw_GBps"] / 450.0)


def link_class_row(time_us: float = 1000.0) -> dict:
    """4 ranks in domains {0, 1}, {2, 3}; M[src][dst] = (4 src + dst) x 1e6 B."""
    matrix = np.arange(16, dtype=np.int64).reshape(4, 4) * 1_000_000
    return row_from_matrix(
        matrix, time_us, pattern="toy", phase="dispatch", skew="zipf:1.2", domains=TWO_DOMAINS
    )


def test_link_class_bandwidths_against_class_specs() -> None:
    spec = load_spec("gb200-nvl72")  # NVLink 900 GB/s, NIC 400 Gb/s = 50 GB/s, per direction
    row = results_frame([link_class_row(1000.0)], spec).iloc[0]  # 1 ms: GB/s = bytes / 1e6
    # NVLink bottleneck: 14e6 B (rank 2 receives from rank 3); scale-out: rank 3 sends 25e6 B.
    assert row["nvlink_GBps"] == pytest.approx(14.0) and row["scaleout_GBps"] == pytest.approx(25.0)
    assert row["nvlink_spec_GBps"] == 900.0 and row["scaleout_spec_GBps"] == 50.0
    assert row["nvlink_pct_spec"] == pytest.approx(100 * 14 / 900)
    assert row["scaleout_pct_spec"] == pytest.approx(50.0)
    assert row["nvlink_agg_GBps"] == pytest.approx(30.0) and row["scaleout_agg_GBps"] == pytest.approx(60.0)
    assert row["nvlink_agg_spec_GBps"] == pytest.approx(130000 / 2 * 4 / 72)
    assert row["scaleout_agg_spec_GBps"] == pytest.approx(4 * 50.0)
    assert row["scaleout_agg_pct_spec"] == pytest.approx(100 * 60 / 200)
    # algbw (self included) and link bandwidth (busbw, self excluded) side by side.
    assert row["algbw_GBps"] == pytest.approx(54.0) and row["busbw_GBps"] == pytest.approx(39.0)


def test_a_class_that_carries_nothing_has_no_percentage() -> None:
    row = results_frame([balanced_row(4, 4096, 10.0)], GB300).iloc[0]  # one domain: no scale-out
    assert row["scaleout_GBps"] == 0.0 and row["scaleout_spec_GBps"] == 100.0
    assert math.isnan(row["scaleout_pct_spec"]) and math.isnan(row["scaleout_agg_pct_spec"])
    # Rows without link-class bytes (older results) get NaN, not an error.
    old = {k: v for k, v in balanced_row(4, 4096, 10.0).items() if not k.startswith(("nvlink", "scaleout"))}
    old_row = results_frame([old], GB300).iloc[0]
    assert math.isnan(old_row["nvlink_GBps"]) and math.isnan(old_row["nvlink_spec_GBps"])


def test_skew_cost_against_the_balanced_reference() -> None:
    reference = {"uniform_ref_size_bytes": 28_000_000, "uniform_ref_total_bytes": 112_000_000}
    rows = [
        {**link_class_row(1000.0), **reference, "uniform_ref_time_us_p50": 500.0},
        {**link_class_row(1000.0), **reference, "uniform_ref_time_us_p50": float("nan")},
    ]
    frame = results_frame(rows, GB300)
    assert frame.iloc[0]["skew_cost"] == pytest.approx(2.0)
    assert frame.iloc[0]["skew_bw_loss_pct"] == pytest.approx(100 * (1 - (120 / 1000) / (112 / 500)))
    assert math.isnan(frame.iloc[1]["skew_cost"]) and math.isnan(frame.iloc[1]["skew_bw_loss_pct"])
    assert math.isnan(results_frame([balanced_row(4, 4096, 10.0)], GB300).iloc[0]["skew_cost"])


def test_rank_frame_per_rank_bandwidth_after_the_byte_columns() -> None:
    matrix = np.arange(16, dtype=np.int64).reshape(4, 4) * 1_000_000
    row = link_class_row(1000.0)
    ranks = rank_frame(rank_rows_from_matrix(row, matrix, TWO_DOMAINS))
    columns = list(ranks.columns)
    assert columns[columns.index("scaleout_recv_bytes") + 1 : columns.index("time_us_p50")] == list(
        RANK_DERIVED_COLUMNS
    )
    # Phase time 1 ms: GB/s = bytes / 1e6. Rank 3 sends 12 + 13 (scale-out) and 14 (NVLink) x 1e6 B.
    rank3 = ranks.iloc[3]
    assert rank3["scaleout_send_GBps"] == pytest.approx(25.0) and rank3["nvlink_send_GBps"] == pytest.approx(
        14.0
    )
    assert rank3["link_send_GBps"] == pytest.approx(39.0)
    assert rank3["link_recv_GBps"] == pytest.approx((3 + 7 + 11) * 1.0)
    # Recomputed from bytes and the phase time, never trusted from the rows.
    stale = rank_frame(ranks.assign(link_send_GBps=-1.0, phase_time_us_p50=0.0))
    assert stale["link_send_GBps"].isna().all() and list(stale.columns) == columns
    assert list(rank_frame([{"rank": 0, "sent_bytes": 1}]).columns) == ["rank", "sent_bytes"]
    assert rank_frame([]).empty

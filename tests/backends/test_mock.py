"""MockBackend + thread ranks: the harness at world sizes no machine here has (no data movement)."""

import numpy as np
import pytest
import torch

from commbench.backends.mock import MockBackend
from commbench.errors import UsageError, VerificationError
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import parse_skew
from commbench.run.config import RunOptions
from commbench.run.harness import run_jobs
from commbench.run.jobs import BalancedJob, MoeJob
from commbench.run.threads import run_threads
from commbench.traffic.pattern import build_pattern
from commbench.traffic.plan import balanced_pair_rows
from commbench.traffic.routing import RoutingConfig

SMALL = ModelConfig(name="small", hidden=32, num_experts=32, topk=4)


def job(model, world, tokens, skew="uniform", send_mode="token", name=None):
    cfg = RoutingConfig(model, parse_skew(skew), world, tokens)
    return MoeJob(name or model.name, cfg, send_mode, warmup=1, iters=2)


def harness_entry(comm, jobs, opts, backend_class=MockBackend):
    return run_jobs(comm, jobs, opts, backend_class)


class CheckedMock(MockBackend):
    """The mock with the harness's verification on (a fresh copy of the expected rows each call, so nothing
    to poison): the verification path at thread-rank world sizes."""

    moves_data = True

    def poison_receive_buffers(self):
        pass


def modelled_us(row, link_GBps=100.0, latency_us=10.0):
    """What the harness must report for the mock: the slowest rank's latency + link bytes / bandwidth."""
    bottleneck = max(row["max_send_link_bytes"], row["max_recv_link_bytes"])
    return latency_us + bottleneck / (link_GBps * 1e9) * 1e6


def test_mock_rows_at_world_16_match_patterns_and_the_time_model():
    jobs = [
        job(SMALL, 16, 40, skew="hot:4:0.4", send_mode="selection"),
        job(SMALL, 16, 40, skew="zipf:1.2", name="small-token"),
        BalancedJob("balanced", [1 << 10, 1 << 20], warmup=0, iters=2),
    ]
    rows, rank_rows = run_threads(16, harness_entry, (jobs, RunOptions("mock")), timeout_s=60)
    assert [r["phase"] for r in rows] == ["dispatch", "combine"] * 2 + ["alltoall"] * 2
    assert len(rank_rows) == 6 * 16
    for row in rows:
        assert row["backend"] == "mock (no data movement)" and row["backend_name"] == "mock"
        assert row["emulated"] is True and row["world_size"] == 16
        assert row["wrong"] is None and row["check"] == "n/a"  # no data moved: not verified, never 0
        assert row["mock_link_GBps"] == 100.0 and row["mock_latency_us"] == 10.0
        assert row["time_us_p50"] == pytest.approx(modelled_us(row)) == row["time_us_min"]
    for moe in jobs[:2]:
        pattern = build_pattern(moe.routing, moe.send_mode)
        for phase, matrix in (("dispatch", pattern.dispatch_bytes), ("combine", pattern.combine_bytes)):
            (row,) = [r for r in rows if r["pattern"] == moe.name and r["phase"] == phase]
            assert row["total_bytes"] == int(np.sum(matrix)) and row["self_bytes"] == int(np.trace(matrix))
            assert row["size_bytes"] == int(max(matrix.sum(axis=0).max(), matrix.sum(axis=1).max()))
    assert [r["size_bytes"] for r in rows[4:]] == [1024, 1 << 20]
    # The mock has no in-place call (MockBackend.in_place is False): no in-place time, never a made-up one.
    assert not MockBackend.in_place and all(np.isnan(r["in_place_time_us_mean"]) for r in rows[4:])


def test_mock_at_world_72():
    toy72 = ModelConfig(
        name="toy72", hidden=64, num_experts=144, topk=6, dispatch_dtype="fp8", scale_block=32
    )
    rows, rank_rows = run_threads(72, harness_entry, ([job(toy72, 72, 16)], RunOptions("mock")))
    assert [(r["phase"], r["wrong"], r["world_size"]) for r in rows] == [
        ("dispatch", None, 72),
        ("combine", None, 72),
    ]
    assert rows[0]["row_bytes"] == 64 + 2 * 4 and rows[1]["row_bytes"] == 128
    assert sorted(r["rank"] for r in rank_rows if r["phase"] == "dispatch") == list(range(72))


def test_corruption_is_detected_with_thread_ranks():
    opts = RunOptions("mock", corrupt="combine")
    with pytest.raises(VerificationError, match="combine #wrong=1 elements in 1 of 2 timed iterations"):
        run_threads(4, harness_entry, ([job(SMALL, 4, 16)], opts, CheckedMock))
    # The plain mock moves nothing, so there is nothing to verify or corrupt: #wrong n/a, no error.
    rows, _ = run_threads(4, harness_entry, ([job(SMALL, 4, 16)], opts))
    assert [(r["wrong"], r["check"]) for r in rows] == [(None, "n/a")] * 2


def test_mock_options_and_order_of_setup():
    comm = type("C", (), {"rank": 0, "world_size": 2, "device": torch.device("cpu")})()
    with pytest.raises(UsageError, match="backend mock has no option.* bandwidth"):
        MockBackend(comm, {"bandwidth": 1})
    with pytest.raises(UsageError, match="link_GBps=0.0 must be > 0"):
        MockBackend(comm, {"link_GBps": 0})
    with pytest.raises(RuntimeError, match="setup_peers"):
        MockBackend(comm, {}).setup(None)


def rows_until_failure(comm, jobs, opts):
    written: list[dict] = []
    try:
        run_jobs(comm, jobs, opts, CheckedMock, sink=lambda rows, _: written.extend(rows))
    except VerificationError:
        return written
    return None


def test_corrupt_run_keeps_rank0_rows_with_thread_ranks_and_two_domains():
    # Every rank raises VerificationError right after the combine gather; rank 0 keeps both phases' rows.
    opts = RunOptions("mock", corrupt="combine", ranks_per_domain=2, imbalance_cost=True)
    for _ in range(3):
        written = run_threads(4, rows_until_failure, ([job(SMALL, 4, 16)], opts))
        assert [(r["phase"], r["wrong"] > 0) for r in written] == [("dispatch", False), ("combine", True)]


def test_mock_imbalance_cost_matches_the_time_model():
    opts = RunOptions("mock", ranks_per_domain=4, imbalance_cost=True)
    rows, rank_rows = run_threads(16, harness_entry, ([job(SMALL, 16, 40, skew="hot:2:0.4")], opts))
    for row in rows:
        assert (row["num_domains"], row["layout_source"]) == (4, "override")
        assert row["nvlink_bytes"] + row["scaleout_bytes"] == row["link_bytes"] > 0
        # The reference: the same rows, each pair total / 16^2 rows (+1 for the remainder, on diagonals).
        pairs = balanced_pair_rows(16, row["total_bytes"] // row["row_bytes"]) * row["row_bytes"]
        link = pairs - np.diag(np.diag(pairs))
        assert row["uniform_ref_total_bytes"] == row["total_bytes"]
        assert row["uniform_ref_size_bytes"] == max(pairs.sum(axis=0).max(), pairs.sum(axis=1).max())
        # The mock's balanced time: latency + the busiest rank's link bytes (self excluded) / 100 GB/s.
        assert row["uniform_ref_time_us_p50"] == pytest.approx(modelled_us({
            "max_send_link_bytes": link.sum(axis=1).max(), "max_recv_link_bytes": link.sum(axis=0).max()
        }))  # fmt: skip
        # Two hot experts: their ranks receive far more than the mean, so the skewed phase takes longer.
        assert row["time_us_p50"] > row["uniform_ref_time_us_p50"]
    assert {r["domain"] for r in rank_rows} == {0, 1, 2, 3}

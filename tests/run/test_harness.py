"""Harness: unit checks of the row math, and real gloo runs (few launches, several checks each)."""

import json
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch

from commbench.backends.mock import MockBackend
from commbench.backends.torchdist import TorchDistBackend
from commbench.errors import UsageError, VerificationError
from commbench.inputs.models import ModelConfig, load_model
from commbench.inputs.skew import parse_skew
from commbench.plain import knobs_text
from commbench.run.config import RunOptions
from commbench.run.dist import launch
from commbench.run.harness import run_jobs
from commbench.run.jobs import BalancedJob, MoeJob, job_backend_options
from commbench.run.rows import byte_columns, imbalance_columns, row_knobs, time_columns
from commbench.run.threads import run_threads
from commbench.traffic.pattern import build_pattern
from commbench.traffic.plan import balanced_pair_rows
from commbench.traffic.routing import RoutingConfig

RESULT_KEYS = {
    "pattern", "phase", "backend", "backend_name", "emulated", "world_size", "tokens_per_rank", "topk",
    "hidden", "skew", "send_mode", "dispatch_dtype", "seed", "warmup", "iters", "row_bytes", "size_bytes",
    "total_bytes", "self_bytes", "link_bytes", "max_send_bytes", "max_recv_bytes", "max_send_link_bytes",
    "max_recv_link_bytes", "time_us_min", "time_us_p50", "time_us_p99", "time_us_mean", "wrong",
    "expert_max_mean", "maxvio", "expert_cv", "num_domains", "ranks_per_domain", "layout_source",
    "nvlink_bytes", "scaleout_bytes", "nvlink_bottleneck_rank", "nvlink_bottleneck_dir",
    "nvlink_bottleneck_bytes", "scaleout_bottleneck_rank", "scaleout_bottleneck_dir",
    "scaleout_bottleneck_bytes", "knobs", "check", "timing", "graph_calls", "repeat", "model_digest",
}  # fmt: skip
IMBALANCE_KEYS = {"uniform_ref_size_bytes", "uniform_ref_total_bytes", "uniform_ref_time_us_p50"}
BYTE_KEYS = (
    "size_bytes", "total_bytes", "self_bytes", "link_bytes", "max_send_bytes", "max_recv_bytes",
    "max_send_link_bytes", "max_recv_link_bytes",
)  # fmt: skip
SMALL = ModelConfig(name="small", hidden=48, num_experts=16, topk=4, dispatch_dtype="fp8", scale_block=16)


def moe_job(model, world, tokens, skew="uniform", send_mode="token", name=None, **routing):
    cfg = RoutingConfig(model, parse_skew(skew), world, tokens, **routing)
    return MoeJob(name or model.name, cfg, send_mode, warmup=1, iters=3)


def test_byte_columns_follow_the_alltoallv_convention():
    matrix = np.array([[5, 1, 0], [2, 7, 3], [0, 9, 1]])  # [src][dst]
    assert byte_columns(matrix) == {
        "size_bytes": 17,  # rank 1 receives 1 + 7 + 9
        "total_bytes": 28,
        "self_bytes": 13,
        "link_bytes": 15,
        "max_send_bytes": 12,
        "max_recv_bytes": 17,
        "max_send_link_bytes": 9,
        "max_recv_link_bytes": 10,
    }


def test_time_columns_use_the_slowest_rank_of_each_iteration():
    seconds = np.array([[1e-6, 5e-6, 3e-6, 2e-6], [4e-6, 1e-6, 1e-6, 2e-6]])
    columns = time_columns(seconds)  # per-iteration max: 4, 5, 3, 2 us
    assert columns["time_us_min"] == pytest.approx(2.0)
    assert columns["time_us_p50"] == pytest.approx(3.5)
    assert columns["time_us_mean"] == pytest.approx(3.5)
    assert columns["time_us_p99"] == pytest.approx(np.percentile([4, 5, 3, 2], 99))


def test_imbalance_columns():
    columns = imbalance_columns(np.array([2, 2, 4, 0]))
    assert columns["expert_max_mean"] == pytest.approx(2.0)
    assert columns["maxvio"] == pytest.approx(1.0)
    assert columns["expert_cv"] == pytest.approx(np.std([2, 2, 4, 0]) / 2)
    assert all(np.isnan(v) for v in imbalance_columns(np.zeros(4)).values())
    assert imbalance_columns(None) == {"expert_max_mean": None, "maxvio": None, "expert_cv": None}


def test_bad_jobs_are_usage_errors():
    comm = SimpleNamespace(rank=0, world_size=2)

    def run(jobs, opts=None):
        run_jobs(comm, jobs, opts or RunOptions("gloo"), MockBackend)  # checked before any collective

    with pytest.raises(UsageError, match="routed for 4 ranks"):
        run([moe_job(SMALL, 4, 8)])
    with pytest.raises(UsageError, match="at least one size"):
        run([BalancedJob("balanced")])
    with pytest.raises(UsageError, match="smaller than the world size"):
        run([BalancedJob("balanced", [64, 1])])
    with pytest.raises(UsageError, match="too small"):
        run([moe_job(ModelConfig(name="tiny", hidden=2, num_experts=4, topk=1), 2, 8)])
    with pytest.raises(UsageError, match="iters"):
        run([BalancedJob("balanced", [64], iters=0)])
    with pytest.raises(UsageError, match="unknown send mode"):
        run([replace(moe_job(SMALL, 2, 8), send_mode="expert")])
    with pytest.raises(UsageError, match="corrupt"):
        run([], RunOptions("gloo", corrupt="both"))
    with pytest.raises(UsageError, match="not a multiple of --ranks-per-host"):
        run([], RunOptions("gloo", ranks_per_domain=3, ranks_per_host=2))


def test_knob_settings_build_one_backend_each_and_label_rows():
    import threading

    events: list[tuple[int, str, float]] = []
    lock = threading.Lock()

    class Recording(MockBackend):
        def __init__(self, comm, options=None):
            super().__init__(comm, options)
            with lock:
                events.append((comm.rank, "build", self.options["link_GBps"]))

        def close(self):
            with lock:
                events.append((self.comm.rank, "close", self.options["link_GBps"]))
            super().close()

    job = moe_job(SMALL, 2, 16)
    balanced = BalancedJob("balanced", [64], warmup=0, iters=1)
    # Two jobs per setting (setting outermost, as the CLI expands a sweep), the run's options underneath.
    jobs = [replace(j, backend_options={"link_GBps": gbps}) for gbps in (50, 200) for j in (job, balanced)]
    opts = RunOptions("mock", backend_options={"latency_us": 2})
    rows, rank_rows = run_threads(2, lambda comm: run_jobs(comm, jobs, opts, Recording))
    for rank in (0, 1):  # one backend per setting, the first closed before the second is built
        mine = [(what, gbps) for r, what, gbps in events if r == rank]
        assert mine == [("build", 50), ("close", 50), ("build", 200), ("close", 200)]
    assert [r["mock_link_GBps"] for r in rows] == [50, 50, 50, 200, 200, 200]
    assert all(r["mock_latency_us"] == 2 for r in rows)
    # The knobs cell, as data: the backend's knobs (mock reports link_GBps as mock_link_GBps).
    assert rows[0]["knobs"] == {"mock_link_GBps": 50.0, "mock_latency_us": 2.0}
    assert rows[-1]["knobs"] == {"mock_link_GBps": 200.0, "mock_latency_us": 2.0}
    assert all(r["knobs"] in (rows[0]["knobs"], rows[-1]["knobs"]) for r in rank_rows)
    # Emulated times follow the setting: 4x the bandwidth, less time for the same bytes.
    assert rows[3]["time_us_p50"] < rows[0]["time_us_p50"]
    assert job_backend_options(jobs[0], opts) == {"latency_us": 2, "link_GBps": 50}
    assert job_backend_options(job, opts) == {"latency_us": 2}


def test_row_knobs_add_the_settings_options_the_backend_does_not_report():
    backend = SimpleNamespace(name="emu", knobs=lambda: {"chunk_rows": 36, "emu_depth": 2, "signal": "chunk"})
    job = BalancedJob("x", [64], backend_options={"chunk_bytes": 4096, "chunk_rows": 8, "depth": 3})
    # Effective values win (chunk_rows), "emu_depth" stands for depth; chunk_bytes is not reported: added.
    knobs = row_knobs(backend, job)
    assert knobs == {"chunk_rows": 36, "emu_depth": 2, "signal": "chunk", "chunk_bytes": 4096}
    assert knobs_text(knobs) == "chunk_rows=36 emu_depth=2 signal=chunk chunk_bytes=4096"
    assert row_knobs(backend, BalancedJob("x")) == backend.knobs()


class MovedBytes(TorchDistBackend):
    """nccl/gloo all-to-all that records what it moved, per plan it was set up with (a list per process, so
    per rank): bytes received from each source in dispatch, bytes sent back to each source in combine."""

    moved: ClassVar[list[dict[str, list[int]]]] = []

    def setup(self, plan):
        super().setup(plan)
        MovedBytes.moved.append({})

    def dispatch(self, tokens, plan, recv_counts):
        received = super().dispatch(tokens, plan, recv_counts)
        rows = recv_counts.sum(dim=1).cpu()
        assert int(rows.sum()) == received.shape[0]
        MovedBytes.moved[-1]["dispatch_recv"] = (rows * received.shape[1]).tolist()
        return received

    def combine(self, expert_out, plan, recv_counts):
        rows = recv_counts.sum(dim=1).cpu()
        assert int(rows.sum()) == expert_out.shape[0]
        MovedBytes.moved[-1]["combine_sent"] = (
            rows * expert_out.shape[1] * expert_out.element_size()
        ).tolist()
        return super().combine(expert_out, plan, recv_counts)


def moved_matrices(moved, setup):
    """[src][dst] bytes of the ``setup``-th plan every rank set up, as the backend moved them."""
    dispatch = np.array([rank[setup]["dispatch_recv"] for rank in moved]).T  # rank dst received from src
    combine = np.array([rank[setup]["combine_sent"] for rank in moved])  # expert side src sent to owner dst
    return dispatch, combine


def written_sink(written):
    return lambda rows, _: written.extend(rows)


def collecting_entry(comm, jobs, opts, corrupt_job=None):
    """Run ``jobs``; then, with ``corrupt_job``, check the corruption hook of each phase (caught here)."""
    calls = []
    sink = lambda r, rr: calls.append((list(r), list(rr)))  # noqa: E731
    rows, rank_rows = run_jobs(comm, jobs, opts, MovedBytes, sink=sink)
    moved = comm.all_gather_object(MovedBytes.moved)
    if comm.rank != 0:
        assert rows == [] and rank_rows == [] and calls == []
    detected = {}
    for phase in ("combine", "dispatch") if corrupt_job else ():
        written: list[dict] = []
        try:
            corrupting = RunOptions(opts.backend, corrupt=phase)
            run_jobs(comm, [corrupt_job, corrupt_job], corrupting, MovedBytes, sink=written_sink(written))
        except VerificationError as exc:  # raised on every rank, after the job's rows were written
            detected[phase] = (str(exc), [(r["phase"], r["wrong"]) for r in written])
    return rows, rank_rows, calls, detected, moved


def check_against_pattern(rows, rank_rows, job, world):
    """Byte columns equal the Pattern's matrices; rank rows split them per rank."""
    pattern = build_pattern(job.routing, job.send_mode)
    for phase, matrix in (("dispatch", pattern.dispatch_bytes), ("combine", pattern.combine_bytes)):
        (row,) = [r for r in rows if r["pattern"] == job.name and r["phase"] == phase]
        expected = byte_columns(np.asarray(matrix))
        assert {k: row[k] for k in BYTE_KEYS} == expected, phase
        ranks = sorted(
            (r for r in rank_rows if r["pattern"] == job.name and r["phase"] == phase),
            key=lambda r: r["rank"],
        )
        assert [r["rank"] for r in ranks] == list(range(world))
        assert [r["sent_bytes"] for r in ranks] == np.asarray(matrix).sum(axis=1).tolist()
        assert [r["recv_bytes"] for r in ranks] == np.asarray(matrix).sum(axis=0).tolist()
        assert [r["self_bytes"] for r in ranks] == np.diag(matrix).tolist()
        stats = pattern.stats
        assert row["maxvio"] == pytest.approx(stats["expert_maxvio"])
        assert row["expert_cv"] == pytest.approx(stats["expert_cv"])
        assert row["expert_max_mean"] == pytest.approx(stats["expert_load_max"] / stats["expert_load_mean"])


def check_common(rows, imbalance_cost=False):
    for row in rows:
        extra = IMBALANCE_KEYS if imbalance_cost and row["phase"] != "alltoall" else set()
        if row["phase"] != "alltoall":  # MoE rows carry the comm/compute budget's input
            extra = extra | {"busiest_rank_selections"}
            assert row["busiest_rank_selections"] > 0
        else:  # balanced rows: the in-place run's time too (gloo has one: all_to_all_single(buf, buf))
            extra = extra | {"in_place_time_us_mean"}
            assert row["in_place_time_us_mean"] > 0
        assert set(row) == RESULT_KEYS | extra
        # The balanced sweep is timed as nccl-tests (a window, its last output verified), MoE per iteration.
        timing, check = ("window", "window-last") if row["phase"] == "alltoall" else ("iteration", "checksum")
        assert row["wrong"] == 0 and (row["timing"], row["check"]) == (timing, check), row
        # CPU ranks: not GPU fabric figures.
        assert row["backend"] == row["backend_name"] == "gloo" and row["emulated"] is True
        assert 0 < row["time_us_min"] <= row["time_us_p50"] <= row["time_us_p99"]
        assert row["link_bytes"] == row["total_bytes"] - row["self_bytes"]
        assert row["knobs"] == {}  # gloo has no knobs


def test_gloo_world2_moe_and_balanced_verified_and_match_patterns_and_corruption_detected():
    deepseek = load_model("deepseek-v3")
    jobs = [
        moe_job(deepseek, 2, 256),
        moe_job(SMALL, 2, 96, skew="zipf:1.5", send_mode="selection", mask_ratio=0.2, name="small-sel"),
        moe_job(SMALL, 2, 64, skew="zipf:1.0", capacity_factor=1.0, name="small-cap"),
        BalancedJob("balanced", [64, 3001, 1 << 16], warmup=1, iters=3),
    ]
    corrupt_job = moe_job(SMALL, 2, 32, name="corrupted")
    rows, rank_rows, calls, detected, _ = launch(
        2, collecting_entry, (jobs, RunOptions("gloo"), corrupt_job), process_group="gloo", timeout_s=60
    )
    check_common(rows)
    # Discovered layout on one CPU host: one NVLink domain, every link byte is NVLink, none scale-out.
    for row in rows:
        assert (row["num_domains"], row["ranks_per_domain"], row["layout_source"]) == (1, 2, "host")
        assert row["nvlink_bytes"] == row["link_bytes"] and row["scaleout_bytes"] == 0
        assert row["scaleout_bottleneck_rank"] == -1 and row["scaleout_bottleneck_dir"] == ""
    assert all(r["domain"] == 0 and r["scaleout_sent_bytes"] == 0 for r in rank_rows)
    # The sink gets each (job, size, phase) as it finishes: 3 MoE jobs x 2 phases + 3 sizes.
    assert len(calls) == 9 and all(len(call[0]) == 1 and len(call[1]) == 2 for call in calls)
    assert [call[0][0] for call in calls] == rows
    assert [r["phase"] for r in rows] == ["dispatch", "combine"] * 3 + ["alltoall"] * 3
    for job in jobs[:3]:
        check_against_pattern(rows, rank_rows, job, 2)
    first = rows[0]
    assert (first["pattern"], first["tokens_per_rank"], first["topk"], first["hidden"]) == (
        "deepseek-v3",
        256,
        8,
        7168,
    )
    assert first["row_bytes"] == 7168 + 56 * 4 and rows[1]["row_bytes"] == 2 * 7168
    assert first["dispatch_dtype"] == "fp8" and first["skew"] == "uniform" and first["send_mode"] == "token"
    assert rows[2]["send_mode"] == "selection" and rows[2]["skew"] == "zipf:1.5"
    balanced = rows[6:]
    assert [r["size_bytes"] for r in balanced] == [64, 3000, 1 << 16]  # 3001 B rounds down to 2 x 1500
    assert [r["row_bytes"] for r in balanced] == [32, 1500, 1 << 15]
    assert all(r["self_bytes"] == r["size_bytes"] for r in balanced)  # 2 ranks x half each
    assert balanced[1]["max_send_link_bytes"] == 1500
    # Window timing: one sample per rank (window / iters), so min = p50 = p99 = mean.
    for row in balanced:
        assert row["time_us_min"] == row["time_us_p50"] == row["time_us_p99"] == row["time_us_mean"]
    # One flipped byte / changed element on rank 0 is counted, the rows are written, then the job fails.
    message, written = detected["combine"]
    assert "combine #wrong=1 elements" in message and "dispatch" not in message
    assert written == [("dispatch", 0), ("combine", 1)]
    message, written = detected["dispatch"]
    assert "dispatch #wrong=1 bytes" in message and written[0] == ("dispatch", 1)


def check_link_classes(rows, rank_rows, job):
    """2 domains of 2 ranks ({0, 1}, {2, 3}): bytes per class written out entry by entry from the pattern."""
    pattern = build_pattern(job.routing, job.send_mode)
    for phase, matrix in (("dispatch", pattern.dispatch_bytes), ("combine", pattern.combine_bytes)):
        m = np.asarray(matrix, dtype=np.int64)
        (row,) = [r for r in rows if r["pattern"] == job.name and r["phase"] == phase]
        assert (row["num_domains"], row["ranks_per_domain"], row["layout_source"]) == (2, 2, "override")
        nvlink = m[0, 1] + m[1, 0] + m[2, 3] + m[3, 2]
        scaleout = m[0, 2] + m[0, 3] + m[1, 2] + m[1, 3] + m[2, 0] + m[2, 1] + m[3, 0] + m[3, 1]
        assert row["self_bytes"] == m[0, 0] + m[1, 1] + m[2, 2] + m[3, 3]
        assert (row["nvlink_bytes"], row["scaleout_bytes"]) == (nvlink, scaleout)
        assert row["nvlink_bytes"] + row["scaleout_bytes"] == row["link_bytes"]
        nvlink_send = [m[0, 1], m[1, 0], m[2, 3], m[3, 2]]
        nvlink_recv = [m[1, 0], m[0, 1], m[3, 2], m[2, 3]]
        scaleout_send = [m[0, 2] + m[0, 3], m[1, 2] + m[1, 3], m[2, 0] + m[2, 1], m[3, 0] + m[3, 1]]
        scaleout_recv = [m[2, 0] + m[3, 0], m[2, 1] + m[3, 1], m[0, 2] + m[1, 2], m[0, 3] + m[1, 3]]
        assert row["nvlink_bottleneck_bytes"] == max(nvlink_send + nvlink_recv)
        assert row["scaleout_bottleneck_bytes"] == max(scaleout_send + scaleout_recv)
        neck = row["scaleout_bottleneck_rank"]
        side = scaleout_send if row["scaleout_bottleneck_dir"] == "send" else scaleout_recv
        assert side[neck] == row["scaleout_bottleneck_bytes"]
        ranks = sorted(
            (r for r in rank_rows if r["pattern"] == job.name and r["phase"] == phase),
            key=lambda r: r["rank"],
        )
        assert [(r["domain"], r["host"]) for r in ranks] == [(0, 0), (0, 0), (1, 1), (1, 1)]
        assert [r["nvlink_sent_bytes"] for r in ranks] == nvlink_send
        assert [r["nvlink_recv_bytes"] for r in ranks] == nvlink_recv
        assert [r["scaleout_sent_bytes"] for r in ranks] == scaleout_send
        assert [r["scaleout_recv_bytes"] for r in ranks] == scaleout_recv
        for r in ranks:
            assert r["link_sent_bytes"] == r["nvlink_sent_bytes"] + r["scaleout_sent_bytes"]
            assert r["phase_time_us_p50"] == row["time_us_p50"] and r["time_us_p50"] > 0
        # Imbalance cost: the same phase on a balanced layout of exactly the same rows (each pair total /
        # world^2 rows, remainder one row per pair), timed right after and verified (wrong == 0 above).
        world = 4
        pair_bytes = balanced_pair_rows(world, int(m.sum()) // row["row_bytes"]) * row["row_bytes"]
        assert row["uniform_ref_total_bytes"] == m.sum() == pair_bytes.sum()
        busiest = max(pair_bytes.sum(axis=0).max(), pair_bytes.sum(axis=1).max())
        assert row["uniform_ref_size_bytes"] == busiest
        assert row["uniform_ref_size_bytes"] <= row["size_bytes"]  # skew never makes the busiest rank lighter
        assert row["uniform_ref_time_us_p50"] > 0


def printed_pattern(*args):
    """The byte matrices ``commbench pattern --json`` prints."""
    command = [sys.executable, "-m", "commbench", "pattern", *args, "--json"]
    printed = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    return np.array(printed["dispatch_bytes"]), np.array(printed["combine_bytes"])


def test_gloo_world4_moves_the_printed_pattern_link_classes_and_imbalance_cost():
    jobs = [
        moe_job(load_model("deepseek-v3"), 4, 64, skew="zipf:1.2"),
        moe_job(SMALL, 4, 64, skew="zipf:1.2", send_mode="selection"),
    ]
    opts = RunOptions("gloo", ranks_per_domain=2, imbalance_cost=True)
    rows, rank_rows, calls, _, moved = launch(
        4, collecting_entry, (jobs, opts), process_group="gloo", timeout_s=60
    )
    check_common(rows, imbalance_cost=True)
    assert len(rows) == 4 and len(rank_rows) == 16 and len(calls) == 4
    for job in jobs:
        check_against_pattern(rows, rank_rows, job, 4)
        check_link_classes(rows, rank_rows, job)
    # The pattern printed is the pattern run: what the backend moved (per plan set up: job 1, its balanced
    # reference, job 2, its reference) is what `commbench pattern --json` prints and what the rows say.
    printed = printed_pattern(
        "--model", "deepseek-v3", "--world-size", "4", "--tokens", "64", "--skew", "zipf:1.2"
    )
    assert all(np.array_equal(a, b) for a, b in zip(moved_matrices(moved, 0), printed, strict=True))
    small = build_pattern(jobs[1].routing, "selection")
    assert np.array_equal(moved_matrices(moved, 2)[0], small.dispatch_bytes)
    assert np.array_equal(moved_matrices(moved, 2)[1], small.combine_bytes)
    for setup, job in ((0, jobs[0]), (2, jobs[1])):
        for phase, matrix in zip(("dispatch", "combine"), moved_matrices(moved, setup), strict=True):
            (row,) = [r for r in rows if r["pattern"] == job.name and r["phase"] == phase]
            assert {k: row[k] for k in BYTE_KEYS} == byte_columns(matrix)
            ranks = sorted(
                (r for r in rank_rows if r["pattern"] == job.name and r["phase"] == phase),
                key=lambda r: r["rank"],
            )
            assert [r["sent_bytes"] for r in ranks] == matrix.sum(axis=1).tolist()
            assert [r["recv_bytes"] for r in ranks] == matrix.sum(axis=0).tolist()
        for phase, matrix in zip(("dispatch", "combine"), moved_matrices(moved, setup + 1), strict=True):
            (row,) = [r for r in rows if r["pattern"] == job.name and r["phase"] == phase]
            assert row["uniform_ref_total_bytes"] == matrix.sum() == row["total_bytes"]
            assert row["uniform_ref_size_bytes"] == byte_columns(matrix)["size_bytes"]


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")
def test_nccl_moe_and_balanced_verified_on_gpus():
    world = min(2, torch.cuda.device_count())
    jobs = [
        moe_job(load_model("deepseek-v3"), world, 1024),
        moe_job(SMALL, world, 256, skew="zipf:1.2", send_mode="selection"),
        BalancedJob("balanced", [1 << 10, 1 << 24], warmup=2, iters=5),
    ]
    rows, rank_rows, _, _, _ = launch(
        world, collecting_entry, (jobs, RunOptions("nccl")), process_group="nccl", timeout_s=120
    )
    assert [r["wrong"] for r in rows] == [0] * 6
    assert all(r["backend"] == "nccl" and 0 < r["time_us_min"] <= r["time_us_p99"] for r in rows)
    # NCCL runs the in-place all-to-all too (one buffer as input and output, as nccl-tests passes it).
    assert all(r["in_place_time_us_mean"] > 0 for r in rows if r["phase"] == "alltoall")
    for job in jobs[:2]:
        check_against_pattern(rows, rank_rows, job, world)


def _nccl_entry(comm, jobs):
    """``jobs`` on NcclBackend itself (MovedBytes reads counts on the host: not capturable)."""
    from commbench.backends.torchdist import NcclBackend

    return run_jobs(comm, jobs, RunOptions("nccl"), NcclBackend)[0]


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")
def test_nccl_balanced_cuda_graph_verified_on_gpus():
    """--cuda-graph on NCCL: the balanced sweep captured by torch.cuda.graph (ProcessGroupNCCL's
    collectives under capture), replayed, the last replay verified; the in-place run too."""
    world = min(2, torch.cuda.device_count())
    job = BalancedJob("balanced", [1 << 10, 1 << 22], warmup=2, iters=5, timing="graph", graph_calls=4)
    rows = launch(world, _nccl_entry, ([job],), process_group="nccl", timeout_s=120)
    assert [(r["timing"], r["graph_calls"], r["check"], r["wrong"]) for r in rows] == [
        ("graph", 4, "window-last", 0)
    ] * 2
    assert all(r["in_place_time_us_mean"] > 0 for r in rows)

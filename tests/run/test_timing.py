"""Timing as nccl-tests: window vs iteration timing in ``harness.bench``, and where each timer ends its region
(``comm.CpuTimer`` / ``comm.CudaTimer``: a CUDA end event recorded before the host waits)."""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from commbench.backends.mock import MockBackend
from commbench.backends.torchdist import TorchDistBackend
from commbench.errors import UsageError, VerificationError
from commbench.run.comm import CpuTimer, CudaTimer
from commbench.run.config import RunOptions
from commbench.run.dist import launch
from commbench.run.harness import bench, run_jobs
from commbench.run.jobs import BalancedJob
from commbench.run.phases import Phase
from commbench.run.threads import run_threads
from commbench.traffic.payload import RowCheck, encode_rows, expected_rows
from commbench.traffic.plan import plan_balanced
from tests.run.faults import gloo_fault

ELAPSED_MS = 6.0  # what every fake CUDA timer says its region took


class FakeEvent:
    """A torch.cuda.Event that logs where it is recorded; ``elapsed_time`` is ELAPSED_MS."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: object) -> None:
        self.log.append(f"{self.name} event on {stream}")

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeEvent) -> float:
        return ELAPSED_MS


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.cuda.Event / current_stream replaced by fakes writing to the returned log (no GPU needed)."""
    log: list[str] = []
    names = iter(["begin", "end"] * 1000)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: FakeEvent(log, next(names)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: "stream")
    return log


class LoggingBackend:
    """The backend calls ``bench`` makes, logged (a GPU-like backend that moves data, nothing emulated)."""

    moves_data = True
    emulated = False
    blocking = True

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def poison_receive_buffers(self) -> None:
        self.log.append("poison")

    def modelled_seconds(self) -> None:
        return None


def logging_setup(log: list[str], timer: object) -> tuple[SimpleNamespace, LoggingBackend, Phase]:
    """One rank's comm, backend and phase whose every call lands in ``log``."""

    def check(kind: str):
        return lambda output: log.append(kind) or 0

    comm = SimpleNamespace(
        rank=0,
        world_size=1,
        heartbeat=lambda: None,
        quiet=contextlib.nullcontext,  # Comm.quiet: the heartbeat thread asleep through the timed loop
        guard=lambda operation: contextlib.nullcontext(),
        barrier=lambda: log.append("barrier"),
        timer=timer,
        all_gather_object=lambda obj: [obj],
    )
    phase = Phase(
        "alltoall",
        "alltoall 64 B",
        lambda: log.append("call") or torch.zeros(1),
        SimpleNamespace(full=check("full check"), checksum=check("checksum")),
        "bytes",
    )
    return comm, LoggingBackend(log), phase


def test_cuda_timer_records_its_end_event_before_the_host_waits(fake_cuda):
    timer = CudaTimer(torch.device("cuda", 0))
    timer.start()
    fake_cuda.append("work")
    timer.stop(lambda: fake_cuda.append("synchronize"))
    assert fake_cuda == ["begin event on stream", "work", "end event on stream", "synchronize"]
    assert timer.seconds() == ELAPSED_MS / 1e3


def test_cpu_timer_reads_the_clock_after_the_host_waits():
    timer = CpuTimer()
    timer.start()
    timer.stop(lambda: time.sleep(0.05))  # work still running until synchronize returns: it counts
    assert timer.seconds() >= 0.05


def test_bench_orders_events_as_nccl_tests(fake_cuda):
    """Iteration timing: poison, barrier, begin event, call, end event, then the wait, per iteration; window
    timing: one barrier, one pair of events around back-to-back calls, one wait, a barrier (no rank checks
    while a peer is still in its window), one full check."""
    comm, backend, phase = logging_setup(fake_cuda, lambda: CudaTimer(torch.device("cuda", 0)))
    warmup = ["barrier", "call", "synchronize"]
    job = BalancedJob("balanced", [64], warmup=1, iters=2, timing="iteration")
    measured = bench(comm, backend, job, phase, RunOptions("nccl"))
    timed = ["poison", "synchronize", "barrier", "begin event on stream", "call", "end event on stream"]
    timed += ["synchronize", "barrier"]
    assert fake_cuda == warmup + timed + ["checksum"] + timed + ["full check"]
    assert measured.seconds.shape == (1, 2) and (measured.seconds == ELAPSED_MS / 1e3).all()
    assert measured.wrong == 0

    fake_cuda.clear()
    job = BalancedJob("balanced", [64], warmup=1, iters=3, timing="window")
    measured = bench(comm, backend, job, phase, RunOptions("nccl"))
    window = ["begin event on stream", "call", "call", "call", "end event on stream", "synchronize"]
    assert fake_cuda == [*warmup, "poison", "synchronize", "barrier", *window, "barrier", "full check"]
    # One sample per rank: the window's time / iters.
    assert measured.seconds.shape == (1, 1) and measured.seconds[0, 0] == pytest.approx(ELAPSED_MS / 3e3)


def test_a_window_waits_for_each_call_only_with_blocking_1(fake_cuda):
    """nccl-tests -z: --blocking 0 (default) issues the window's calls with the backend's ``blocking`` off
    and waits once at its end; --blocking 1 waits after every call. Warm-ups wait either way, and the
    backend is blocking again after the window."""
    comm, backend, phase = logging_setup(fake_cuda, lambda: CudaTimer(torch.device("cuda", 0)))
    called = lambda: fake_cuda.append(f"call blocking={backend.blocking}") or torch.zeros(1)  # noqa: E731
    phase = replace(phase, call=called)
    job = BalancedJob("balanced", [64], warmup=1, iters=2, timing="window")
    warmup = ["barrier", "call blocking=True", "synchronize"]
    start = [*warmup, "poison", "synchronize", "barrier", "begin event on stream"]
    end = ["end event on stream", "synchronize", "barrier", "full check"]
    bench(comm, backend, job, phase, RunOptions("nccl"))
    assert fake_cuda == [*start, "call blocking=False", "call blocking=False", *end]
    assert backend.blocking is True
    fake_cuda.clear()
    bench(comm, backend, job, phase, RunOptions("nccl", blocking=1))
    each = ["call blocking=True", "synchronize"]
    assert fake_cuda == [*start, *each, *each, *end]


@pytest.mark.parametrize("timing", ["window", "iteration"])
def test_the_garbage_collector_is_off_in_timed_calls_only(timing):
    """No GC pass inside a timed loop (as timeit), on again afterwards; the warm-up runs with it on."""
    log: list[str] = []
    comm, backend, phase = logging_setup(log, CpuTimer)
    phase = replace(phase, call=lambda: log.append(f"gc {gc.isenabled()}") or torch.zeros(1))
    job = BalancedJob("balanced", [64], warmup=1, iters=2, timing=timing)
    assert gc.isenabled()
    bench(comm, backend, job, phase, RunOptions("nccl"))
    assert [entry for entry in log if entry.startswith("gc")] == ["gc True", "gc False", "gc False"]
    assert gc.isenabled()


def test_window_of_an_emulated_backend_is_its_calls_modelled_time_per_iteration():
    # The mock models latency + bytes / bandwidth per call: a window of n calls / n = one call's time.
    jobs = [
        BalancedJob("balanced", [4096], warmup=0, iters=3, timing=timing)
        for timing in ("window", "iteration")
    ]
    opts = RunOptions("mock", backend_options={"latency_us": 7, "link_GBps": 1})
    rows, rank_rows = run_threads(2, lambda comm: run_jobs(comm, jobs, opts, MockBackend))
    window, iteration = rows
    assert (window["timing"], iteration["timing"]) == ("window", "iteration")
    expected_us = 7 + 2048 / 1e9 * 1e6  # 2,048 bytes to the one peer, self excluded
    assert window["time_us_mean"] == pytest.approx(expected_us)
    assert iteration["time_us_p50"] == pytest.approx(expected_us)
    assert window["time_us_min"] == window["time_us_p50"] == window["time_us_p99"] == window["time_us_mean"]
    assert [r["check"] for r in rows] == ["n/a", "n/a"]  # the mock moves no data


def test_timing_is_checked_before_any_collective():
    comm = SimpleNamespace(rank=0, world_size=2)
    with pytest.raises(UsageError, match="unknown timing 'fast'; choose window or iteration"):
        run_jobs(comm, [BalancedJob("balanced", [64], timing="fast")], RunOptions("gloo"), TorchDistBackend)
    with pytest.raises(UsageError, match="^--check every needs --timing iteration$"):
        run_jobs(comm, [BalancedJob("balanced", [64])], RunOptions("gloo", check="every"), TorchDistBackend)


def window_entry(comm) -> dict:
    """gloo: a clean window, a corrupted last output, and a transfer that moves nothing after its first
    (warm-up) call, each as (VerificationError message or None, rows)."""
    results = {}
    job = BalancedJob("balanced", [64, 4096], warmup=1, iters=4)  # window timing by default
    for name, opts, fault in (
        ("clean", RunOptions("gloo"), contextlib.nullcontext()),
        ("clean blocking 1", RunOptions("gloo", blocking=1), contextlib.nullcontext()),
        ("corrupt", RunOptions("gloo", corrupt="dispatch"), contextlib.nullcontext()),
        ("stale", RunOptions("gloo"), gloo_fault("stale", 0, torch.uint8)),
    ):
        written: list[dict] = []
        try:
            with fault:
                run_jobs(comm, [job], opts, TorchDistBackend, sink=lambda rows, _, w=written: w.extend(rows))
            results[name] = (None, written)
        except VerificationError as exc:
            results[name] = (str(exc), written)
    return results


def issued_entry(comm) -> list[str]:
    """gloo, 2 ranks: rank 0's dispatch with ``blocking`` off must return before rank 1 has even entered
    its call (rank 1 waits for rank 0's word in the store, so a call that waited for its peer would hang
    until the timeout), and its output is delivered only by ``synchronize``."""
    plans = [plan_balanced(src, 2, 1024) for src in range(2)]
    backend = TorchDistBackend(comm)
    plan = plans[comm.rank].to(comm.device)
    backend.setup(plan)
    tokens = encode_rows(comm.rank, torch.arange(plan.num_tokens), plan.dispatch_row_bytes)
    expected = expected_rows(plans, comm.rank, comm.device)
    store = dist.distributed_c10d._get_default_store()
    log = []
    backend.poison_receive_buffers()
    comm.barrier()
    if comm.rank == 0:
        backend.blocking = False
        received = backend.dispatch(tokens, plan, plan.static_recv_counts)
        log.append("issued")
        store.set("issued", "1")
    else:
        store.wait(["issued"])
        received = backend.dispatch(tokens, plan, plan.static_recv_counts)
    backend.synchronize()
    log.append(f"wrong={RowCheck(expected).full(received)}")
    backend.blocking = True
    received = backend.dispatch(tokens, plan, plan.static_recv_counts)  # blocking: complete on return
    log.append(f"wrong={RowCheck(expected).full(received)}")
    return log


def test_a_call_issued_without_blocking_returns_before_its_peer_and_synchronize_delivers_it():
    assert launch(2, issued_entry, (), process_group="gloo", timeout_s=60) == ["issued", "wrong=0", "wrong=0"]


def test_gloo_window_verifies_the_last_output_and_catches_corruption_and_stale_buffers():
    results = launch(2, window_entry, (), process_group="gloo", timeout_s=60)
    for name in ("clean", "clean blocking 1"):
        message, rows = results[name]
        assert message is None
        assert [(r["timing"], r["check"], r["wrong"], r["iters"]) for r in rows] == [
            ("window", "window-last", 0, 4)
        ] * 2
        assert all(0 < r["time_us_min"] == r["time_us_p99"] for r in rows)
    message, rows = results["corrupt"]  # one byte flipped on rank 0 after the window
    assert "alltoall 64 B #wrong=1 bytes in the last of 4 back-to-back timed iterations" in message
    assert [r["wrong"] for r in rows] == [1, 1]  # every size's rows are written, then the job fails
    message, rows = results["stale"]  # poisoned before the window: nothing moved leaves the sentinel
    assert "alltoall 64 B #wrong=" in message and all(r["wrong"] > 0 for r in rows)


def gpu_entry(comm) -> list[dict]:
    jobs = [
        BalancedJob("balanced", [1 << 10, 1 << 22], warmup=2, iters=10, timing=timing)
        for timing in ("window", "iteration")
    ]
    rows, _ = run_jobs(comm, jobs, RunOptions("nccl"), TorchDistBackend)
    # --blocking 1: the host waits for each NCCL call of the window (a CUDA synchronize after each).
    blocked, _ = run_jobs(comm, jobs[:1], RunOptions("nccl", blocking=1), TorchDistBackend)
    return rows + blocked


@pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a GPU")
def test_gpu_end_event_is_recorded_before_the_host_waits_and_both_timings_run():
    device = torch.device("cuda", 0)
    torch.cuda.synchronize(device)
    cuda, host = CudaTimer(device), CpuTimer()

    def slow_wait() -> None:  # the host wakes up late: counted by a host clock, not by the events
        torch.cuda.synchronize(device)
        time.sleep(0.05)

    for timer in (cuda, host):
        timer.start()
        torch.cuda._sleep(1_000_000)  # ~1 ms of device time at ~1 GHz
        timer.stop(slow_wait)
    assert cuda.seconds() < 0.04 <= 0.05 <= host.seconds()
    rows = launch(1, gpu_entry, (), process_group="nccl", timeout_s=120)
    assert [(r["timing"], r["check"], r["wrong"]) for r in rows] == [
        ("window", "window-last", 0),
        ("window", "window-last", 0),
        ("iteration", "checksum", 0),
        ("iteration", "checksum", 0),
        ("window", "window-last", 0),
        ("window", "window-last", 0),
    ]
    assert all(r["time_us_min"] > 0 for r in rows)

"""Verification covers every timed iteration (--check): transfers that move nothing after their first call,
skip one middle timed iteration, or flip one byte in a middle iteration are caught on gloo and shmem-emu in
both check modes; a clean run passes both; mock and sim rows say #wrong n/a."""

from __future__ import annotations

import pytest
import torch

from commbench.backends.mock import MockBackend
from commbench.backends.shmem.emu import ShmemEmuBackend
from commbench.backends.sim import SimBackend
from commbench.backends.torchdist import TorchDistBackend
from commbench.errors import UsageError, VerificationError
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import parse_skew
from commbench.report import results_frame, results_table
from commbench.report.pages.tables import pattern_tables
from commbench.run.config import CHECK_MODES, RunOptions
from commbench.run.dist import launch
from commbench.run.harness import run_jobs
from commbench.run.jobs import BalancedJob, MoeJob
from commbench.run.threads import run_threads
from commbench.traffic.payload import POISON_BYTE, encode_rows, expected_rows
from commbench.traffic.plan import plan_balanced
from commbench.traffic.routing import RoutingConfig
from tests.run.faults import FAULTS, emu_fault, gloo_fault

SMALL = ModelConfig(name="small", hidden=64, num_experts=8, topk=2, dispatch_dtype="fp8", scale_block=32)
WARMUP, ITERS = 1, 5
# Counted from the first warm-up call: the 3rd of 5 timed iterations (neither the first nor the last).
MIDDLE = WARMUP + ITERS // 2
SIZE = 4096  # a balanced all-to-all of 2 ranks: one 2048-byte row to each rank
BALANCED = BalancedJob("balanced", [SIZE], warmup=WARMUP, iters=ITERS, timing="iteration")
ROW_BYTES = SIZE // 2
PUTS_PER_ITERATION = 2  # shmem-emu, BALANCED on 2 ranks: one put (one row) to each rank


def moe(world: int, name: str = "moe") -> MoeJob:
    cfg = RoutingConfig(SMALL, parse_skew("zipf:1.2"), world, 32)
    return MoeJob(name, cfg, "token", warmup=WARMUP, iters=ITERS)


def outcome(comm, jobs, opts, backend_class) -> tuple[str | None, list[tuple[str, int | None, str]]]:
    """(VerificationError message or None, (phase, wrong, check) of every row written)."""
    written: list[dict] = []
    try:
        run_jobs(comm, jobs, opts, backend_class, sink=lambda rows, _: written.extend(rows))
        message = None
    except VerificationError as exc:  # raised on every rank alike, after the rows were written
        message = str(exc)
    return message, [(r["phase"], r["wrong"], r["check"]) for r in written]


def poisoned_then_refilled(comm, backend_class) -> tuple[bool, bool]:
    """A balanced dispatch; after ``poison_receive_buffers`` what it returned (a view of the receive buffer)
    holds only the sentinel, and the next dispatch delivers the right rows again."""
    plans = [plan_balanced(src, comm.world_size, SIZE) for src in range(comm.world_size)]
    plan = plans[comm.rank].to(comm.device)
    tokens = encode_rows(
        comm.rank, torch.arange(plan.num_tokens, device=comm.device), plan.dispatch_row_bytes
    )
    backend = backend_class(comm, {})
    try:
        backend.setup(plan)
        received = backend.dispatch(tokens, plan, plan.static_recv_counts)
        backend.poison_receive_buffers()
        backend.synchronize()
        poisoned = bool((received == POISON_BYTE).all())
        comm.barrier()
        again = backend.dispatch(tokens, plan, plan.static_recv_counts)
        backend.synchronize()
        refilled = torch.equal(again.cpu(), expected_rows(plans, comm.rank))
    finally:
        backend.close()
    return poisoned, refilled


def gloo_entry(comm) -> dict:
    results = {"poison": poisoned_then_refilled(comm, TorchDistBackend)}
    for mode in CHECK_MODES:
        opts = RunOptions("gloo", check=mode)
        results[mode, "clean"] = outcome(comm, [BALANCED, moe(comm.world_size)], opts, TorchDistBackend)
        for fault in FAULTS:  # the payload exchange of the balanced all-to-all
            with gloo_fault(fault, MIDDLE, torch.uint8):
                results[mode, fault] = outcome(comm, [BALANCED], opts, TorchDistBackend)
    opts = RunOptions("gloo")
    # An MoE layer whose dispatch and combine payloads both stop moving after their first (warm-up) call.
    with gloo_fault("stale", 0, torch.uint8), gloo_fault("stale", 0, torch.bfloat16):
        results["moe", "stale"] = outcome(comm, [moe(comm.world_size)], opts, TorchDistBackend)
    with gloo_fault("flip", MIDDLE, torch.bfloat16):  # combine's middle timed iteration
        results["moe", "flip"] = outcome(comm, [moe(comm.world_size)], opts, TorchDistBackend)
    # The imbalance-cost reference's combine (after the job's own WARMUP + ITERS combine calls) skips its
    # middle timed iteration: the reference is checked like the job's own phases.
    with gloo_fault("skip", WARMUP + ITERS + MIDDLE, torch.bfloat16):
        with_reference = RunOptions("gloo", imbalance_cost=True)
        results["reference", "skip"] = outcome(comm, [moe(comm.world_size)], with_reference, TorchDistBackend)
    return results


def emu_entry(comm) -> dict:
    results = {"poison": poisoned_then_refilled(comm, ShmemEmuBackend)}
    for mode in CHECK_MODES:
        opts = RunOptions("shmem-emu", check=mode, timeout_s=30.0)
        results[mode, "clean"] = outcome(comm, [BALANCED, moe(comm.world_size)], opts, ShmemEmuBackend)
        for fault in FAULTS:
            with emu_fault(fault, MIDDLE, PUTS_PER_ITERATION):
                results[mode, fault] = outcome(comm, [BALANCED], opts, ShmemEmuBackend)
    with emu_fault("stale", 0, 1):  # payload puts lost after the first while every signal arrives
        opts = RunOptions("shmem-emu", timeout_s=30.0)
        results["moe", "stale"] = outcome(comm, [moe(comm.world_size)], opts, ShmemEmuBackend)
    return results


@pytest.fixture(scope="module", params=["gloo", "shmem-emu"])
def outcomes(request) -> tuple[str, dict]:
    """One launch of 2 ranks per backend runs every scenario (spawning costs seconds)."""
    entry = gloo_entry if request.param == "gloo" else emu_entry
    return request.param, launch(2, entry, (), process_group="gloo", timeout_s=60)  # both on gloo


def test_poison_fills_what_the_last_call_returned(outcomes):
    _, results = outcomes
    assert results["poison"] == (True, True)


@pytest.mark.parametrize("mode", CHECK_MODES)
def test_a_clean_run_passes_every_check_mode(outcomes, mode):
    _, results = outcomes
    message, rows = results[mode, "clean"]
    assert message is None
    assert rows == [("alltoall", 0, mode), ("dispatch", 0, mode), ("combine", 0, mode)]


@pytest.mark.parametrize("mode", CHECK_MODES)
@pytest.mark.parametrize("fault", FAULTS)
def test_faults_in_timed_iterations_are_caught(outcomes, mode, fault):
    _, results = outcomes
    message, rows = results[mode, fault]
    assert message is not None and "data verification failed" in message, (mode, fault, rows)
    iterations = ITERS if fault == "stale" else 1  # stale: every timed iteration delivered nothing
    assert (
        f"alltoall {SIZE} B #wrong=" in message and f"in {iterations} of {ITERS} timed iterations" in message
    )
    [(phase, wrong, check)] = rows
    assert phase == "alltoall" and check == mode and wrong > 0
    if fault == "flip":  # one byte: a checksum mismatch counts its whole row, a full check the byte
        assert wrong == (ROW_BYTES if mode == "checksum" else 1)
    if fault == "skip" and mode == "checksum":  # both ranks' two rows kept the poison
        assert wrong == 2 * 2 * ROW_BYTES


def test_moe_faults_are_caught_in_both_phases_and_in_the_imbalance_reference(outcomes):
    backend, results = outcomes
    message, rows = results["moe", "stale"]
    assert "dispatch #wrong=" in message and "combine #wrong=" in message
    assert f"in {ITERS} of {ITERS} timed iterations" in message
    assert [(phase, wrong > 0) for phase, wrong, _ in rows] == [("dispatch", True), ("combine", True)]
    if backend != "gloo":
        return
    message, rows = results["moe", "flip"]
    assert "combine #wrong=" in message and "dispatch" not in message and "in 1 of 5" in message
    assert [(phase, wrong > 0) for phase, wrong, _ in rows] == [("dispatch", False), ("combine", True)]
    message, rows = results["reference", "skip"]
    assert "combine imbalance-cost uniform reference #wrong=" in message and "in 1 of 5" in message
    assert [wrong for _, wrong, _ in rows] == [0, 0]  # the job's own phases were right


def gpu_entry(comm) -> dict:
    """nccl: the faults of the gloo test; nvshmem (when this torch has it): poisoning and clean runs."""
    results: dict = {"poison": poisoned_then_refilled(comm, TorchDistBackend)}
    for mode in CHECK_MODES:
        opts = RunOptions("nccl", check=mode)
        results[mode, "clean"] = outcome(comm, [BALANCED, moe(comm.world_size)], opts, TorchDistBackend)
        for fault in FAULTS:
            with gloo_fault(fault, MIDDLE, torch.uint8, rank=comm.world_size - 1):
                results[mode, fault] = outcome(comm, [BALANCED], opts, TorchDistBackend)
    from commbench.backends.shmem.nvshmem import NvshmemBackend

    try:
        NvshmemBackend.check_available()
    except UsageError:  # this torch has no NVSHMEM: the nccl checks only
        return results
    results["nvshmem poison"] = poisoned_then_refilled(comm, NvshmemBackend)
    opts = RunOptions("nvshmem", check="every")
    results["nvshmem", "clean"] = outcome(comm, [BALANCED, moe(comm.world_size)], opts, NvshmemBackend)
    return results


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")
def test_gpu_faults_are_caught_and_receive_buffers_poisoned():
    world = min(2, torch.cuda.device_count())
    results = launch(world, gpu_entry, (), process_group="nccl", timeout_s=120)
    assert results["poison"] == (True, True)
    for mode in CHECK_MODES:
        message, rows = results[mode, "clean"]
        assert message is None and [wrong for _, wrong, _ in rows] == [0, 0, 0]
        for fault in FAULTS:
            message, rows = results[mode, fault]
            assert message is not None and "data verification failed" in message, (mode, fault)
    if "nvshmem poison" in results:
        assert results["nvshmem poison"] == (True, True)
        message, rows = results["nvshmem", "clean"]
        assert message is None and [(wrong, check) for _, wrong, check in rows] == [(0, "every")] * 3


def test_unknown_check_mode_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown check mode 'all'; choose checksum or every"):
        RunOptions("gloo", check="all").check_world(2)


@pytest.mark.parametrize("backend_class", [MockBackend, SimBackend])
def test_backends_that_move_no_data_report_wrong_na(backend_class):
    jobs = [moe(2), BalancedJob("balanced", [SIZE], warmup=0, iters=2)]
    opts = RunOptions(backend_class.name, corrupt="dispatch", check="every")  # nothing to check
    rows, _ = run_threads(2, lambda comm: run_jobs(comm, jobs, opts, backend_class))
    assert [(r["wrong"], r["check"]) for r in rows] == [(None, "n/a")] * 3
    frame = results_frame(rows)
    table = results_table(frame)
    assert "# Total #wrong         : n/a (no data moved)" in table and "DATA MISMATCH" not in table
    assert "# check: n/a (no data moved" in table
    for _, table in pattern_tables(frame):
        wrong_cells = [line.rsplit("|", 2)[-2].strip() for line in table.markdown().splitlines()[2:]]
        assert wrong_cells and set(wrong_cells) == {"n/a"}


def test_total_wrong_sums_only_the_verified_rows():
    rows, _ = run_threads(2, lambda comm: run_jobs(comm, [BALANCED], RunOptions("mock"), MockBackend))
    verified = {**rows[0], "backend": "gloo", "wrong": 3, "check": "every"}
    table = results_table(results_frame([rows[0], verified]))
    assert "# Total #wrong         : 3 (1 rows n/a: no data moved)  (DATA MISMATCH)" in table

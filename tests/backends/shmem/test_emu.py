"""The CPU emulator of the one-sided path: real local processes, the shared protocol, verification on."""

from __future__ import annotations

import glob
import os
import time
from types import SimpleNamespace

import pytest
import torch

from commbench.backends import get_backend
from commbench.backends.shmem.emu import SharedHeap, ShmemEmuBackend, heap_directory
from commbench.backends.shmem.protocol import Region
from commbench.backends.torchdist import TorchDistBackend
from commbench.errors import CommError, UsageError, VerificationError
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import parse_skew
from commbench.run import dist
from commbench.run.config import RunOptions
from commbench.run.harness import run_jobs
from commbench.run.jobs import BalancedJob, MoeJob
from commbench.traffic.payload import decode_header, encode_rows, expert_outputs, received_keys
from commbench.traffic.plan import plan_rank
from commbench.traffic.routing import RoutingConfig, route_rank

TINY = ModelConfig(name="tiny", hidden=64, num_experts=16, topk=4, dispatch_dtype="fp8", scale_block=32)
TIMEOUT_S = 30.0


def heap_files() -> set[str]:
    return set(glob.glob(os.path.join(heap_directory(), "commbench-shmem-emu-*")))


def cpu_comm(**extra: object) -> SimpleNamespace:
    return SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), timeout_s=1.0, **extra)


def routing(world: int, skew: str, tokens: int = 48, seed: int = 1) -> RoutingConfig:
    return RoutingConfig(
        model=TINY, skew=parse_skew(skew), world_size=world, tokens_per_rank=tokens, seed=seed
    )


def moe_job(world: int, skew: str, mode: str) -> MoeJob:
    return MoeJob(
        name=f"tiny {skew} {mode}",
        routing=routing(world, skew),
        send_mode=mode,
        warmup=1,
        iters=2,
    )


def compare_with_torchdist(comm, cfg: RoutingConfig, mode: str, options: dict) -> tuple[bool, bool]:
    """Both backends on the same plan: the same received rows in the same order, the same combine output."""
    plans = [plan_rank(route_rank(cfg, src), TINY, comm.world_size, mode) for src in range(comm.world_size)]
    plan = plans[comm.rank]
    tokens = encode_rows(comm.rank, torch.arange(plan.num_tokens), plan.dispatch_row_bytes)
    outputs = []
    for backend in (TorchDistBackend(comm, {}), ShmemEmuBackend(comm, options)):
        backend.setup(plan)
        counts = backend.exchange_counts(plan.send_counts)
        received = backend.dispatch(tokens, plan, counts).clone()
        src, token = decode_header(received)
        expert_out = expert_outputs(src, token, received_keys(counts, comm.rank, mode), TINY.hidden)
        combined = backend.combine(expert_out, plan, counts).clone()
        backend.close()
        outputs.append((counts, received, combined))
    (counts_a, recv_a, comb_a), (counts_b, recv_b, comb_b) = outputs
    return bool(torch.equal(counts_a, counts_b) and torch.equal(recv_a, recv_b)), bool(
        torch.equal(comb_a, comb_b)
    )


def _world_entry(comm, scenarios: list[tuple[str, str, dict]], corrupt: bool) -> dict:
    """Runs on every rank: harness jobs with verification, a comparison with gloo, corruption detection."""
    report: dict = {"rows": [], "same_rows": [], "same_combine": []}
    for skew, mode, options in scenarios:
        rows, _ = run_jobs(
            comm,
            [moe_job(comm.world_size, skew, mode)],
            RunOptions("shmem-emu", options, TIMEOUT_S),
            ShmemEmuBackend,
        )
        report["rows"].extend(rows)
        same_rows, same_combine = compare_with_torchdist(comm, routing(comm.world_size, skew), mode, options)
        report["same_rows"].append(same_rows)
        report["same_combine"].append(same_combine)
    balanced = BalancedJob(name="balanced", sizes=[64, 4096], warmup=1, iters=2)
    rows, _ = run_jobs(
        comm, [balanced], RunOptions("shmem-emu", {"chunk_rows": 1}, TIMEOUT_S), ShmemEmuBackend
    )
    report["rows"].extend(rows)
    for phase in ("dispatch", "combine") if corrupt else ():
        try:
            run_jobs(
                comm,
                [moe_job(comm.world_size, "uniform", "token")],
                RunOptions("shmem-emu", {}, TIMEOUT_S, phase),
                ShmemEmuBackend,
            )
            report[f"corrupt_{phase}"] = "not detected"
        except VerificationError as exc:
            report[f"corrupt_{phase}"] = str(exc)
    return report


def check_report(report: dict, scenarios: int, corrupt: bool) -> None:
    moe_rows = [r for r in report["rows"] if r["phase"] in ("dispatch", "combine")]
    assert len(moe_rows) == 2 * scenarios
    assert all(r["wrong"] == 0 for r in report["rows"])
    assert all(r["backend"] == "shmem-emu (CPU emulator)" and r["emulated"] for r in report["rows"])
    assert all("signal" in r and "chunk_rows" in r for r in report["rows"])
    assert report["same_rows"] == [True] * scenarios
    assert report["same_combine"] == [True] * scenarios
    if corrupt:  # one flipped byte / one changed element after timing is caught
        assert "dispatch #wrong=" in report["corrupt_dispatch"]
        assert "combine #wrong=" in report["corrupt_combine"]


def test_world2_skewed_verified_and_equal_to_torchdist() -> None:
    before = heap_files()
    scenarios = [
        ("hot:2:0.4", "token", {}),
        ("zipf:1.2", "selection", {"signal_op": "set", "chunk_rows": 3}),
    ]
    report = dist.launch(2, _world_entry, (scenarios, True), process_group="gloo", timeout_s=TIMEOUT_S)
    check_report(report, len(scenarios), corrupt=True)
    assert heap_files() == before  # the heap file is unlinked as soon as every rank mapped it


def test_world4_skewed_verified_and_equal_to_torchdist() -> None:
    scenarios = [
        ("rank-imbalance:4", "token", {"signal": "segment"}),
        ("zipf:1.5", "selection", {"chunk_rows": 2, "signal": "chunk", "signal_op": "add"}),
    ]
    report = dist.launch(4, _world_entry, (scenarios, False), process_group="gloo", timeout_s=TIMEOUT_S)
    check_report(report, len(scenarios), corrupt=False)


def _silent_peer_entry(comm, silent_rank: int) -> None:
    backend = ShmemEmuBackend(comm, {})
    plan = plan_rank(
        route_rank(routing(comm.world_size, "uniform"), comm.rank), TINY, comm.world_size, "token"
    )
    backend.setup(plan)
    counts = backend.exchange_counts(plan.send_counts)
    if comm.rank == silent_rank:
        time.sleep(120)  # dead to the protocol: never puts, never signals (the launcher stops it later)
    tokens = encode_rows(comm.rank, torch.arange(plan.num_tokens), plan.dispatch_row_bytes)
    backend.dispatch(tokens, plan, counts)


def test_a_silent_peer_is_a_comm_error_within_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(CommError, match=r"waited 3 s in dispatch .*rank\(s\) 1"):
        dist.launch(2, _silent_peer_entry, (1,), process_group="gloo", timeout_s=3.0)
    assert time.monotonic() - started < 60


def test_shared_heap_maps_one_file_for_every_pe(tmp_path) -> None:
    path = str(tmp_path / "heap")
    region = Region("words", 512, (4,), torch.int64)
    creator = SharedHeap(path, world_size=2, pe_bytes=1024, create=True)
    attached = SharedHeap(path, world_size=2, pe_bytes=1024, create=False)
    assert (creator.view(1, region) == 0).all()  # a new heap is zero: signal words start at 0
    creator.view(1, region)[2] = 41
    assert attached.view(1, region).tolist() == [0, 0, 41, 0]
    assert attached.view(0, region).tolist() == [0, 0, 0, 0]
    creator.close()
    attached.close()
    with pytest.raises(CommError, match="expected"):
        SharedHeap(path, world_size=4, pe_bytes=1024, create=False)


def test_registry_label_and_option_errors() -> None:
    assert get_backend("shmem-emu") is ShmemEmuBackend
    backend = ShmemEmuBackend(cpu_comm(), {"chunk_bytes": 4096, "signal": "SEGMENT"})
    assert backend.emulated and backend.label == "shmem-emu (CPU emulator)"
    assert backend.knobs()["signal"] == "segment"
    with pytest.raises(UsageError, match="no option"):
        ShmemEmuBackend(cpu_comm(), {"num_blocks": 4})
    with pytest.raises(UsageError, match="signal_op"):
        ShmemEmuBackend(cpu_comm(), {"signal_op": "or"})
    with pytest.raises(UsageError, match="chunk_rows"):
        ShmemEmuBackend(cpu_comm(), {"chunk_rows": "wide"})
    with pytest.raises(UsageError, match="CPU"):
        ShmemEmuBackend(
            SimpleNamespace(rank=0, world_size=1, device=torch.device("cuda", 0), timeout_s=1.0), {}
        )


def test_ranks_on_two_hosts_are_refused() -> None:
    comm = cpu_comm(all_gather_object=lambda obj: [obj, "elsewhere/boot"])
    backend = ShmemEmuBackend(comm, {})
    plan = plan_rank(route_rank(routing(1, "uniform"), 0), TINY, 1, "token")
    with pytest.raises(UsageError, match="one host"):
        backend.setup(plan)


def test_dispatch_before_setup_is_an_error() -> None:
    backend = ShmemEmuBackend(cpu_comm(), {})
    with pytest.raises(RuntimeError, match="setup"):
        backend.dispatch(torch.zeros(1, 8, dtype=torch.uint8), None, torch.zeros(1, 1))  # type: ignore[arg-type]


def test_a_heap_that_does_not_fit_in_dev_shm_is_one_line_not_sigbus(tmp_path, monkeypatch):
    """A sparse heap on a full /dev/shm maps fine and then kills the rank with SIGBUS at the first write:
    the pages are reserved at creation, and a shortage is a UsageError naming the sizes and the fix."""
    import errno

    import pytest

    from commbench.backends.shmem.emu import SharedHeap
    from commbench.errors import UsageError

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("os.posix_fallocate", full)
    path = tmp_path / "heap"
    with pytest.raises(UsageError, match=r"needs a 4 MiB heap in .* MiB free \(No space left on device\)"):
        SharedHeap(str(path), 4, 1 << 20, create=True)
    assert not path.exists()

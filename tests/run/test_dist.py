"""Launch, collectives and failure handling with real gloo processes (spawned: entries are top-level)."""

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from commbench.errors import CommError, UsageError, VerificationError
from commbench.run.dist import (
    CpuTimer,
    check_group_devices,
    free_port,
    hang_bound_s,
    is_rank0_process,
    launch,
    resolve_backend,
    resolve_group,
    resolve_world_size,
)
from commbench.run.launcher import launch_error as _launch_error

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def gather_entry(comm, tag):
    print(f"hello from rank {comm.rank}", flush=True)
    comm.barrier()
    gathered = comm.all_gather_object({"rank": comm.rank, "tag": tag})
    on_rank0 = comm.gather_object(comm.rank * 10)
    if comm.rank != 0:
        assert on_rank0 is None
    timer = comm.timer()
    timer.start()
    comm.barrier()
    timer.stop()
    assert timer.seconds() >= 0
    return {"gathered": gathered, "gather": on_rank0, "world": comm.world_size, "device": str(comm.device)}


def test_launch_runs_every_rank_and_returns_rank0_result(capfd):
    result = launch(2, gather_entry, ("x",), process_group="gloo", timeout_s=30)
    assert result["gathered"] == [{"rank": r, "tag": "x"} for r in range(2)]
    assert result["gather"] == [0, 10]
    assert result["world"] == 2 and result["device"] == "cpu"
    out = capfd.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" not in out  # only rank 0 prints


def raising_entry(comm):
    comm.barrier()
    if comm.rank == 1:
        raise UsageError("rank one rejects the input")
    comm.barrier()  # rank 0 waits here until the parent stops it


def test_rank_error_reaches_parent_with_class_and_message():
    with pytest.raises(UsageError, match="^rank one rejects the input$"):
        launch(2, raising_entry, (), process_group="gloo", timeout_s=20)


def killed_entry(comm):
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(1000):
        comm.barrier()


def test_killed_rank_stops_the_launch_with_comm_error():
    with pytest.raises(CommError, match="rank 1 exited with signal SIGKILL.*other ranks were stopped"):
        launch(2, killed_entry, (), process_group="gloo", timeout_s=5)


def slow_peer_entry(comm):
    if comm.rank == 1:
        time.sleep(120)
    comm.barrier()


def test_collective_timeout_names_rank_operation_and_the_busy_peer():
    # Rank 1 is alive (its heartbeat is fresh) but outside any collective: named as what rank 0 waited for.
    # The timeout bounds the rendezvous too: 6 s, not 1.5 s, which a busy host's rank start can exceed.
    match = r"^rank 0: barrier timed out after 6 s waiting for rank 1 \(host .*, pid \d+, cpu\) is alive"
    with pytest.raises(CommError, match=match):
        launch(2, slow_peer_entry, (), process_group="gloo", timeout_s=6.0)


def hang_entry(comm):
    time.sleep(600)  # no collective, so only the parent's watchdog can end this


def test_watchdog_stops_ranks_that_make_no_progress():
    with pytest.raises(CommError, match="made no progress"):  # (4 s: the rendezvous of a busy host fits)
        launch(2, hang_entry, (), process_group="gloo", timeout_s=4)


def single_entry(comm, value):
    comm.barrier()
    return (comm.rank, comm.world_size, value)


def test_torchrun_environment_runs_in_process(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert launch(None, single_entry, (7,), process_group="gloo", timeout_s=30) == (0, 1, 7)
    assert not torch.distributed.is_initialized()
    with pytest.raises(UsageError, match="WORLD_SIZE=1"):
        launch(4, single_entry, (7,), process_group="gloo", timeout_s=30)


def test_bad_launch_arguments(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match="world-size"):
        launch(None, single_entry, (1,), process_group="gloo")
    if torch.cuda.device_count() < 64:
        with pytest.raises(UsageError, match="backend nccl needs 64 CUDA device"):
            launch(64, single_entry, (1,), process_group="nccl")
    with pytest.raises(UsageError, match="timeout"):
        launch(2, single_entry, (1,), process_group="gloo", timeout_s=0)


def test_world_size_and_backend_resolution(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    devices = {"count": 0}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices["count"])
    assert is_rank0_process()
    assert resolve_world_size(4) == 4
    with pytest.raises(UsageError, match="--world-size is required outside torchrun"):
        resolve_world_size(None)
    assert resolve_backend("auto", 4) == (
        "gloo",
        "auto: 0 CUDA device(s) for 4 ranks -> gloo (CPU processes)",
    )
    assert resolve_backend("shmem-emu", 4) == ("shmem-emu", "shmem-emu (as requested)")
    assert resolve_backend("nvshmem", 4) == ("nvshmem", "nvshmem (as requested)")  # its group is checked
    with pytest.raises(UsageError, match="backend nvshmem needs 4 CUDA device"):
        check_group_devices("nccl", 4, "nvshmem")
    check_group_devices("gloo", 4, "shmem-emu")  # CPU processes: nothing to check
    with pytest.raises(UsageError, match="unknown process group 'sim'; use one of: nccl, gloo"):
        check_group_devices("sim", 4)
    assert resolve_group("auto", 4) == "gloo"
    devices["count"] = 4
    assert resolve_backend("auto", 4)[0] == "nccl" and resolve_backend("auto", 8)[0] == "gloo"
    assert (resolve_group("auto", 4), resolve_group("nccl", 4), resolve_group("gloo", 8)) == ("nccl",) * 2 + (
        "gloo",
    )
    # Under torchrun: its WORLD_SIZE; auto = nccl with any local device; a device per local rank needed.
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "16"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert not is_rank0_process() and resolve_world_size(None) == 16
    with pytest.raises(UsageError, match="differs from torchrun's WORLD_SIZE=16"):
        resolve_world_size(4)
    assert resolve_backend("auto", 16)[0] == "nccl"
    with pytest.raises(UsageError, match="backend nccl needs 8 CUDA device"):
        resolve_group("auto", 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_backend("auto", 16) == ("nccl", "auto: torchrun with 4 local CUDA device(s) -> nccl")
    assert resolve_group("auto", 16) == "nccl"


def test_launch_error_prefers_the_root_cause():
    def proc(code):
        return SimpleNamespace(exitcode=code)

    peer = CommError("rank 0: barrier failed: Connection closed by peer")
    # A deliberate error beats the peers' communication errors.
    outcomes = {0: ("error", peer, ""), 1: ("error", VerificationError("bad bytes"), "")}
    assert isinstance(_launch_error([proc(1), proc(1)], outcomes, set(), [], 5), VerificationError)
    # A bug comes back as RuntimeError carrying the rank's traceback.
    outcomes = {0: ("error", peer, ""), 1: ("error", KeyError("k"), "Traceback ...")}
    error = _launch_error([proc(1), proc(1)], outcomes, set(), [], 5)
    assert isinstance(error, RuntimeError) and "rank 1" in str(error) and "Traceback" in str(error)
    # A rank killed without reporting beats the peer that noticed it; ranks the parent stopped do not count.
    error = _launch_error([proc(1), proc(-9), proc(-15)], {0: ("error", peer, "")}, {2}, [], 5)
    assert isinstance(error, CommError) and str(error).startswith("rank 1 exited with signal SIGKILL")
    # Among ranks that died silently, the one seen first is the cause (NCCL aborts the peers of a dead rank).
    error = _launch_error([proc(-6), proc(-9)], {}, set(), [], 5, first_failed=[1])
    assert str(error).startswith("rank 1 exited with signal SIGKILL")
    error = _launch_error([proc(None), proc(None)], {}, {0, 1}, [1], 5)
    assert isinstance(error, CommError) and f"{hang_bound_s(5):.0f} s" in str(error)
    assert _launch_error([proc(0), proc(0)], {0: ("ok", 1, ""), 1: ("ok", None, "")}, set(), [], 5) is None


def test_cpu_timer_measures_the_region():
    timer = CpuTimer()
    timer.start()
    timer.stop()
    assert timer.seconds() >= 0

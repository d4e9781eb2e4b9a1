"""One rank's view of the process group: ``Comm`` (guarded collectives, timers), joining and leaving it.

Every collective runs under ``timeout_s``; a failed or timed-out one becomes a one-line ``CommError`` naming
this rank, the operation and, from the peers' heartbeats (``run.liveness``), the peer(s) it was waiting for:
"rank 1: barrier timed out after 10 s waiting for rank 2 (host h, pid 123, cpu): last seen 11 s ago in
'job 'x' dispatch'". A stop signal received meanwhile turns it into ``StoppedError`` instead.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from commbench.errors import CommbenchError, CommError, UsageError
from commbench.run.describe import PROCESS_GROUPS
from commbench.run.heartbeats import Board, StoreBoard, beat_interval_s
from commbench.run.launch_env import (
    adopt_slurm_task,
    check_torchrun_env,
    external_devices_fit,
    launcher,
    rank_device,
)
from commbench.run.liveness import RankMonitor, current_monitor
from commbench.run.nccl_env import apply_nccl_error_env

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_TIMEOUT_WORDS = re.compile(r"timed out|timeout", re.IGNORECASE)
# After a failure, how long rank 0 (holding the c10d store) waits for its live peers to leave first.
LINGER_S = 6.0
_COLLECTIVE_ERRORS = (RuntimeError, TimeoutError, threading.BrokenBarrierError)
# gloo's advice after "Connection closed by peer [addr]:port." ("This is typically caused by a remote worker
# crashing ... GLHF!"): the message names the peer instead.
_GLOO_ADVICE = re.compile(r"\.?\s*This is typically caused by .*$")


def synchronize_device(device: torch.device) -> None:
    """Wait for ``device``'s outstanding work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hang_bound_s(timeout_s: float) -> float:
    """No-progress time after which the parent stops every rank: two collective timeouts plus slack."""
    return 2.0 * timeout_s + 5.0


class Timer(Protocol):
    """Times one region: ``start()`` before the timed work is issued, ``stop(synchronize)`` right after it.

    ``stop`` takes the wait for the device (``Backend.synchronize``) so that each timer puts the end of the
    region on its own side of that wait: a CUDA timer records its end event on the stream BEFORE the host
    waits (no host wake-up or launch latency in the figure), a host clock reads AFTER it (the work must be
    done). One call for both keeps the harness free of per-clock branches."""

    def start(self) -> None: ...
    def stop(self, synchronize: Callable[[], None] | None = None) -> None: ...
    def seconds(self) -> float: ...


class CpuTimer:
    """Host wall clock; ``stop`` reads it after ``synchronize`` (the work is done by then)."""

    def __init__(self) -> None:
        self._start = self._stop = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, synchronize: Callable[[], None] | None = None) -> None:
        if synchronize is not None:
            synchronize()
        self._stop = time.perf_counter()

    def seconds(self) -> float:
        return self._stop - self._start


class CudaTimer:
    """CUDA events on the current stream; ``stop`` records the end event before ``synchronize`` waits, so
    the time is the stream's between the two events; ``seconds`` waits for the end event."""

    def __init__(self, device: torch.device) -> None:
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._device = device

    def start(self) -> None:
        self._begin.record(torch.cuda.current_stream(self._device))

    def stop(self, synchronize: Callable[[], None] | None = None) -> None:
        self._end.record(torch.cuda.current_stream(self._device))
        if synchronize is not None:
            synchronize()

    def seconds(self) -> float:
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1e3


def first_line(exc: BaseException) -> str:
    """First line of an error, without gloo's "[path/file.cc:78] " source prefix."""
    text = str(exc).strip() or type(exc).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])
    return _GLOO_ADVICE.sub("", line)[:300]


@dataclass
class Comm:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    process_group: str  # the torch.distributed backend of the group: "nccl" | "gloo" ("threads": run.threads)
    group: Any = None  # None = the default (world) group
    timeout_s: float = 300.0
    progress: Any = None  # shared per-rank progress array of spawned ranks (the launcher's hang watchdog)
    # This process's heartbeat and stop signals: names the peers a failed collective waited for.
    liveness: RankMonitor | None = field(default=None, kw_only=True, repr=False)

    @contextlib.contextmanager
    def guard(self, operation: str) -> Iterator[None]:
        """Turn a failed or timed-out collective inside the block into a one-line CommError naming the peers
        it waited for (StoppedError if a stop signal came meanwhile)."""
        monitor = self.liveness
        if monitor is not None:
            monitor.enter(operation)
        try:
            yield
        except BaseException as exc:
            if monitor is not None:
                monitor.note_failure()
            if isinstance(exc, CommbenchError) or not isinstance(exc, _COLLECTIVE_ERRORS):
                raise
            # A stop, or a launcher gone (every rank gets its SIGTERM; a peer that left first can fail this
            # call before the signal's handler ran here): the stop is the cause, not the closed connection.
            if monitor is not None and (monitor.signum is not None or monitor.launcher_gone()):
                raise monitor.stopped_error() from exc
            raise self._comm_error(operation, exc) from exc
        finally:
            if monitor is not None:
                monitor.leave()

    def _comm_error(self, operation: str, exc: BaseException) -> CommError:
        detail = first_line(exc)
        timed_out = isinstance(exc, TimeoutError) or bool(_TIMEOUT_WORDS.search(detail))
        peers = self.liveness.peers_text(timed_out) if self.liveness is not None else ""
        if timed_out:
            head = f"rank {self.rank}: {operation} timed out after {self.timeout_s:g} s"
            if peers.startswith("waiting for"):
                return CommError(f"{head} {peers}")
            return CommError(f"{head} ({detail})" + (f"; {peers}" if peers else ""))
        return CommError(f"rank {self.rank}: {operation} failed: {detail}" + (f"; {peers}" if peers else ""))

    def heartbeat(self) -> None:
        """Tell the parent watchdog this rank is making progress."""
        if self.progress is not None:
            self.progress[self.rank] = time.monotonic()

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        """A timed window: this process's heartbeat thread stays asleep inside it (``RankMonitor.quiet``)."""
        return self.liveness.quiet() if self.liveness is not None else contextlib.nullcontext()

    def barrier(self) -> None:
        with self.guard("barrier"):
            if self.process_group == "nccl":
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)
        self.heartbeat()

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        with self.guard("all_gather_object"):
            dist.all_gather_object(gathered, obj, group=self.group)
        self.heartbeat()
        return gathered

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (rank order); None on the other ranks."""
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        with self.guard("gather_object"):
            dist.gather_object(obj, gathered, dst=0, group=self.group)
        self.heartbeat()
        return gathered

    def timer(self) -> Timer:
        """Times one region: CUDA events on a GPU, time.perf_counter on CPU."""
        if self.device.type == "cuda":
            return CudaTimer(self.device)
        return CpuTimer()


def running_under_torchrun() -> bool:
    """torchrun (torch.distributed.run) sets these for every worker it starts."""
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def is_rank0_process() -> bool:
    """True in the process that is, or will launch, rank 0: outside torchrun the launcher, else RANK=0."""
    return not running_under_torchrun() or os.environ.get("RANK") == "0"


def resolve_world_size(world_size: int | None) -> int:
    """The number of ranks: torchrun's WORLD_SIZE (``world_size`` must agree or be None), else
    ``world_size`` (required). UsageError otherwise.

    The first thing every launching command calls: a Slurm task started by srun gets torchrun's variables
    here (``run.launch_env.adopt_slurm_task``, which also says when ``world_size`` means local ranks)."""
    adopt_slurm_task(world_size)
    if running_under_torchrun():
        launched = check_torchrun_env(os.environ)  # before any rendezvous: one line naming the variable
        if world_size is not None and world_size != launched:
            raise UsageError(
                f"--world-size {world_size} differs from torchrun's WORLD_SIZE={launched}; drop --world-size "
                "under torchrun"
            )
        return launched
    if world_size is None or world_size < 1:
        raise UsageError(
            "--world-size is required outside torchrun and srun; pass e.g. --world-size 4 (one local process "
            "per rank)"
        )
    return world_size


def _local_world_size(world_size: int) -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else all of them (spawned here)."""
    if not running_under_torchrun():
        return world_size
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError as exc:
        raise UsageError(f"torchrun's LOCAL_WORLD_SIZE is not an integer: {exc}") from exc


def resolve_backend(backend: str, world_size: int) -> tuple[str, str]:
    """(benchmark backend, why) for ``world_size`` ranks: ``backend`` as requested, or for "auto" nccl
    with a CUDA device per rank (any under torchrun or srun), else gloo. The devices the chosen backend's
    process group needs are ``check_group_devices``'s to check."""
    devices = torch.cuda.device_count()
    external = running_under_torchrun()
    if backend != "auto":
        chosen, reason = backend, f"{backend} (as requested)"
    elif external and devices >= 1:
        started_by = "srun" if launcher() == "slurm" else "torchrun"
        chosen, reason = "nccl", f"auto: {started_by} with {devices} local CUDA device(s) -> nccl"
    elif devices >= max(1, world_size):
        chosen, reason = "nccl", f"auto: {devices} CUDA device(s) for {world_size} ranks -> nccl"
    else:
        chosen = "gloo"
        reason = f"auto: {devices} CUDA device(s) for {world_size} ranks -> gloo (CPU processes)"
    return chosen, reason


def check_group_devices(process_group: str, world_size: int, backend: str = "") -> None:
    """UsageError unless this host can hold its ranks of a ``process_group`` group of ``world_size``
    ranks (``backend``, the benchmark backend, names it in the message; default: the group). nccl needs a
    CUDA device per rank: spawned ranks one each on this host, torchrun/srun ranks one per local rank or
    exactly one visible to each task (per-task binding, ``run.launch_env.rank_device``); gloo nothing."""
    if process_group not in PROCESS_GROUPS:
        raise UsageError(f"unknown process group {process_group!r}; use one of: {', '.join(PROCESS_GROUPS)}")
    if process_group != "nccl":
        return
    devices = torch.cuda.device_count()
    external = running_under_torchrun()
    local = _local_world_size(world_size)
    fits = external_devices_fit(local, devices) if external else devices >= local
    if not fits:
        per_task = " (one per local rank, or exactly 1 per task)" if external else ""
        raise UsageError(
            f"backend {backend or process_group} needs {local} CUDA device(s) on this host{per_task}, found "
            f"{devices}; use --backend gloo (CPU) or fewer ranks"
        )


def resolve_group(process_group: str, world_size: int) -> str:
    """The process group a launch of ``world_size`` ranks joins: ``process_group`` ("nccl" or "gloo"), or
    for "auto" nccl with a CUDA device per rank, else gloo; UsageError when this host cannot hold it."""
    group = resolve_backend(process_group, world_size)[0] if process_group == "auto" else process_group
    check_group_devices(group, world_size)
    return group


def init_comm(
    process_group: str = "auto", timeout_s: float = 300.0, progress: Any = None, board: Board | None = None
) -> Comm:
    """Join the process group described by torchrun's env:// variables (RANK, WORLD_SIZE, ...):
    ``process_group`` is "nccl", "gloo" or "auto" (``resolve_group``), the benchmark backend's
    ``Backend.process_group``.

    With a ``RankMonitor`` installed in this process, it publishes heartbeats on ``board`` (spawned ranks'
    shared memory) or else, once the group is up, in the group's c10d store."""
    try:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError) as exc:
        raise UsageError(
            f"bad or missing torchrun variable {exc}; launch with torchrun or --world-size"
        ) from exc
    if timeout_s <= 0:
        raise UsageError(f"timeout must be positive, got {timeout_s} s")
    group = resolve_group(process_group, world_size)
    group_timeout_s = float(timeout_s)
    if group == "nccl":
        # One device per local rank, or the one device a per-task binding shows (srun --gpus-per-task=1).
        local_world_size = _local_world_size(world_size)
        device = torch.device("cuda", rank_device(local_rank, local_world_size, torch.cuda.device_count()))
        torch.cuda.set_device(device)
        # Before the group exists (torch reads them then): a failed or timed-out NCCL collective becomes a
        # Python error here, and torch's own kill comes after commbench's watchdog (run.nccl_env).
        group_timeout_s = apply_nccl_error_env(timeout_s, hang_bound_s(timeout_s)).process_group_timeout_s
    else:
        device = torch.device("cpu")
    monitor = current_monitor()
    interval = beat_interval_s(timeout_s)
    if monitor is not None and board is not None:
        monitor.attach(board, world_size, str(device), interval)
    if monitor is not None and progress is None:  # no launcher watches this rank (torchrun, Slurm)
        progress = [0.0] * world_size
        monitor.watch_progress(hang_bound_s(timeout_s), float(timeout_s), progress)
    comm = Comm(
        rank, world_size, local_rank, device, group, None, float(timeout_s), progress, liveness=monitor
    )
    comm.heartbeat()
    with comm.guard(f"init_process_group({group})"):
        dist.init_process_group(
            group,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout_s),
            **({"device_id": device} if group == "nccl" else {}),
        )
    if monitor is not None and monitor.board is None and world_size > 1:
        store = StoreBoard(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size)
        monitor.attach(store, world_size, str(device), interval)
    comm.heartbeat()
    return comm


def shutdown_comm(comm: Comm, ok: bool = True) -> None:
    """Leave the process group. ``ok``: every rank finished, so meet once more (no rank's store client still
    talks to rank 0's store when it exits) and destroy the group. After a failure say so in the last
    heartbeat and destroy a gloo group at once (its peers see the departure instead of a timeout; an NCCL
    group whose peer is gone could block), while rank 0 keeps the group's store up until its live peers have
    read from it who they were waiting for (``RankMonitor.linger_for_peers``)."""
    monitor = comm.liveness
    if monitor is not None:
        monitor.leaving("finished" if ok else "failed")
    store = None
    if dist.is_initialized():
        if ok:
            with contextlib.suppress(CommbenchError):
                comm.barrier()
        elif comm.rank == 0:
            with contextlib.suppress(Exception):  # the store object outlives the group while held here
                store = dist.distributed_c10d._get_default_store()
        if ok or comm.process_group == "gloo":
            dist.destroy_process_group()
    if not ok and monitor is not None and not dist.is_initialized():  # peers released: they can read now
        monitor.linger_for_peers(LINGER_S)
    del store

"""Process groups, launch and timeouts.

``launch`` runs ``entry(comm, *args)`` on every rank: in-process under torchrun (env:// variables present),
otherwise in ``world_size`` spawned local processes watched by the parent. Every collective runs under
``timeout_s``; a timed-out collective or a dead peer becomes ``CommError`` naming the rank and the operation.
The parent stops all ranks when one exits abnormally, or when a rank makes no progress (``Comm.heartbeat``,
called by every barrier and gather) for ``hang_bound_s(timeout_s)`` seconds.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from commbench.errors import CommbenchError, CommError, UsageError

PROCESS_GROUP_BACKENDS = ("nccl", "gloo")
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Seconds a spawned rank may take to start (interpreter + torch import) before the watchdog gives up on it.
_STARTUP_BOUND_S = 120.0
# After the first rank fails, how long the others get to report their own error before being stopped.
_FAILURE_GRACE_S = 1.0
_POLL_S = 0.05


def hang_bound_s(timeout_s: float) -> float:
    """No-progress time after which the parent stops every rank: two collective timeouts plus slack."""
    return 2.0 * timeout_s + 5.0


class Timer(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def seconds(self) -> float: ...


class CpuTimer:
    """Host wall clock (the caller synchronizes the device before ``stop`` where it matters)."""

    def __init__(self) -> None:
        self._start = self._stop = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        self._stop = time.perf_counter()

    def seconds(self) -> float:
        return self._stop - self._start


class CudaTimer:
    """CUDA events on the current stream; ``seconds`` waits for the end event."""

    def __init__(self, device: torch.device) -> None:
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._device = device

    def start(self) -> None:
        self._begin.record(torch.cuda.current_stream(self._device))

    def stop(self) -> None:
        self._end.record(torch.cuda.current_stream(self._device))

    def seconds(self) -> float:
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1e3


def _first_line(exc: BaseException) -> str:
    """First line of an error, without gloo's "[path/file.cc:78] " source prefix."""
    text = str(exc).strip() or type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])[:300]


@dataclass
class Comm:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # process-group backend: "nccl" | "gloo"
    group: Any = None  # None = the default (world) group
    timeout_s: float = 300.0
    progress: Any = None  # shared per-rank heartbeat array of spawned ranks (watched by the parent)

    @contextlib.contextmanager
    def guard(self, operation: str) -> Iterator[None]:
        """Turn a failed or timed-out collective inside the block into a one-line CommError."""
        try:
            yield
        except CommbenchError:
            raise
        except (RuntimeError, TimeoutError, threading.BrokenBarrierError) as exc:
            raise CommError(f"rank {self.rank}: {operation} failed: {_first_line(exc)}") from exc

    def heartbeat(self) -> None:
        """Tell the parent watchdog this rank is making progress."""
        if self.progress is not None:
            self.progress[self.rank] = time.monotonic()

    def barrier(self) -> None:
        with self.guard("barrier"):
            if self.backend == "nccl":
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


def resolve_backend(backend: str, local_world_size: int) -> str:
    """'auto' -> nccl when every local rank has a GPU, else gloo; checks nccl has enough GPUs."""
    gpus = torch.cuda.device_count()
    if backend == "auto":
        return "nccl" if gpus >= local_world_size > 0 else "gloo"
    if backend not in PROCESS_GROUP_BACKENDS:
        raise UsageError(f"unknown process-group backend {backend!r}; choose auto, nccl or gloo")
    if backend == "nccl" and gpus < local_world_size:
        raise UsageError(
            f"backend nccl needs {local_world_size} GPU(s) on this host, found {gpus}; "
            "use gloo or fewer ranks"
        )
    return backend


def init_comm(backend: str = "auto", timeout_s: float = 300.0, progress: Any = None) -> Comm:
    """Join the process group described by torchrun's env:// variables (RANK, WORLD_SIZE, ...)."""
    try:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except (KeyError, ValueError) as exc:
        raise UsageError(
            f"bad or missing torchrun variable {exc}; launch with torchrun or --world-size"
        ) from exc
    if timeout_s <= 0:
        raise UsageError(f"timeout must be positive, got {timeout_s} s")
    backend = resolve_backend(backend, local_world_size)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    comm = Comm(rank, world_size, local_rank, device, backend, None, float(timeout_s), progress)
    comm.heartbeat()
    with comm.guard(f"init_process_group({backend})"):
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": device} if backend == "nccl" else {}),
        )
    comm.heartbeat()
    return comm


def shutdown_comm(comm: Comm) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def running_under_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARIABLES)


def launch(
    world_size: int | None,
    entry: Callable[..., Any],
    args: Sequence[Any] = (),
    backend: str = "auto",
    timeout_s: float = 300.0,
) -> Any:
    """Run ``entry(comm, *args)`` on every rank; returns rank 0's return value.

    Under torchrun (env:// variables set) this process is one rank. Otherwise ``world_size`` local processes
    are spawned (``entry`` must be a picklable top-level function); an exception of type CommbenchError in a
    rank is re-raised here with its class and message, a dead or hung rank stops all and raises CommError.
    """
    if running_under_torchrun():
        try:
            launched = int(os.environ["WORLD_SIZE"])
        except ValueError as exc:
            raise UsageError(f"torchrun's WORLD_SIZE is not an integer: {exc}") from exc
        if world_size is not None and world_size != launched:
            raise UsageError(
                f"--world-size {world_size} disagrees with torchrun's WORLD_SIZE={launched}; drop it"
            )
        comm = init_comm(backend, timeout_s)
        try:
            return entry(comm, *args)
        finally:
            shutdown_comm(comm)
    if world_size is None or world_size < 1:
        raise UsageError("give the number of local ranks to spawn (--world-size N), or launch with torchrun")
    if timeout_s <= 0:
        raise UsageError(f"timeout must be positive, got {timeout_s} s")
    return _spawn(world_size, entry, tuple(args), resolve_backend(backend, world_size), float(timeout_s))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    entry: Callable[..., Any],
    args: tuple[Any, ...],
    outcome_dir: str,
    progress: Any,
) -> None:
    """One spawned rank: run entry and leave its outcome (result or exception) in a file for the parent."""
    progress[rank] = time.monotonic()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if rank != 0:  # only rank 0 prints progress
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        warnings.simplefilter("ignore")
    # The parent reports errors; SIGTERM from it must not print tracebacks of every rank.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
    if backend == "gloo":  # CPU ranks share this host's cores: no oversubscription by intra-op threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    comm = None
    try:
        comm = init_comm(backend, timeout_s, progress)
        result = entry(comm, *args)
        outcome: tuple[str, Any, str] = ("ok", result if rank == 0 else None, "")
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        outcome = ("error", exc, traceback.format_exc())
    path = os.path.join(outcome_dir, f"rank{rank}.pkl")
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - an unpicklable result or exception still reaches the parent as text
        kind, value, text = outcome
        payload = pickle.dumps((kind, RuntimeError(f"{type(value).__name__}: {value}"), text))
    with open(path + ".tmp", "wb") as handle:
        handle.write(payload)
    os.replace(path + ".tmp", path)
    if outcome[0] == "ok":
        shutdown_comm(comm)
    # Everything is reported: skip interpreter teardown (slow with torch loaded, and after a failure
    # destroying a group whose peer died can block).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if outcome[0] == "ok" else 1)


def _spawn(
    world_size: int, entry: Callable[..., Any], args: tuple[Any, ...], backend: str, timeout_s: float
) -> Any:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    progress = context.Array("d", world_size, lock=False)  # 0.0 = not started yet
    outcome_dir = tempfile.mkdtemp(prefix="commbench-launch-")
    port = _free_port()
    processes = [
        context.Process(
            target=_worker,
            args=(rank, world_size, port, backend, timeout_s, entry, args, outcome_dir, progress),
            name=f"commbench-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        first_failed, hung = _watch(processes, progress, timeout_s)
        stopped = _stop(processes)
        outcomes = _read_outcomes(outcome_dir, world_size)
    finally:
        _stop(processes)
        shutil.rmtree(outcome_dir, ignore_errors=True)
    error = _launch_error(processes, outcomes, stopped, hung, timeout_s, first_failed)
    if error is not None:
        raise error
    return outcomes[0][1]


def _watch(processes: list[Any], progress: Any, timeout_s: float) -> tuple[list[int], list[int]]:
    """Wait until every rank exits, one fails (plus a short grace), or ranks hang.

    Returns (the ranks seen failing first, hung ranks).
    """
    started = time.monotonic()
    bound = hang_bound_s(timeout_s)
    while True:
        codes = [process.exitcode for process in processes]
        if all(code is not None for code in codes):
            return [rank for rank, code in enumerate(codes) if code != 0], []
        first_failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if first_failed:
            # The others usually fail on their own within moments (peer closed): let them report why.
            deadline = time.monotonic() + _FAILURE_GRACE_S
            while time.monotonic() < deadline and any(p.exitcode is None for p in processes):
                time.sleep(_POLL_S)
            return first_failed, []
        now = time.monotonic()
        hung = [
            rank
            for rank, code in enumerate(codes)
            if code is None
            and (
                (progress[rank] == 0.0 and now - started > _STARTUP_BOUND_S + timeout_s)
                or (progress[rank] > 0.0 and now - progress[rank] > bound)
            )
        ]
        if hung:
            return [], hung
        time.sleep(_POLL_S)


def _stop(processes: list[Any]) -> set[int]:
    """Terminate ranks still running (SIGTERM, then SIGKILL); returns the ranks that had to be stopped."""
    alive = {rank for rank, process in enumerate(processes) if process.pid is not None and process.is_alive()}
    for rank in alive:
        processes[rank].terminate()
    deadline = time.monotonic() + 3.0
    for rank in alive:
        processes[rank].join(max(0.0, deadline - time.monotonic()))
        if processes[rank].is_alive():
            processes[rank].kill()
            processes[rank].join(5.0)
    return alive


def _read_outcomes(outcome_dir: str, world_size: int) -> dict[int, tuple[str, Any, str]]:
    outcomes = {}
    for rank in range(world_size):
        path = os.path.join(outcome_dir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as handle:
                try:
                    # Not user input: written by this launch's own spawned ranks into the private (0700) dir
                    # from mkdtemp, the same trust as multiprocessing's pickled arguments to those ranks.
                    outcomes[rank] = pickle.load(handle)
                except Exception as exc:  # noqa: BLE001 - e.g. an exception class that cannot be rebuilt
                    outcomes[rank] = ("error", RuntimeError(f"unreadable error of rank {rank}: {exc}"), "")
    return outcomes


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _launch_error(
    processes: list[Any],
    outcomes: dict[int, tuple[str, Any, str]],
    stopped: set[int],
    hung: list[int],
    timeout_s: float,
    first_failed: Sequence[int] = (),
) -> BaseException | None:
    """The root cause among the ranks' outcomes, or None when every rank succeeded."""
    errors = {rank: (value, text) for rank, (kind, value, text) in outcomes.items() if kind == "error"}
    # 1. What a rank raised on purpose (verification, bad input): the same class and message.
    for _rank, (exc, _text) in sorted(errors.items()):
        if isinstance(exc, CommbenchError) and not isinstance(exc, CommError):
            return exc
    # 2. A bug in a rank: its traceback.
    for rank, (exc, text) in sorted(errors.items()):
        if not isinstance(exc, CommbenchError):
            return RuntimeError(f"rank {rank} failed with {type(exc).__name__}: {exc}\n{text}")
    # 3. A rank that died without reporting (killed, os._exit, crash in native code), the first seen first:
    # NCCL's watchdog aborts the peers of a dead rank too.
    ordered = [*first_failed, *(rank for rank in range(len(processes)) if rank not in first_failed)]
    for rank in ordered:
        code = processes[rank].exitcode
        if rank not in outcomes and rank not in stopped and code not in (None, 0):
            hint = (
                " (SIGKILL is often the out-of-memory killer: check dmesg)" if code == -signal.SIGKILL else ""
            )
            return CommError(
                f"rank {rank} exited with {_exit_description(code)} without reporting an error; "
                f"the other ranks were stopped{hint}"
            )
    if hung:
        ranks = ", ".join(str(rank) for rank in hung)
        return CommError(
            f"rank(s) {ranks} made no progress for {hang_bound_s(timeout_s):.0f} s "
            f"(hang; timeout {timeout_s:g} s); all ranks were stopped"
        )
    # 4. Peers that saw the failure (timeouts, connection closed).
    for _rank, (exc, _text) in sorted(errors.items()):
        return exc
    missing = [rank for rank in range(len(processes)) if rank not in outcomes]
    if missing:
        return CommError(
            f"rank(s) {', '.join(map(str, missing))} ended without a result; the others were stopped"
        )
    return None

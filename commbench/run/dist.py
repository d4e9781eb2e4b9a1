"""Process groups, launch and timeouts: ``launch`` runs ``entry(comm, *args)`` on every rank.

Under torchrun or Slurm (env:// variables present) this process is one rank: it joins the group, runs entry,
and a stop signal (SIGTERM from srun or torchrun, SIGINT, SIGHUP) ends it with ``StoppedError`` after the
current iteration is abandoned and rank 0's report is written. Otherwise ``world_size`` local processes are
spawned and watched (``run.launcher``). Every collective runs under ``timeout_s``; a timed-out collective or a
dead or stopped peer becomes ``CommError`` naming the rank, the operation and the peer it waited for
(``run.comm``, ``run.liveness``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from commbench.errors import UsageError
from commbench.run.comm import (
    Comm,
    CpuTimer,
    CudaTimer,
    Timer,
    check_group_devices,
    hang_bound_s,
    init_comm,
    is_rank0_process,
    resolve_backend,
    resolve_group,
    resolve_world_size,
    running_under_torchrun,
    shutdown_comm,
)
from commbench.run.launcher import free_port, launch_error, spawn
from commbench.run.liveness import RankMonitor

__all__ = [
    "Comm",
    "CpuTimer",
    "CudaTimer",
    "Timer",
    "check_group_devices",
    "free_port",
    "hang_bound_s",
    "init_comm",
    "is_rank0_process",
    "launch",
    "launch_error",
    "resolve_backend",
    "resolve_group",
    "resolve_world_size",
    "running_under_torchrun",
    "shutdown_comm",
]


def launch(
    world_size: int | None,
    entry: Callable[..., Any],
    args: Sequence[Any] = (),
    process_group: str = "auto",
    timeout_s: float = 300.0,
) -> Any:
    """Run ``entry(comm, *args)`` on every rank; returns rank 0's return value.

    ``process_group`` is the group the ranks join: "nccl" (one GPU per rank), "gloo" or "auto"
    (``resolve_group``); a benchmark backend's is its class's ``process_group``. Under torchrun (env://
    variables set) this process is one rank. Otherwise ``world_size`` local processes are spawned (``entry``
    must be a picklable top-level function); an exception of type CommbenchError in a rank is re-raised here
    with its class and message, a dead or hung rank stops all and raises CommError, a stop signal raises
    StoppedError.
    """
    world_size = resolve_world_size(world_size)
    if running_under_torchrun():
        return _run_this_rank(entry, tuple(args), process_group, timeout_s)
    if timeout_s <= 0:
        raise UsageError(f"timeout must be positive, got {timeout_s} s")
    group = resolve_group(process_group, world_size)
    return spawn(world_size, entry, tuple(args), group, float(timeout_s))


def _run_this_rank(
    entry: Callable[..., Any], args: tuple[Any, ...], process_group: str, timeout_s: float
) -> Any:
    """This process is one rank of a torchrun/Slurm launch: heartbeats and stop signals while entry runs."""
    monitor = None
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
        rank = os.environ.get("RANK", "")
        monitor = RankMonitor.install(int(rank) if rank.isascii() and rank.isdigit() else 0)
    comm = None
    ok = False
    try:
        comm = init_comm(process_group, timeout_s)
        result = entry(comm, *args)
        ok = True
        return result
    finally:
        if comm is not None:
            shutdown_comm(comm, ok)
        if monitor is not None:
            monitor.close()

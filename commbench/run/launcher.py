"""The spawning launcher: ``world_size`` local rank processes, watched until they finish, fail, hang or are
stopped, and the one root cause raised.

Watching: a rank that exits abnormally stops the others (after a short grace in which they report their own
error); a rank that makes no progress (``Comm.heartbeat``) for ``hang_bound_s(timeout_s)`` is hung. When
the survivors time out waiting for a rank that is stopped (SIGSTOP), frozen or stuck in the kernel, that rank
(host, pid, device, process state, last operation, from its heartbeats and /proc) is the error, ahead of
their timeouts.

Stopping: SIGINT, SIGTERM or SIGHUP to the launcher is forwarded to every rank (rank 0 then writes what
finished and marks the report incomplete), and whatever is left after ``LAUNCHER_GRACE_S`` (a second signal:
at once) is killed; the temporary folder and the ranks' scratch files go, and ``StoppedError`` (exit
128 + N) is raised. Ranks start with those signals blocked until their own handlers are in place, die with
the launcher (``PR_SET_PDEATHSIG`` plus a parent check on every heartbeat) and then clean up after it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait as wait_for_any
from typing import Any

import torch

from commbench.errors import CommbenchError, CommError, StoppedError, VerificationError, signal_name
from commbench.run.comm import hang_bound_s, init_comm, shutdown_comm
from commbench.run.heartbeats import Beat, SharedBoard, beat_interval_s, stale_after_s
from commbench.run.liveness import STOP_GRACE_S, STOP_SIGNALS, RankMonitor
from commbench.run.outcomes import OutcomeReader, RankFailure, check_temp_dir, send_outcome
from commbench.run.processes import (
    LAUNCH_ID_VARIABLE,
    STATE_WORDS,
    MultiprocessingScratch,
    die_with_parent,
    fork_server_context,
    leave_the_fork_server,
    matplotlib_dir_for,
    name_process,
    process_state,
    remove_scratch,
    stop_fork_server,
)

# Seconds a spawned rank may take to start (interpreter + torch import) before the watchdog gives up on it.
_STARTUP_BOUND_S = 120.0
# After the first rank fails, how long the others get to report their own error before being stopped.
_FAILURE_GRACE_S = 1.0
# After ranks found wrong data, how long rank 0 gets to finish the report and its verdict on its own.
_REPORT_GRACE_S = 60.0
# After a stop signal, how long the ranks get (their own hard stop comes first) before they are killed.
LAUNCHER_GRACE_S = 2 * STOP_GRACE_S + 1.0
_POLL_S = 0.05
_WATCH_S = 1.0  # the watch loop's hang check: exits and stop signals wake it at once

Outcome = tuple[str, Any, str]  # ("ok", result, "") | ("error", exception, traceback text): run.outcomes
Liveness = dict[int, tuple[str | None, Beat | None]]  # rank -> (process state, last beat) when the run ended


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for MASTER_PORT of a local launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LauncherSignals:
    """SIGINT, SIGTERM and SIGHUP to the launcher, recorded for the watch loop (main thread only; elsewhere
    nothing is installed). A second signal asks for the hard kill at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.escalated = False
        self._previous: dict[int, Any] = {}
        # Written by the handler: the watch loop sleeps on the ranks' exits and this, not on a poll timer.
        self.wake_r, self._wake_w = os.pipe()
        for fd in (self.wake_r, self._wake_w):
            os.set_blocking(fd, False)

    def install(self) -> LauncherSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        else:
            self.escalated = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        """Stop signals wait (they are not lost) while a rank is started: it inherits the mask and unblocks
        them once its own handlers are installed."""
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        for fd in (self.wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    process_group: str,
    timeout_s: float,
    entry: Callable[..., Any],
    args: tuple[Any, ...],
    outcome: Any,
    progress: Any,
    board: SharedBoard,
    launcher_pid: int,
    launch_id: str,
) -> None:
    """One spawned rank: run entry and send its outcome (result, or its error as data) to the launcher over
    the pipe the launcher made for it (``outcome``, run.outcomes)."""
    name_process(f"commbench-r{rank}")
    # Its own session, as torchrun starts its workers (start_new_session): with the kernel's scheduler
    # autogroups (one per session) four CPU ranks in the launcher's session waited ~0.6 ms longer per
    # 1 KiB all-to-all on 2 cores than the same ranks under torchrun (docs/measurements.md). Stop signals
    # reach the ranks through the launcher, which forwards them, and its death through PDEATHSIG.
    with contextlib.suppress(OSError):
        os.setsid()
    die_with_parent(signal.SIGTERM)
    leave_the_fork_server()

    def clean_up_for_the_launcher() -> None:
        if monitor.launcher_gone():  # nobody is left to remove the launch's scratch files
            remove_scratch(launch_id)

    monitor = RankMonitor.install(rank, parent_pid=launcher_pid, on_hard_exit=clean_up_for_the_launcher)
    orphaned = monitor.launcher_gone
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # stop signals that came meanwhile act now
    progress[rank] = time.monotonic()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        **{LAUNCH_ID_VARIABLE: launch_id},
    )
    if rank != 0:  # only rank 0 prints progress
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        warnings.simplefilter("ignore")
    # CPU ranks share this host's cores: no oversubscription by intra-op threads (each rank routes every
    # source rank's tokens); an explicit OMP_NUM_THREADS is the user's choice.
    if process_group == "gloo" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    comm = None
    try:
        if orphaned():  # the launcher died before PR_SET_PDEATHSIG was set
            os.kill(os.getpid(), signal.SIGTERM)
        comm = init_comm(process_group, timeout_s, progress, board)
        result, error, text = entry(comm, *args), None, ""
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the launcher
        result, error, text = None, exc, traceback.format_exc()
    code = 0 if error is None else 1
    try:
        with monitor.deferred():  # a signal now must not cut the outcome short
            if isinstance(error, StoppedError):
                code = error.exit_code
            if orphaned():
                clean_up_for_the_launcher()
            else:
                send_outcome(outcome, rank, result if rank == 0 else None, error, text)
            if comm is not None:
                shutdown_comm(comm, ok=error is None and not orphaned())
    except BaseException:  # noqa: BLE001 - stopped while leaving: the outcome is written or moot
        pass
    # Everything is reported: skip interpreter teardown (slow with torch loaded, and after a failure
    # destroying a group whose peer died can block).
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def spawn(
    world_size: int, entry: Callable[..., Any], args: tuple[Any, ...], process_group: str, timeout_s: float
) -> Any:
    """Run ``entry(comm, *args)`` in ``world_size`` local processes forked by a fork server that imported
    torch and commbench once (spawned where the platform has none); rank 0's return value."""
    from multiprocessing import resource_tracker

    context = fork_server_context(entry)
    progress = context.Array("d", world_size, lock=False)  # 0.0 = not started yet
    board = SharedBoard(world_size, context)
    launch_id = os.urandom(6).hex()
    check_temp_dir()  # the ranks' scratch files and multiprocessing's own live there
    multiprocessing_dir = MultiprocessingScratch(launch_id)
    matplotlib_dir = matplotlib_dir_for(launch_id)
    if matplotlib_dir is not None:  # inherited by the ranks; removed with the launch's scratch
        os.environ["MPLCONFIGDIR"] = matplotlib_dir
    pipes = [context.Pipe(duplex=False) for _ in range(world_size)]  # (launcher's end, the rank's end)
    readers = [OutcomeReader(receive) for receive, _ in pipes]
    port = free_port()
    processes = [
        context.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                port,
                process_group,
                timeout_s,
                entry,
                args,
                pipes[rank][1],
                progress,
                board,
                os.getpid(),
                launch_id,
            ),
            name=f"commbench-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    signals = LauncherSignals().install()
    first_failed: list[int] = []
    hung: list[int] = []
    stopped: set[int] = set()
    liveness: Liveness = {}
    seen_at = None
    try:
        resource_tracker.ensure_running()  # started now: starting it later would unblock the stop signals
        for process, reader, (_, send) in zip(processes, readers, pipes, strict=True):
            with signals.blocked():
                process.start()
            send.close()  # the rank holds its own copy: EOF here once the rank is gone
            reader.start()
            if signals.signum is not None:
                break
        if signals.signum is None:
            first_failed, hung = _watch(processes, progress, timeout_s, signals)
        if signals.signum is not None:
            _stop_on_signal(processes, signals)
        else:
            liveness, seen_at = _snapshot(processes, board), time.time()
            stopped = _stop(processes, liveness)
    finally:
        _kill(processes)
        signals.restore()
        stop_fork_server()
        multiprocessing_dir.close()
        remove_scratch(launch_id)
        if matplotlib_dir is not None and os.environ.get("MPLCONFIGDIR") == matplotlib_dir:
            del os.environ["MPLCONFIGDIR"]
    outcomes = {rank: got for rank, reader in enumerate(readers) if (got := reader.finish()) is not None}
    if signals.signum is not None and not all(outcomes.get(r, ("",))[0] == "ok" for r in range(world_size)):
        raise StoppedError(
            signals.signum, f"stopped by {signal_name(signals.signum)}; all {world_size} ranks were stopped"
        )
    error = launch_error(processes, outcomes, stopped, hung, timeout_s, first_failed, liveness, seen_at)
    if error is not None:
        raise error
    return outcomes[0][1]


def _watch(
    processes: list[Any], progress: Any, timeout_s: float, signals: LauncherSignals
) -> tuple[list[int], list[int]]:
    """Wait until every rank exits, one fails (plus a short grace), ranks hang, or a stop signal comes.

    Returns (the ranks seen failing first, hung ranks).
    """
    started = time.monotonic()
    bound = hang_bound_s(timeout_s)
    while signals.signum is None:
        codes = [process.exitcode for process in processes]
        if all(code is not None for code in codes):
            return [rank for rank, code in enumerate(codes) if code != 0], []
        first_failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if first_failed:
            # The others usually fail on their own within moments (peer closed): let them report why. Wrong
            # data (exit 3) is found by every rank at once, and rank 0 is then writing the verdict: give it
            # the time that takes (its progress beats keep the hang bound away) rather than cut it short.
            wrong_data = all(codes[rank] == VerificationError.exit_code for rank in first_failed)
            deadline = time.monotonic() + (_REPORT_GRACE_S if wrong_data else _FAILURE_GRACE_S)
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
        # Asleep until a rank exits, a stop signal comes, or the next hang check: the launcher takes no core
        # from the ranks (a 20 Hz poll woke it 20 times a second through every timed window).
        running = [process.sentinel for process, code in zip(processes, codes, strict=True) if code is None]
        with contextlib.suppress(OSError, ValueError):
            wait_for_any([*running, signals.wake_r], timeout=_WATCH_S)
    return [], []


def _alive(processes: list[Any]) -> list[int]:
    return [rank for rank, process in enumerate(processes) if process.pid is not None and process.is_alive()]


def _signal(process: Any, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
        os.kill(process.pid, signum)


def _stop_on_signal(processes: list[Any], signals: LauncherSignals) -> None:
    """Forward the launcher's stop signal to every rank (a stopped rank is continued so that it can act),
    then kill what is left after the grace, or at once on a second signal."""
    assert signals.signum is not None
    for rank in _alive(processes):
        _signal(processes[rank], signals.signum)
        _signal(processes[rank], signal.SIGCONT)
    deadline = time.monotonic() + LAUNCHER_GRACE_S
    while _alive(processes) and time.monotonic() < deadline and not signals.escalated:
        time.sleep(_POLL_S)
    _kill(processes)


def _snapshot(processes: list[Any], board: SharedBoard) -> Liveness:
    """Process state and last heartbeat of every rank still running (before anything is stopped)."""
    beats = board.read()
    return {rank: (process_state(processes[rank].pid), beats.get(rank)) for rank in _alive(processes)}


def _stop(processes: list[Any], liveness: Liveness) -> set[int]:
    """Stop the ranks still running: SIGTERM (rank 0 writes what finished), SIGKILL after 3 s; a stopped
    (SIGSTOP) rank is killed at once. Returns the ranks that had to be stopped."""
    alive = set(_alive(processes))
    for rank in alive:
        state = liveness.get(rank, (None, None))[0]
        _signal(processes[rank], signal.SIGKILL if state in ("T", "t") else signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    for rank in alive:
        processes[rank].join(max(0.0, deadline - time.monotonic()))
    _kill(processes)
    return alive


def _kill(processes: list[Any]) -> None:
    """SIGKILL every rank still running and reap it."""
    for rank in _alive(processes):
        processes[rank].kill()
    for process in processes:
        if process.pid is not None:
            process.join(5.0)


def _exit_description(code: int) -> str:
    return f"signal {signal_name(-code)}" if code < 0 else f"code {code}"


def _unresponsive(
    rank: int, state: str | None, beat: Beat | None, now: float, timeout_s: float
) -> str | None:
    """Why rank ``rank``, still running when its peers gave up, is the cause: stopped, stuck in the kernel
    or without a heartbeat; None when it looked healthy (it was merely waiting too)."""
    stale = beat is not None and now - beat.wall > stale_after_s(beat_interval_s(timeout_s))
    if state not in STATE_WORDS and not stale:
        return None
    who = beat.who() if beat is not None else f"rank {rank}"
    why = f"process {STATE_WORDS[state]}" if state in STATE_WORDS else f"no heartbeat (process state {state})"
    if beat is not None:
        activity = beat.activity or "no operation"
        why += f"; last heartbeat {now - beat.wall:.0f} s before the run ended, in '{activity}'"
    return f"{who} stopped responding: {why}"


def launch_error(
    processes: list[Any],
    outcomes: dict[int, Outcome],
    stopped: set[int],
    hung: list[int],
    timeout_s: float,
    first_failed: Sequence[int] = (),
    liveness: Liveness | None = None,
    seen_at: float | None = None,
) -> BaseException | None:
    """The root cause among the ranks' outcomes, or None when every rank succeeded.

    ``liveness``: process state and last heartbeat of the ranks still running when the run ended, read at
    wall time ``seen_at`` (default: now). A beat's age is taken then, not after the ranks were stopped: on a
    loaded host stopping them takes seconds, and a healthy rank that was only waiting would look silent.
    """
    liveness = liveness or {}
    # A rank the launcher stopped reports StoppedError: the launcher's doing, not a cause.
    errors = {
        rank: (value, text)
        for rank, (kind, value, text) in outcomes.items()
        if kind == "error" and not (rank in stopped and isinstance(value, StoppedError))
    }
    # 1. What a rank raised on purpose (verification, bad input, a signal to that rank): the same error.
    for _rank, (exc, _text) in sorted(errors.items()):
        if isinstance(exc, CommbenchError) and not isinstance(exc, CommError):
            return exc
    # 2. A bug in a rank: its traceback.
    for rank, (exc, text) in sorted(errors.items()):
        if not isinstance(exc, CommbenchError):
            kind = exc.type_name if isinstance(exc, RankFailure) else type(exc).__name__
            return RuntimeError(f"rank {rank} failed with {kind}: {exc}\n{text}")
    # Ranks that stopped responding (SIGSTOP, stuck in the kernel, frozen) while their peers waited (step 4),
    # found first: step 3 needs them.
    now = time.time() if seen_at is None else seen_at
    silent = sorted(
        rank for rank in liveness if rank not in outcomes or isinstance(outcomes[rank][1], StoppedError)
    )
    causes = [
        text for rank in silent if (text := _unresponsive(rank, *liveness[rank], now, timeout_s)) is not None
    ]
    # 3. A rank that died without reporting (killed, os._exit, crash in native code), the first seen first:
    # NCCL's watchdog aborts the peers of a dead rank too. A rank torch aborted (SIGABRT: its NCCL watchdog
    # ends a rank whose collective timed out) while another stopped responding is a consequence.
    ordered = [*first_failed, *(rank for rank in range(len(processes)) if rank not in first_failed)]
    aborted = []
    for rank in ordered:
        code = processes[rank].exitcode
        if rank in outcomes or rank in stopped or code in (None, 0):
            continue
        if code == -signal.SIGABRT and causes:
            aborted.append(rank)
            continue
        hint = {
            -signal.SIGKILL: " (SIGKILL is often the out-of-memory killer: check dmesg)",
            -signal.SIGABRT: " (SIGABRT: torch's NCCL watchdog ends a rank whose collective failed or timed "
            "out, unless TORCH_NCCL_ASYNC_ERROR_HANDLING is 0 or 2)",
        }.get(code, "")
        return CommError(
            f"rank {rank} exited with {_exit_description(code)} without reporting an error; "
            f"the other ranks were stopped{hint}"
        )
    # 4. A rank that stopped responding while its peers timed out waiting for it: the cause, ahead of their
    # timeouts.
    if causes:
        waiting = sorted(rank for rank, (exc, _) in errors.items() if isinstance(exc, CommError))
        tail = f"; rank(s) {', '.join(map(str, waiting))} timed out waiting" if waiting else ""
        if aborted:
            tail += f"; rank(s) {', '.join(map(str, sorted(aborted)))} aborted by torch (SIGABRT) waiting"
        return CommError(f"{'; '.join(causes[:4])}{tail} (timeout {timeout_s:g} s); all ranks were stopped")
    if hung:
        ranks = ", ".join(str(rank) for rank in hung)
        return CommError(
            f"rank(s) {ranks} made no progress for {hang_bound_s(timeout_s):.0f} s "
            f"(hang; timeout {timeout_s:g} s); all ranks were stopped"
        )
    # 5. Peers that saw the failure (timeouts, connection closed).
    for _rank, (exc, _text) in sorted(errors.items()):
        return exc
    missing = [rank for rank in range(len(processes)) if rank not in outcomes]
    if missing:
        return CommError(
            f"rank(s) {', '.join(map(str, missing))} ended without a result; the others were stopped"
        )
    return None

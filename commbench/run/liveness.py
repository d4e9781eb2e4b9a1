"""Rank liveness: one monitor per rank process for its heartbeats and stop signals (helpers: run.processes).

Each rank runs one daemon thread (``RankMonitor``) that publishes a heartbeat (``run.heartbeats.Beat``) every
``beat_interval_s`` on a board (shared memory for spawned ranks, the group's c10d store under torchrun or
Slurm). The thread runs while the main thread is blocked in a collective, so a waiting rank stays fresh and
a stopped (SIGSTOP), frozen or vanished rank goes stale: a rank whose collective fails names the stale or
departed peers (``RankMonitor.peers_text``). Inside a timed window (``RankMonitor.quiet``) the thread does
not wake, so it takes neither the GIL nor a core from the timed calls: one beat as the window opens, then
one per ``quiet_bound_s`` (three intervals, under the staleness bound of four and a half) of a longer one;
a stop signal still wakes it at once.

Stop signals (SIGINT, SIGTERM, SIGHUP): the first one raises ``StoppedError`` in the main thread at the next
Python instruction (deferred inside ``deferred_stop()`` blocks, e.g. while rank 0 writes rows, so files
stay whole); later ones are ignored (Ctrl-C reaches the launcher and every rank, and the launcher forwards
it too). The thread also hears the signal (``signal.set_wakeup_fd``) while the main thread is blocked in C
and ends the process itself ``STOP_GRACE_S`` later if it is still there. A spawned rank also watches its
launcher: the kernel's parent-death signal (``PR_SET_PDEATHSIG``) and a parent-pid check on every beat turn
a launcher's death into SIGTERM.

Hangs: a rank no launcher watches (torchrun, Slurm) watches itself (``RankMonitor.watch_progress``). When the
main thread has made no progress (heartbeat, or entering or leaving an operation) for the bound the launcher
uses for spawned ranks, the thread reports the hang as the launcher would, one line naming the operation and
the peers it waited for, and ends the process with exit code 4: a collective stuck in C (an NCCL kernel whose
peer is stopped) cannot raise. That bound comes before torch's own NCCL kill (``run.nccl_env``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from commbench.errors import CommError, StoppedError, signal_name
from commbench.run.heartbeats import (
    STORE_BOUND_S,
    Beat,
    Board,
    BoardUnavailable,
    StoreBoard,
    describe_peers,
    stale_after_s,
)
from commbench.run.processes import process_gone, process_state

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# After a stop signal, how long a rank's main thread gets to finish the iteration and write what it holds
# before the monitor thread ends the process itself (it may be blocked in C on a peer that is gone).
STOP_GRACE_S = 5.0


def hang_message(rank: int, activity: str, idle_s: float, timeout_s: float, peers: str) -> str:
    """The line of a rank whose own watchdog found it stuck: "rank 1: 'job 'x' dispatch' made no progress
    for 25 s (hang; timeout 10 s) waiting for rank 2 (...): last seen 24 s ago in '...'"."""
    head = (
        f"rank {rank}: '{activity or 'no operation'}' made no progress for {idle_s:.0f} s "
        f"(hang; timeout {timeout_s:g} s)"
    )
    if peers.startswith("waiting for"):
        return f"{head} {peers}"
    return f"{head}; {peers}" if peers else head


def _report_hang(error: CommError) -> None:
    """The rank's last word before its watchdog ends it, as the CLI words a CommError, and exit code 4."""
    with contextlib.suppress(Exception):
        sys.stderr.write(f"commbench: error: {error}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    os._exit(error.exit_code)


# ----------------------------------------------------------------------------------------------------------
# One long step


class KeepAlive:
    """Progress beats for one long step the main thread cannot interrupt to beat itself (a kernel compile,
    a library's start-up): ``beat`` every ``interval_s`` from a helper thread, for at most ``bound_s``. The
    hang watchdogs (the launcher's, a rank's own) then wait up to ``bound_s`` longer for that step, and no
    more: a step stuck for good stops beating and is reported as hung one hang bound later. The beats need
    the interpreter: a C call holding the GIL for longer than the hang bound still looks hung."""

    def __init__(self, beat: Callable[[], None], interval_s: float, bound_s: float) -> None:
        self.beat, self.interval_s, self.bound_s = beat, float(interval_s), float(bound_s)
        self.expired = threading.Event()  # the bound passed before the step ended: no more beats
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="commbench-keep-alive", daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.bound_s
        while not self._done.wait(self.interval_s):
            if time.monotonic() >= deadline:
                self.expired.set()
                return
            self.beat()

    def __enter__(self) -> KeepAlive:
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.beat()  # the step is over: that is progress too


# ----------------------------------------------------------------------------------------------------------
# One rank's monitor

_CURRENT: RankMonitor | None = None


def current_monitor() -> RankMonitor | None:
    return _CURRENT


@contextlib.contextmanager
def deferred_stop() -> Iterator[None]:
    """A stop signal arriving inside the block takes effect at its end (rows and files are written whole)."""
    monitor = _CURRENT
    if monitor is None:
        yield
        return
    with monitor.deferred():
        yield


class RankMonitor:
    """This process's stop-signal handlers and heartbeat thread (``install`` in the main thread)."""

    def __init__(
        self, rank: int, parent_pid: int | None = None, on_hard_exit: Callable[[], None] | None = None
    ):
        self.rank = rank
        self.parent_pid = parent_pid  # spawned ranks: the launcher, watched on every beat
        # The process that started this one (the launcher, or the fork server it started): this process is
        # handed to a new parent when that one exits.
        self._first_ppid = os.getppid()
        self.on_hard_exit = on_hard_exit
        self.signum: int | None = None
        self.stop_at: float | None = None
        self._raised = False
        self._deferring = 0
        self._stack: list[tuple[str, float]] = []
        self._failed_in: tuple[str, float] | None = None
        self.board: Board | None = None
        self.world_size = 0
        self.device = "cpu"
        self.interval_s = 1.0
        self.state = "running"
        self._closed = threading.Event()
        self._previous: dict[int, Any] = {}
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._previous_wakeup: int | None = None
        self._hard_signum = int(signal.SIGTERM)
        self._changed = time.monotonic()  # the main thread entered or left an operation
        # Per-rank progress times (``Comm.heartbeat``), read by this rank's own hang watchdog.
        self._progress: Any = None
        self._hang_bound_s = 0.0  # 0: this rank's own hang watchdog is off (a launcher watches it)
        self._timeout_s = 0.0
        self._on_hang: Callable[[CommError], None] = _report_hang
        self._hung = False
        # A timed window is open (``quiet``): the thread sleeps until it closes, or beats once per
        # ``quiet_bound_s`` in a long one; 0.0 = no window.
        self._quiet_until = 0.0
        self._thread = threading.Thread(target=self._loop, name="commbench-heartbeat", daemon=True)

    @classmethod
    def install(
        cls, rank: int, parent_pid: int | None = None, on_hard_exit: Callable[[], None] | None = None
    ) -> RankMonitor:
        """Handlers for SIGINT, SIGTERM and SIGHUP and the heartbeat thread (main thread only)."""
        global _CURRENT
        monitor = cls(rank, parent_pid, on_hard_exit)
        for signum in STOP_SIGNALS:
            monitor._previous[signum] = signal.signal(signum, monitor._on_signal)
        monitor._previous_wakeup = signal.set_wakeup_fd(monitor._wake_w, warn_on_full_buffer=False)
        monitor._thread.start()
        _CURRENT = monitor
        return monitor

    # -- stop signals (main thread) ---------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # already stopping: Ctrl-C and the launcher's forward both arrive
            return
        self.signum = signum
        self.stop_at = time.monotonic()
        self.state = f"stopping ({signal_name(signum)})"
        if self._deferring:
            return
        self._raised = True
        raise self.stopped_error()

    def launcher_gone(self) -> bool:
        """A spawned rank whose launcher has exited (or is exiting: the kernel's parent-death signal comes
        when the launcher's main thread ends, before this process is handed to a new parent)."""
        if self.parent_pid is None:
            return False
        return os.getppid() != self._first_ppid or process_state(self.parent_pid) in (None, "Z", "X")

    @property
    def reason(self) -> str:
        """Why this rank stops: "stopped by SIGTERM", or "the launcher (pid N) is gone"."""
        if self.launcher_gone():
            return f"the launcher (pid {self.parent_pid}) is gone"
        return f"stopped by {signal_name(self.signum or signal.SIGTERM)}"

    def stopped_error(self) -> StoppedError:
        return StoppedError(self.signum or signal.SIGTERM, f"rank {self.rank}: {self.reason}")

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring and self.signum is not None and not self._raised:
            self._raised = True
            raise self.stopped_error()

    # -- heartbeats ---------------------------------------------------------------------------------------

    def attach(self, board: Board, world_size: int, device: str, interval_s: float) -> None:
        """Publish on ``board`` from now on (after the process group is up)."""
        self.world_size, self.device, self.interval_s = world_size, device, interval_s
        self.board = board
        self._publish()

    def enter(self, operation: str) -> None:
        self._stack.append((operation, time.time()))
        self._changed = time.monotonic()

    def leave(self) -> None:
        if self._stack:
            self._stack.pop()
        self._changed = time.monotonic()

    def quiet_bound_s(self) -> float:
        """The longest the thread stays asleep inside a timed window: three beat intervals, so a peer still
        sees a fresh beat (stale after ``stale_after_s``: four intervals and a half) and the hang and
        launcher checks run at least that often."""
        return 3.0 * self.interval_s

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """A timed window (main thread): one beat now, then the heartbeat thread does not wake while the
        block runs (it would take the GIL and a core from the timed call), except once per
        ``quiet_bound_s`` of a longer block. A stop signal still wakes it at once."""
        self._publish()
        self._quiet_until = time.monotonic() + self.quiet_bound_s()
        try:
            yield
        finally:
            self._quiet_until = 0.0

    def _sleep_s(self) -> float:
        """How long the thread sleeps next: until the open window's bound, else one beat interval."""
        left = self._quiet_until - time.monotonic()
        return left if left > 0.0 else self.interval_s

    def _quiet_now(self) -> bool:
        """Inside a timed window whose bound has not passed (a long window's bound then moves on)."""
        if not self._quiet_until or self.stop_at is not None:
            return False
        now = time.monotonic()
        if now < self._quiet_until:
            return True
        self._quiet_until = now + self.quiet_bound_s()  # still open: beat now, then sleep again
        return False

    def watch_progress(
        self,
        bound_s: float,
        timeout_s: float,
        progress: Any,
        on_hang: Callable[[CommError], None] | None = None,
    ) -> None:
        """This rank's own hang watchdog, for a rank no launcher watches: after ``bound_s`` without progress
        (``progress[rank]``, the ``time.monotonic()`` of the last ``Comm.heartbeat``, or an operation entered
        or left) the thread reports the hang (``on_hang``; by default the one stderr line and exit code 4).
        Not while a stop signal is being handled or rank 0 writes its files (``deferred``)."""
        self._progress, self._timeout_s = progress, float(timeout_s)
        if on_hang is not None:
            self._on_hang = on_hang
        self._changed = time.monotonic()
        self._hang_bound_s = float(bound_s)

    def idle_s(self) -> float:
        """Seconds since the main thread last made progress (heartbeat, or an operation entered or left)."""
        last = self._changed
        with contextlib.suppress(Exception):
            last = max(last, float(self._progress[self.rank]))
        return time.monotonic() - last

    def hang_error(self) -> CommError:
        """The error of this rank stuck in its current operation, naming the peers it waits for."""
        text = hang_message(
            self.rank, self.activity()[0], self.idle_s(), self._timeout_s, self.peers_text(True)
        )
        return CommError(text)

    def _check_hang(self) -> None:
        if not self._hang_bound_s or self._hung or self.stop_at is not None or self._deferring:
            return
        if self.idle_s() <= self._hang_bound_s:
            return
        self._hung = True
        error = self.hang_error()
        self.note_failure()
        with contextlib.suppress(Exception):  # the peers read why this rank left
            self.leaving("failed")
        self._on_hang(error)

    def activity(self) -> tuple[str, float]:
        stack = list(self._stack)  # one atomic copy: the main thread pushes and pops
        return " > ".join(name for name, _ in stack), (stack[-1][1] if stack else time.time())

    def _beat(self) -> Beat:
        activity, since = self.activity()
        return Beat(
            self.rank,
            socket.gethostname(),
            os.getpid(),
            self.device,
            time.time(),
            activity,
            since,
            self.state,
        )

    def _publish(self) -> None:
        board = self.board
        if board is not None:
            with contextlib.suppress(Exception):
                board.publish(self._beat())

    def note_failure(self) -> None:
        """Remember the operation an error left (the innermost one: the first call wins) for the last beat."""
        if self._failed_in is None:
            self._failed_in = self.activity()

    def leaving(self, state: str) -> None:
        """Publish a last beat saying why this rank leaves ("finished", "failed", or the stop signal) and stop
        beating."""
        self.state = f"stopped by {signal_name(self.signum)}" if self.signum is not None else state
        if self._failed_in is not None:
            self._stack = [self._failed_in]
        self._publish()
        self._closed.set()
        if self.board is not None:
            self.board.flush(STORE_BOUND_S)

    def linger_for_peers(self, bound_s: float) -> None:
        """Rank 0 holding the group's store, leaving after a failure: wait (at most ``bound_s``) until every
        peer that is still beating has left too, so that their error messages can still read who they were
        waiting for; a stopped peer is stale and not waited for."""
        board = self.board
        if not isinstance(board, StoreBoard) or board.in_agent or self.rank != 0:
            return
        deadline = time.monotonic() + bound_s
        stale_s = stale_after_s(self.interval_s)
        while time.monotonic() < deadline:
            try:
                beats = board.read()
            except BoardUnavailable:
                return
            now = time.time()
            if not [
                b
                for r, b in beats.items()
                if r != self.rank and b.state == "running" and now - b.wall < stale_s
            ]:
                return
            time.sleep(min(0.2, self.interval_s))

    def _loop(self) -> None:
        while not self._closed.is_set():
            with contextlib.suppress(OSError, ValueError):
                ready, _, _ = select.select([self._wake_r], [], [], self._sleep_s())
                if ready:
                    received = os.read(self._wake_r, 64)
                    stops = [s for s in received if s in {int(sig) for sig in STOP_SIGNALS}]
                    if stops and self.stop_at is None:
                        self.stop_at = time.monotonic()
                        self.state = f"stopping ({signal_name(stops[0])})"
                        self._hard_signum = stops[0]
            if self._closed.is_set():
                return
            if self._quiet_now():  # woke (a timeout set before the window opened) inside a timed window
                continue
            self._publish()
            if self.stop_at is None and self.launcher_gone():
                os.kill(os.getpid(), signal.SIGTERM)  # the launcher is gone (PDEATHSIG not set or lost)
            # Rank 0 writing its report (a deferred block) gets twice the grace.
            grace = STOP_GRACE_S * (2 if self._deferring else 1)
            if self.stop_at is not None and time.monotonic() - self.stop_at > grace:
                self._hard_exit()
            self._check_hang()

    def _hard_exit(self) -> None:
        """The main thread did not end within the grace: clean up and leave now."""
        signum = self.signum or self._hard_signum
        if self.on_hard_exit is not None:
            with contextlib.suppress(Exception):
                self.on_hard_exit()
        with contextlib.suppress(Exception):
            sys.stderr.write(f"commbench: rank {self.rank}: stopped by {signal_name(signum)}\n")
            sys.stderr.flush()
        os._exit(128 + int(signum))

    def close(self) -> None:
        """Stop the thread and restore the previous signal handlers (main thread)."""
        global _CURRENT
        self._closed.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        self._thread.join(2.0)
        if self.board is not None:
            self.board.close()
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if _CURRENT is self:
            _CURRENT = None

    # -- naming peers --------------------------------------------------------------------------------------

    def peers_text(self, timed_out: bool) -> str:
        """Which peers this rank was waiting for, from their heartbeats; "" when nothing is known."""
        board = self.board
        if board is None or self.world_size < 2:
            return ""
        try:
            beats = board.read()
        except BoardUnavailable as exc:
            return f"peers' heartbeats unavailable: {exc}"
        return describe_peers(
            _gone_marked(beats), self.rank, self.world_size, self.activity()[0], self.interval_s, timed_out
        )


def _gone_marked(beats: dict[int, Beat]) -> dict[int, Beat]:
    """Peers on this host whose process has exited without a last beat (killed; aborted, e.g. SIGABRT from
    torch's NCCL watchdog) are marked as gone rather than left looking stale."""
    host = socket.gethostname()
    return {
        rank: (
            dataclasses.replace(beat, state="exited without a last heartbeat: killed or aborted")
            if beat.state == "running" and beat.host == host and process_gone(beat.pid)
            else beat
        )
        for rank, beat in beats.items()
    }

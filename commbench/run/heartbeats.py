"""Heartbeats: what each rank publishes (``Beat``), the boards they are published on, and the peers a failed
collective was waiting for (``describe_peers``).

A beat says where a rank runs (host, pid, device), which operation it is in and since when, and its state
(running, stopped by a signal, failed, finished). Spawned ranks publish in shared memory the launcher made
(``SharedBoard``: no network, readable by the launcher and every rank even when rank 0 is stopped); ranks
started by torchrun or Slurm publish in the c10d store the process group met at (``StoreBoard``). A store
whose host process is stopped can block a client far beyond its own timeout, so every store call here runs
in a helper thread given up after ``STORE_BOUND_S``: reading peers never hangs a rank.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

# How long one heartbeat read from (or final write to) the c10d store may take before it is given up.
STORE_BOUND_S = 2.0
_SLOT_BYTES = 512  # one rank's beat in a SharedBoard, JSON (longer operation names are cut)
_LISTED = 4  # peers named in one message, then "and N more"


def beat_interval_s(timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of the collective timeout, within [0.1, 1]."""
    return min(1.0, max(0.1, timeout_s / 10.0))


def stale_after_s(interval_s: float) -> float:
    """A running peer whose last beat is older than this is stopped, frozen or gone."""
    return 4.0 * interval_s + 0.5


@dataclass(frozen=True)
class Beat:
    """One rank's latest heartbeat."""

    rank: int
    host: str
    pid: int
    device: str  # "cpu" | "cuda:3"
    wall: float  # time.time() when published
    activity: str  # operation(s) in progress, outermost first ("" = none)
    since: float  # time.time() the innermost operation began
    state: str = "running"  # running | stopping (SIGTERM) | stopped by SIGTERM | failed | finished

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Beat | None:
        """The beat in ``data``, or None for an empty, torn or foreign slot."""
        try:
            fields = json.loads(bytes(data).split(b"\0", 1)[0].decode())
            return cls(**fields) if isinstance(fields, dict) else None
        except (ValueError, TypeError):
            return None

    def who(self) -> str:
        """Who this is, for messages: rank 2 (host h, pid 123, GPU 2)."""
        device = f"GPU {self.device.split(':', 1)[1]}" if self.device.startswith("cuda:") else self.device
        return f"rank {self.rank} (host {self.host}, pid {self.pid}, {device})"


class BoardUnavailable(Exception):
    """The peers' heartbeats cannot be read; the message says why."""


class Board(Protocol):
    def publish(self, beat: Beat) -> None: ...
    def read(self) -> dict[int, Beat]: ...
    def flush(self, bound_s: float) -> None: ...
    def close(self) -> None: ...


class SharedBoard:
    """Beats of the ranks one launcher spawned, in shared memory it made (``multiprocessing`` RawArray):
    no network, readable by the launcher and by every rank even when rank 0 is stopped."""

    def __init__(self, world_size: int, context: Any) -> None:
        self.world_size = world_size
        self.slots = context.RawArray("c", world_size * _SLOT_BYTES)

    def publish(self, beat: Beat) -> None:
        data = beat.encode()
        if len(data) > _SLOT_BYTES:
            data = Beat(**{**asdict(beat), "activity": beat.activity[:200]}).encode()[:_SLOT_BYTES]
        start = beat.rank * _SLOT_BYTES
        self.slots[start : start + _SLOT_BYTES] = data.ljust(_SLOT_BYTES, b"\0")

    def read(self) -> dict[int, Beat]:
        beats = {}
        for rank in range(self.world_size):
            for _ in range(3):  # a slot caught mid-write does not parse: read it again
                beat = Beat.decode(self.slots[rank * _SLOT_BYTES : (rank + 1) * _SLOT_BYTES])
                if beat is not None:
                    beats[rank] = beat
                    break
        return beats

    def flush(self, bound_s: float) -> None:
        pass

    def close(self) -> None:
        pass


# Threads given up while inside a c10d store call. One that returns while the interpreter shuts down is ended
# by a forced unwind through C++ frames, which aborts the process (SIGABRT): see ``exit_if_stranded``.
_STRANDED: list[threading.Thread] = []


def exit_if_stranded(code: int) -> None:
    """Leave now with ``code`` (stdio flushed, interpreter teardown skipped) if a store call given up on is
    still running; the caller was about to exit anyway."""
    if any(thread.is_alive() for thread in _STRANDED):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _bounded(call: Callable[[], Any], bound_s: float) -> Any:
    """``call()`` in a daemon thread, given up after ``bound_s`` (a c10d store whose host is stopped can
    block a client far beyond its own timeout). TimeoutError when given up; the call's error otherwise."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="commbench-store-call", daemon=True)
    thread.start()
    thread.join(bound_s)
    if thread.is_alive():
        _STRANDED.append(thread)
        raise TimeoutError(f"no answer within {bound_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class StoreBoard:
    """Beats in the c10d store the process group met at (MASTER_ADDR:MASTER_PORT; torchrun, Slurm).

    A publisher thread sends the latest beat (a stopped store stalls only that thread); reads use a fresh
    client, bounded by ``STORE_BOUND_S``. After a failed write the board stops writing (the store is gone).
    """

    def __init__(self, host: str, port: int, world_size: int, bound_s: float = STORE_BOUND_S) -> None:
        self.host, self.port, self.world_size, self.bound_s = host, port, world_size, bound_s
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"commbench/beat/{restart}/"
        self._latest: Beat | None = None
        self._sent: Beat | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._broken = False
        self._publisher = threading.Thread(
            target=self._publish_loop, name="commbench-beat-store", daemon=True
        )
        self._publisher.start()

    @property
    def in_agent(self) -> bool:
        """torchrun's agent holds the store (else rank 0's process does)."""
        return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"

    @property
    def where(self) -> str:
        """Where the store lives, for messages."""
        holder = "torchrun's agent" if self.in_agent else "in rank 0's process"
        return f"the c10d store at {self.host}:{self.port} ({holder})"

    def _client(self) -> Any:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.bound_s)
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout, wait_for_workers=False)

    def _publish_loop(self) -> None:
        client = None
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._closed or self._latest is not self._sent)
                if self._latest is self._sent:  # closed, nothing left to send
                    return
                beat = self._latest
            if not self._broken and beat is not None:
                try:
                    client = client or self._client()
                    client.set(f"{self.prefix}{beat.rank}", beat.encode())
                except Exception:  # noqa: BLE001 - the store is gone: heartbeats are best effort
                    self._broken = True
            with self._wake:
                self._sent = beat
                self._wake.notify_all()

    def publish(self, beat: Beat) -> None:
        with self._wake:
            self._latest = beat
            self._wake.notify_all()

    def flush(self, bound_s: float) -> None:
        """Wait (at most ``bound_s``) until the latest beat is sent."""
        with self._wake:
            self._wake.wait_for(lambda: self._latest is self._sent or self._broken, timeout=bound_s)

    def read(self) -> dict[int, Beat]:
        keys = [f"{self.prefix}{rank}" for rank in range(self.world_size)]

        def fetch() -> dict[int, Beat]:
            client = self._client()
            if client.check(keys):
                values = dict(enumerate(client.multi_get(keys)))
            else:
                values = {rank: client.get(key) for rank, key in enumerate(keys) if client.check([key])}
            beats = {rank: Beat.decode(value) for rank, value in values.items()}
            return {rank: beat for rank, beat in beats.items() if beat is not None}

        holder = "torchrun's agent" if self.in_agent else "rank 0"
        self._check_listening(holder)
        try:
            return _bounded(fetch, self.bound_s + 0.5)
        except TimeoutError as exc:
            # A store whose process was exiting accepted the connection, then never answered: refused now,
            # it is gone (the usual case when rank 0 was stopped), else it is stopped or hung.
            self._check_listening(holder)
            raise BoardUnavailable(
                f"{self.where} did not answer within {self.bound_s:g} s: {holder} is stopped, hung or "
                "unreachable"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - refused, reset, ...
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
            raise BoardUnavailable(f"{self.where} cannot be read ({first}): {holder} is gone") from exc

    def _check_listening(self, holder: str) -> None:
        """BoardUnavailable "has exited" when the store refuses a connection (the client would retry it
        until its timeout)."""
        try:
            socket.create_connection((self.host, self.port), timeout=self.bound_s).close()
        except OSError as exc:
            raise BoardUnavailable(
                f"{self.where} is gone ({exc.strerror or exc}): {holder} has exited"
            ) from exc

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._publisher.join(self.bound_s)
        if self._publisher.is_alive():  # blocked on a store that does not answer
            _STRANDED.append(self._publisher)


def _listed(items: list[str]) -> str:
    more = len(items) - _LISTED
    return "; ".join(items[:_LISTED]) + (f"; and {more} more" if more > 0 else "")


def describe_peers(
    beats: dict[int, Beat], rank: int, world_size: int, activity: str, interval_s: float, timed_out: bool
) -> str:
    """The peers a failed collective waited for: departed ones (their last state), stale ones (stopped,
    frozen or gone: last seen N s ago in what), and after a timeout, live ones busy elsewhere."""
    now = time.time()
    stale_s = stale_after_s(interval_s)
    peers = {r: b for r, b in beats.items() if r != rank}
    # The ones a signal stopped first (a cause), then failed ones (often its consequence), then finished.
    order = {"stopped": 0, "stopping": 0, "failed": 1}
    departed = sorted(
        (b for b in peers.values() if b.state != "running"),
        key=lambda b: (order.get((b.state.split() or [""])[0], 2), b.rank),
    )
    left = [
        f"{b.who()} {'is' if b.state.startswith('stopping') else 'left'} ({b.state}, last in "
        f"'{b.activity or 'no operation'}')"
        for b in departed
    ]
    stale = [
        f"{b.who()}: last seen {now - b.wall:.0f} s ago in '{b.activity or 'no operation'}'"
        for r, b in sorted(peers.items())
        if b.state == "running" and now - b.wall > stale_s
    ]
    silent = [r for r in range(world_size) if r != rank and r not in peers]
    parts = []
    if stale:
        parts.append("waiting for " + _listed(stale))
    if left:
        parts.append(_listed(left))
    if silent:
        parts.append(f"no heartbeat ever from rank(s) {', '.join(map(str, silent[:16]))}")
    if not parts and timed_out:
        busy = [
            f"{b.who()} is alive in '{b.activity or 'no operation'}' for {now - b.since:.0f} s"
            for r, b in sorted(peers.items())
            if b.activity != activity
        ]
        parts.append("waiting for " + _listed(busy) if busy else "every peer is alive and in this operation")
    return "; ".join(parts)

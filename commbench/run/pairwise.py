"""The pairwise link test: every ordered pair of ranks timed one way and both ways at once, in rounds of
disjoint pairs, with every received byte checked.

Schedule (``round_robin_rounds``): the circle method, n - 1 rounds of n / 2 disjoint pairs for an even n
(n rounds with one rank idle per round for an odd n), so every rank talks to exactly one peer at a time and
each round measures n / 2 links at once, as a rack's fabric allows. Per round and pair (a, b), a < b, five
windows run one after the other on every pair of the round together:

* ``latency`` a -> b, then b -> a: ``latency_bytes`` (8 B) messages, one way;
* ``bandwidth`` a -> b, then b -> a: ``bandwidth_bytes`` messages, one way;
* ``bidir``: ``bandwidth_bytes`` both ways at once (each direction timed on its own receiver).

A window (nccl-tests' back-to-back loop, as the balanced sweep): ``warmup`` untimed messages, then ``repeats``
(3) times: the receive buffer poisoned, the window's ``iters`` point-to-point operations built (Python
objects: no part of the timed window), synchronize, barrier, [timer start] the operations posted at once
(``batch_isend_irecv``: grouped on NCCL), wait for the receives [timer stop], wait for the sends, check. A
direction's time is the median of its receiver's ``repeats`` windows / iters (one descheduled process or one
hiccup in one window is not a slow link; ``time_us_min`` and ``time_us_max`` keep the range, the noise the
verdict weighs a slow pair against). A receiver's window runs from the
common barrier until the last byte arrived, the way a slow link shows (a sender's own completion says when its
buffer may be reused, not when the bytes landed). Each window's last message is verified byte for byte
(``wrong`` bytes; poisoned first, so a message that never came cannot pass). Latency here is the time per
message of a one-way stream of small messages (nccl-tests sendrecv_perf's "time" at its smallest size), not a
ping-pong half round trip: a ping-pong mixes both directions, and this test must tell a -> b from b -> a.

What a bidir time is: each end's window while both directions run, ended by the end's own completion as its
transport reports it. On NCCL a rank's sends and receives of the window are one group (one ``Work``:
``batch_isend_irecv`` coalesces them, and its receives cannot complete apart from its sends), so the window
ends when this end's receives AND its own sends completed: the exchange both ways as that end sees it, and a
slow direction slows both ends' bidir rows (the one-way rows tell which direction). On gloo every operation
completes on its own: the window ends when this end's receives completed, its sends (the other direction)
may still be in flight. A one-way window has no sends on its receiver, so both transports time the same.

The ``--inject-delay SRC-DST:US`` test hook (``RunOptions.inject_delay``) makes SRC sleep before each of its
timed sends to DST; those sends are posted from a helper thread so that SRC's own receives (the other
direction) are not held up: exactly the one direction is slowed. On NCCL, where the sends and receives of a
pair must be posted as one group, the delay holds the whole group (both directions of a bidir window).

Rows hold bytes and times only (``pair_rows``); ``report.frame.pair_frame`` derives GB/s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from commbench.errors import UsageError
from commbench.inputs.layout import Layout
from commbench.run.comm import synchronize_device
from commbench.run.config import RunOptions

PAIR_TESTS = ("latency", "bandwidth", "bidir")
POISON = 255  # the receive buffer's sentinel; the payload never holds it (values mod 251)
_PAYLOAD_MODULUS = 251


@dataclass(frozen=True)
class PairwiseJob:
    """The pairwise link test of one launch: message sizes and repetitions per window."""

    kind: ClassVar[str] = "pairwise"
    bandwidth_bytes: int
    latency_bytes: int = 8
    warmup: int = 2
    iters: int = 10
    repeats: int = 3  # timed runs per window; the row's time is their median (one descheduling is no finding)
    name: str = "pairwise"

    def check(self, world_size: int) -> None:
        """UsageError unless the test can run on ``world_size`` ranks."""
        if world_size < 2:
            raise UsageError("the pairwise link test needs at least 2 ranks; add ranks or leave it out")
        if self.bandwidth_bytes < 1 or self.latency_bytes < 1:
            raise UsageError(
                f"pairwise message sizes must be at least 1 byte, got {self.bandwidth_bytes} and "
                f"{self.latency_bytes}"
            )
        if self.iters < 1 or self.warmup < 0 or self.repeats < 1:
            raise UsageError(
                f"pairwise: need iters >= 1, warmup >= 0 and repeats >= 1, got {self.iters}, {self.warmup} "
                f"and {self.repeats}"
            )


@dataclass(frozen=True)
class Window:
    """One timed window of a round: which test, and per pair (a, b) whether a sends, b sends, or both."""

    test: str  # PAIR_TESTS
    size_bytes: int
    forward: bool  # a -> b
    backward: bool  # b -> a


def round_robin_rounds(world_size: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs (a < b) that together hold every unordered pair once: the circle method
    (rank 0 fixed, the others rotate); an odd world gets a phantom rank, whose partner idles that round."""
    if world_size < 2:
        return []
    slots = list(range(world_size)) + ([-1] if world_size % 2 else [])
    count = len(slots)
    rounds = []
    for _ in range(count - 1):
        pairs = []
        for index in range(count // 2):
            first, second = slots[index], slots[count - 1 - index]
            if first >= 0 and second >= 0:
                pairs.append((min(first, second), max(first, second)))
        rounds.append(sorted(pairs))
        slots = [slots[0], slots[-1], *slots[1:-1]]
    return rounds


def windows(job: PairwiseJob) -> list[Window]:
    """The windows every round runs, in order."""
    return [
        Window("latency", job.latency_bytes, True, False),
        Window("latency", job.latency_bytes, False, True),
        Window("bandwidth", job.bandwidth_bytes, True, False),
        Window("bandwidth", job.bandwidth_bytes, False, True),
        Window("bidir", job.bandwidth_bytes, True, True),
    ]


def payload(src: int, dst: int, size: int, device: torch.device) -> torch.Tensor:
    """What ``src`` sends ``dst``: bytes that depend on both ranks and the offset, never POISON."""
    offsets = torch.arange(size, dtype=torch.int64, device=device)
    return ((offsets * 131 + src * 7 + dst * 13 + 1) % _PAYLOAD_MODULUS).to(torch.uint8)


@dataclass
class _Buffers:
    """One rank's send and receive buffers for its peer of the round (reused for both sizes)."""

    send: torch.Tensor
    receive: torch.Tensor
    expected: torch.Tensor


def _buffers(rank: int, peer: int, size: int, device: torch.device) -> _Buffers:
    return _Buffers(
        payload(rank, peer, size, device),
        torch.empty(size, dtype=torch.uint8, device=device),
        payload(peer, rank, size, device),
    )


@dataclass(frozen=True)
class _Operations:
    """One window's point-to-point operations on this rank, built before its timer starts."""

    sends: int
    receive_ops: list[Any]
    send_ops: list[Any]
    delayed: bool  # the test hook's delay applies to these sends


class _PairExchange:
    """Posts one window's messages between this rank and its peer, the test hook's delay included."""

    def __init__(self, comm: Any, peer: int, buffers: _Buffers, delay_s: float) -> None:
        self.comm = comm
        self.peer = peer
        self.buffers = buffers
        self.delay_s = delay_s

    def prepare(self, sends: int, receives: int, delayed: bool) -> _Operations:
        """The operations of ``sends`` and ``receives`` messages (``delayed``: the timed ones, which the test
        hook's delay holds), as ``post`` takes them."""
        group = self.comm.group
        receive = self.buffers.receive
        receive_ops = [dist.P2POp(dist.irecv, receive, self.peer, group)] * receives
        delayed = delayed and self.delay_s > 0 and sends > 0
        # The gloo delay path posts its sends one by one from a helper thread (module docstring).
        lone_sends = delayed and self.comm.process_group != "nccl"
        send_ops = [] if lone_sends else [dist.P2POp(dist.isend, self.buffers.send, self.peer, group)] * sends
        return _Operations(sends, receive_ops, send_ops, delayed)

    def post(self, ops: _Operations) -> tuple[list[Any], list[Any], Any]:
        """(receive works, send works, the thread posting delayed sends or None). On NCCL the batch is one
        group with one Work, returned as the receive work (waiting for it waits for the sends too)."""
        if not ops.delayed:
            both = ops.receive_ops + ops.send_ops
            works = dist.batch_isend_irecv(both) if both else []
            return works[: len(ops.receive_ops)], works[len(ops.receive_ops) :], None
        if ops.send_ops:  # NCCL: one group, so the delay holds the whole window (module docstring)
            time.sleep(self.delay_s * ops.sends)
            works = dist.batch_isend_irecv(ops.receive_ops + ops.send_ops)
            return works[: len(ops.receive_ops)], works[len(ops.receive_ops) :], None
        receive_works = dist.batch_isend_irecv(ops.receive_ops) if ops.receive_ops else []
        send_works: list[Any] = []
        errors: list[BaseException] = []

        def send_late() -> None:
            # A failure here (the group torn down by a stop or a dead peer) is the main thread's to report,
            # as one line under its guard, never a thread's traceback.
            try:
                for _ in range(ops.sends):
                    time.sleep(self.delay_s)
                    send_works.append(dist.isend(self.buffers.send, self.peer, self.comm.group))
            except BaseException as error:  # noqa: BLE001 - handed to the main thread
                errors.append(error)

        thread = threading.Thread(target=send_late, name="commbench-inject-delay", daemon=True)
        thread.errors = errors  # type: ignore[attr-defined]
        thread.start()
        return receive_works, send_works, thread


def _run_window(
    comm: Any, window: Window, pair: tuple[int, int] | None, job: PairwiseJob, opts: RunOptions,
    buffers: _Buffers | None,
) -> dict[str, Any] | None:  # fmt: skip
    """Collective over every rank: one window of the round; this rank's receive sample, or None when it
    received nothing (idle, or the sending side of a one-way window)."""
    rank = comm.rank
    sends = receives = 0
    peer = -1
    if pair is not None and buffers is not None:
        first, second = pair
        peer = second if rank == first else first
        i_am_first = rank == first
        sends_this_way = window.forward if i_am_first else window.backward
        receives_this_way = window.backward if i_am_first else window.forward
        sends, receives = int(sends_this_way), int(receives_this_way)
    view = _Window(buffers, window.size_bytes) if buffers is not None else None
    exchange = _PairExchange(comm, peer, view.buffers, opts.pair_delay_s(rank, peer)) if view else None
    with comm.guard(f"pairwise {window.test} warm-up with rank {peer}"):
        for _ in range(job.warmup):
            if exchange is not None:
                receive_works, send_works, _ = exchange.post(exchange.prepare(sends, receives, False))
                for work in receive_works + send_works:
                    work.wait()
    seconds = []
    wrong = 0
    for _ in range(job.repeats):
        elapsed = _timed_messages(comm, window, job, exchange, sends, receives, view)
        if view is not None and receives:
            seconds.append(elapsed)
            wrong += int((view.buffers.receive != view.buffers.expected).sum().item())
    if not receives or view is None:
        return None
    return {
        "test": window.test,
        "src": peer,
        "dst": rank,
        "size_bytes": window.size_bytes,
        "iters": job.iters,
        "repeats": job.repeats,
        "time_us": float(np.median(seconds)) / job.iters * 1e6,
        "time_us_min": min(seconds) / job.iters * 1e6,
        "time_us_max": max(seconds) / job.iters * 1e6,
        "wrong": wrong,
    }


def _timed_messages(
    comm: Any, window: Window, job: PairwiseJob, exchange: _PairExchange | None, sends: int, receives: int,
    view: _Window | None,
) -> float:  # fmt: skip
    """Collective: one timed run of the window's messages, its receive buffer poisoned first; this rank's
    seconds from the barrier until its last receive completed."""
    if view is not None:
        view.buffers.receive.fill_(POISON)
    ops = exchange.prepare(sends * job.iters, receives * job.iters, True) if exchange is not None else None
    synchronize_device(comm.device)
    comm.barrier()
    timer = comm.timer()
    with comm.guard(f"pairwise {window.test} with rank {exchange.peer if exchange else -1}"):
        timer.start()
        thread = None
        receive_works: list[Any] = []
        send_works: list[Any] = []
        if exchange is not None and ops is not None:
            receive_works, send_works, thread = exchange.post(ops)
        for work in receive_works:
            work.wait()
        timer.stop(lambda: synchronize_device(comm.device))
        if thread is not None:
            thread.join()
            if thread.errors:
                raise thread.errors[0]
        for work in send_works:
            work.wait()
    comm.heartbeat()
    return timer.seconds()


class _Window:
    """The first ``size`` bytes of a rank's buffers (the latency windows use a prefix of the large ones)."""

    def __init__(self, buffers: _Buffers, size: int) -> None:
        self.buffers = _Buffers(buffers.send[:size], buffers.receive[:size], buffers.expected[:size])


def run_pairwise(
    comm: Any,
    job: PairwiseJob,
    opts: RunOptions,
    rounds: Sequence[Sequence[tuple[int, int]]] | None = None,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Collective: every round's windows on every rank; returns every receiver's samples on rank 0 (one row
    per ordered pair and test: src, dst, test, size_bytes, iters, time_us, wrong), [] elsewhere.

    ``rounds`` defaults to the full schedule; the confirmation reruns pass only the flagged pairs.
    ``progress(rounds_done, rounds, samples)`` is called on rank 0 after each round, with every sample of
    the rounds done (gathered round by round: what finished is on rank 0 if the run is stopped later)."""
    job.check(comm.world_size)
    rounds = rounds if rounds is not None else round_robin_rounds(comm.world_size)
    schedule = [list(pairs) for pairs in rounds]
    size = max(job.bandwidth_bytes, job.latency_bytes)
    samples: list[dict[str, Any]] = []
    for index, pairs in enumerate(schedule):
        mine = next((pair for pair in pairs if comm.rank in pair), None)
        buffers = None
        if mine is not None:
            peer = mine[1] if comm.rank == mine[0] else mine[0]
            buffers = _buffers(comm.rank, peer, size, comm.device)
        received = []
        for window in windows(job):
            sample = _run_window(comm, window, mine, job, opts, buffers)
            if sample is not None:
                received.append({**sample, "round": index})
        gathered = comm.gather_object(received)  # after the round's windows: it times nothing
        if gathered is not None:
            samples += [row for rows in gathered for row in rows]
        if progress is not None and comm.rank == 0:
            progress(index + 1, len(schedule), samples)
    return sorted(samples, key=row_order) if comm.rank == 0 else []


def row_order(row: dict[str, Any]) -> tuple[int, int, int]:
    """pairs.csv's order: by test, then source and destination rank."""
    return PAIR_TESTS.index(row["test"]), int(row["src"]), int(row["dst"])


def link_class(layout: Layout, src: int, dst: int) -> str:
    """self, nvlink (same NVLink domain) or scaleout: the class a pair's bytes travel in."""
    if src == dst:
        return "self"
    same = int(layout.domain_of_rank[src]) == int(layout.domain_of_rank[dst])
    return "nvlink" if same else "scaleout"


def pair_rows(samples: Sequence[dict[str, Any]], layout: Layout) -> list[dict[str, Any]]:
    """The samples as pairs.csv rows: each with its link class and both ends' host, GPU and domain."""
    rows = []
    for sample in samples:
        src, dst = int(sample["src"]), int(sample["dst"])
        row = {**sample, "link_class": link_class(layout, src, dst)}
        for end, rank in (("src", src), ("dst", dst)):
            place = layout.places[rank] if rank < len(layout.places) else None
            row[f"{end}_host"] = place.host if place is not None else ""
            row[f"{end}_device"] = place.device if place is not None else -1
            row[f"{end}_domain"] = int(layout.domain_of_rank[rank])
        rows.append(row)
    return rows

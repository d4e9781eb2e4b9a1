"""In-process thread ranks: ``run_threads`` runs one rank per thread of this process (``ThreadComm``).

Used with the mock backend (and sim) to exercise the harness at world sizes no machine has; collectives are
object-level only, through one shared barrier and one slot per rank.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from commbench.errors import CommbenchError, CommError
from commbench.run.dist import Comm, hang_bound_s


class GenerationBarrier:
    """A reusable barrier whose release cannot be undone by a later ``abort``.

    ``threading.Barrier.abort`` breaks the barrier for threads that were already released but had not yet
    woken up (the barrier's state flips from "draining" to "broken" before they look), so a rank that
    completed a collective could still raise BrokenBarrierError. Here each wait belongs to a generation: a
    waiter returns normally once its generation is released, whatever happens afterwards; ``abort`` (or a
    timeout) only fails waits whose generation has not been released, and every later wait.
    """

    def __init__(self, parties: int, timeout: float | None = None) -> None:
        if parties < 1:
            raise ValueError(f"a barrier needs at least one party, got {parties}")
        self.parties = parties
        self.timeout = timeout
        self._cond = threading.Condition()  # re-entrant lock: a test can hold it across wait() + abort()
        self._arrived = 0
        self._generation = 0
        self._broken = False

    @property
    def broken(self) -> bool:
        return self._broken

    def wait(self, timeout: float | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.parties:  # the last arrival releases this generation
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return
            released = self._cond.wait_for(
                lambda: self._generation != generation or self._broken, timeout=timeout
            )
            if self._generation != generation:  # released, even if the barrier broke since
                return
            if not released:  # timed out: nobody else will come, fail every waiter
                self._broken = True
                self._cond.notify_all()
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        """Fail every pending and future wait (generations already released stay released)."""
        with self._cond:
            self._broken = True
            self._cond.notify_all()


class _Hub:
    """What the thread ranks of one run share: a barrier and one slot per rank for gathers."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.barrier = GenerationBarrier(world_size, timeout=timeout_s)
        self.slots: list[Any] = [None] * world_size


@dataclass
class ThreadComm(Comm):
    """A rank that is a thread of this process (process group "threads"); collectives are object-level
    only."""

    hub: Any = None

    def barrier(self) -> None:
        with self.guard("barrier"):
            self.hub.barrier.wait()

    def all_gather_object(self, obj: Any) -> list[Any]:
        with self.guard("all_gather_object"):
            self.hub.slots[self.rank] = copy.deepcopy(obj)
            self.hub.barrier.wait()
            gathered = list(self.hub.slots)
            self.hub.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return gathered

    def gather_object(self, obj: Any) -> list[Any] | None:
        gathered = self.all_gather_object(obj)
        return gathered if self.rank == 0 else None


def run_threads(
    world_size: int, entry: Callable[..., Any], args: Sequence[Any] = (), timeout_s: float = 60.0
) -> Any:
    """Run ``entry(comm, *args)`` on ``world_size`` thread ranks; returns rank 0's result.

    An exception in one rank breaks the others' barriers; the root cause is re-raised (a CommbenchError other
    than CommError first, then any other exception, then CommError).
    """
    hub = _Hub(world_size, timeout_s)
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        comm = ThreadComm(rank, world_size, rank, torch.device("cpu"), "threads", None, timeout_s, None, hub)
        try:
            results[rank] = entry(comm, *args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            errors[rank] = exc
            hub.barrier.abort()

    threads = [
        threading.Thread(target=run, args=(rank,), name=f"rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    for thread in threads:
        thread.start()
    bound = hang_bound_s(timeout_s)
    for thread in threads:
        thread.join(bound)
    hung = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if hung:
        hub.barrier.abort()
        raise CommError(f"thread rank(s) {', '.join(map(str, hung))} made no progress for {bound:.0f} s")
    ordered = [errors[rank] for rank in sorted(errors)]
    for exc in ordered:
        if isinstance(exc, CommbenchError) and not isinstance(exc, CommError):
            raise exc
    for exc in ordered:
        if not isinstance(exc, CommbenchError):
            raise exc
    if ordered:
        raise ordered[0]
    return results[0]

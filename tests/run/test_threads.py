"""Thread ranks: the in-process comm (root-cause errors, a barrier whose release an abort cannot undo)."""

import threading

import pytest

from commbench.errors import CommError, UsageError
from commbench.run.threads import GenerationBarrier, run_threads


def failing_entry(comm):
    comm.barrier()
    if comm.rank == 3:
        raise UsageError("rank 3 refuses")
    comm.barrier()  # broken by rank 3's failure: CommError on the others


def test_run_threads_reports_the_root_cause():
    with pytest.raises(UsageError, match="rank 3 refuses"):
        run_threads(5, failing_entry)

    def lonely(comm):
        if comm.rank == 0:
            comm.barrier()

    with pytest.raises(CommError, match="rank 0: barrier failed"):
        run_threads(2, lonely, timeout_s=0.2)


def test_released_barrier_wait_survives_a_later_abort():
    """Regression: a rank whose barrier generation was released must not see an abort that came after.

    The test thread holds the barrier's (re-entrant) lock across its own arrival and the abort, so the other
    waiter can only wake up once the barrier is both released and broken: the order that made
    threading.Barrier raise BrokenBarrierError in rank 0's second gather wait."""
    barrier = GenerationBarrier(2, timeout=10.0)
    outcome: list[str] = []

    def waiter():
        try:
            barrier.wait()
            outcome.append("released")
        except threading.BrokenBarrierError:
            outcome.append("broken")

    thread = threading.Thread(target=waiter)
    with barrier._cond:
        thread.start()
        while barrier._arrived != 1:  # wait (releasing the lock) until the waiter is parked
            barrier._cond.wait(0.01)
        barrier.wait()  # last arrival: releases the generation
        barrier.abort()  # then another rank fails
    thread.join(10.0)
    assert outcome == ["released"]
    with pytest.raises(threading.BrokenBarrierError):  # later generations are broken
        barrier.wait()


def test_barrier_timeout_breaks_it():
    barrier = GenerationBarrier(2, timeout=0.05)
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait()
    assert barrier.broken

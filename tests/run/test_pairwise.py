"""The pairwise link test on real gloo ranks: the round-robin schedule, every ordered pair measured and
checked, an injected delay slowing exactly one direction, and corruption below commbench counted."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commbench.errors import UsageError
from commbench.run.config import InjectedDelay, RunOptions
from commbench.run.dist import launch
from commbench.run.pairwise import POISON, PairwiseJob, payload, round_robin_rounds, run_pairwise

DELAY_S = 0.03  # far above any gloo message time on a busy 2-core machine (< 5 ms seen)


@pytest.mark.parametrize("world", range(2, 10))
def test_rounds_hold_every_pair_once_in_disjoint_rounds(world: int) -> None:
    rounds = round_robin_rounds(world)
    assert len(rounds) == (world - 1 if world % 2 == 0 else world)
    pairs = [pair for pairs in rounds for pair in pairs]
    assert sorted(pairs) == list(itertools.combinations(range(world), 2))
    for pairs in rounds:
        ranks = [rank for pair in pairs for rank in pair]
        assert len(ranks) == len(set(ranks)) and len(pairs) == world // 2


def test_payload_never_holds_the_poison_and_differs_per_direction() -> None:
    forward = payload(1, 2, 4096, torch.device("cpu"))
    assert not bool((forward == POISON).any())
    assert not torch.equal(forward, payload(2, 1, 4096, torch.device("cpu")))


def test_a_one_rank_world_or_empty_message_is_refused() -> None:
    with pytest.raises(UsageError, match="at least 2 ranks"):
        PairwiseJob(1024).check(1)
    with pytest.raises(UsageError, match="at least 1 byte"):
        PairwiseJob(0).check(4)


def _measure(comm: Any, pair_delay: tuple, corrupt: tuple | None) -> list[dict[str, Any]]:
    if corrupt is not None and comm.rank == corrupt[1]:
        _corrupt_receives_from(corrupt[0])
    delays = tuple(InjectedDelay(src, dst, seconds) for src, dst, seconds in pair_delay)
    opts = RunOptions(backend="gloo", inject_delay=delays)
    return run_pairwise(comm, PairwiseJob(bandwidth_bytes=64 << 10, warmup=1, iters=3), opts)


def _corrupt_receives_from(src: int) -> None:
    """A transport that flips a byte of every message from ``src`` after it arrived (a fault below
    commbench): wraps torch.distributed's batched point-to-point call in this rank's process."""
    real = dist.batch_isend_irecv

    class Flipping:
        def __init__(self, work: Any, tensor: torch.Tensor) -> None:
            self.work, self.tensor = work, tensor

        def wait(self, *args: Any) -> Any:
            result = self.work.wait(*args)
            self.tensor[0] = 253  # no payload byte (values < 251) and not the poison: plainly wrong
            return result

    def batch(ops: list[dist.P2POp]) -> list[Any]:
        works = real(ops)
        return [
            Flipping(work, op.tensor) if op.op is dist.irecv and op.peer == src else work
            for op, work in zip(ops, works, strict=True)
        ]

    dist.batch_isend_irecv = batch


def _times(rows: list[dict[str, Any]]) -> dict[tuple[str, int, int], float]:
    return {(row["test"], row["src"], row["dst"]): row["time_us"] for row in rows}


SLOW, CORRUPTED = (1, 2), (3, 0)  # the planted slow direction and the pair whose bytes are flipped
TESTS = ("latency", "bandwidth", "bidir")


@pytest.fixture(scope="module")
def faulty_rows() -> list[dict[str, Any]]:
    """One 4-rank launch with both faults planted on different pairs: SLOW's sender sleeps DELAY_S before
    each send, and rank 0 sees a byte of every message from rank 3 flipped after it arrived."""
    return launch(4, _measure, (((*SLOW, DELAY_S),), CORRUPTED), "gloo", 120)


def test_every_ordered_pair_is_measured_and_checked_on_gloo(faulty_rows: list[dict[str, Any]]) -> None:
    keys = sorted((row["test"], row["src"], row["dst"]) for row in faulty_rows)
    expected = [(t, a, b) for t in TESTS for a in range(4) for b in range(4) if a != b]
    assert keys == sorted(expected)
    assert all(row["time_us"] > 0 for row in faulty_rows)
    assert all(row["wrong"] == 0 for row in faulty_rows if (row["src"], row["dst"]) != CORRUPTED)
    assert {row["size_bytes"] for row in faulty_rows if row["test"] == "latency"} == {8}
    assert {row["size_bytes"] for row in faulty_rows if row["test"] != "latency"} == {64 << 10}


def test_an_injected_pair_delay_slows_exactly_that_direction(faulty_rows: list[dict[str, Any]]) -> None:
    times = _times(faulty_rows)
    # Half the planted delay separates them: the receiver's window can start a little after the sender's
    # first sleep began (a message then shows slightly under the delay), while noise stays far below.
    slow = {key for key, time_us in times.items() if time_us >= DELAY_S * 1e6 / 2}
    assert slow == {(test, *SLOW) for test in TESTS}, times  # not the reverse direction, nor another pair


def test_bytes_corrupted_below_commbench_are_counted_on_that_pair_only(
    faulty_rows: list[dict[str, Any]],
) -> None:
    wrong = {(row["test"], row["src"], row["dst"]): row["wrong"] for row in faulty_rows if row["wrong"]}
    assert set(wrong) == {(test, *CORRUPTED) for test in TESTS}
    assert all(count == 3 for count in wrong.values()), wrong  # one byte in each of the 3 timed windows


def test_an_odd_world_idles_one_rank_per_round() -> None:
    rows = launch(3, _measure, ((), None), "gloo", 120)
    assert len(rows) == 3 * 6 and all(row["wrong"] == 0 for row in rows)


# ----------------------------------------------------------------------------------------------------------
# Against NCCL's contract: one Work per batch, and no Python work inside a timed window.


class CoalescedWork:
    """The one Work NCCL hands back for a whole batch: it completes when every operation of it did."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, *args: Any) -> bool:
        for work in self.works:
            work.wait(*args)
        return True


def nccl_batches(real: Any) -> Any:
    """``batch_isend_irecv`` as it behaves on NCCL: torch/distributed/distributed_c10d.py runs the ops in
    ``_coalescing_manager(group, device, async_ops=True)``, whose exit does ``work =
    group._end_coalescing(device)`` and ``if async_ops: cm.append(work)``: the batch (one NCCL group) comes
    back as a single Work, and a rank's receives complete together with its sends. Here the gloo ops run
    as they do and their Works are folded into one."""

    def batch(ops: list[Any]) -> list[Any]:
        return [CoalescedWork(real(ops))]

    return batch


class TimedWindows:
    """Counts point-to-point operations built while one of this rank's window timers runs."""

    def __init__(self, comm: Any) -> None:
        self.running = 0
        self.built_inside = 0
        make_timer = comm.timer

        windows = self

        class Timer:
            def __init__(self) -> None:
                self.inner = make_timer()

            def start(self) -> None:
                windows.running += 1
                self.inner.start()

            def stop(self, synchronize: Any = None) -> None:
                self.inner.stop(synchronize)
                windows.running -= 1

            def seconds(self) -> float:
                return self.inner.seconds()

        class RecordedOp(dist.P2POp):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                windows.built_inside += windows.running > 0
                super().__init__(*args, **kwargs)

        self.timer, self.op = Timer, RecordedOp


class NcclLike:
    """This rank's Comm, saying "nccl" as its process group (pairwise then takes its NCCL paths: one batch
    per window, the injected delay before it); every call still goes to the gloo group."""

    process_group = "nccl"

    def __init__(self, comm: Any, timer: Any) -> None:
        self._comm, self.timer = comm, timer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)


def _measure_nccl_like(comm: Any, delay: tuple[int, int, float]) -> tuple[list[dict[str, Any]], int]:
    windows = TimedWindows(comm)
    dist.P2POp = windows.op
    dist.batch_isend_irecv = nccl_batches(dist.batch_isend_irecv)
    opts = RunOptions(backend="nccl", inject_delay=(InjectedDelay(*delay),))
    rows = run_pairwise(
        NcclLike(comm, windows.timer), PairwiseJob(bandwidth_bytes=64 << 10, warmup=1, iters=3), opts
    )
    return rows, int(sum(comm.all_gather_object(windows.built_inside)))


@pytest.fixture(scope="module")
def nccl_like() -> tuple[list[dict[str, Any]], int]:
    return launch(2, _measure_nccl_like, ((0, 1, DELAY_S),), "gloo", 120)


def test_no_operation_is_built_inside_a_timed_window(nccl_like: tuple[list[dict[str, Any]], int]) -> None:
    assert nccl_like[1] == 0


def test_one_work_per_batch_is_measured_and_checked(nccl_like: tuple[list[dict[str, Any]], int]) -> None:
    rows = nccl_like[0]
    assert sorted((r["test"], r["src"], r["dst"]) for r in rows) == sorted(
        (test, a, b) for test in TESTS for a, b in ((0, 1), (1, 0))
    )
    assert all(row["wrong"] == 0 and row["time_us"] > 0 for row in rows)


def test_on_nccl_a_delayed_sender_slows_both_ends_of_its_bidir_window(
    nccl_like: tuple[list[dict[str, Any]], int],
) -> None:
    """One group per window: rank 0's sleep holds its receives too (module docstring), so both bidir rows
    are slow; the one-way rows still name the direction."""
    times = _times(nccl_like[0])
    slow = {key for key, time_us in times.items() if time_us >= DELAY_S * 1e6 / 2}
    assert slow == {("latency", 0, 1), ("bandwidth", 0, 1), ("bidir", 0, 1), ("bidir", 1, 0)}, times

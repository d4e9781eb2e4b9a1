"""Clock offsets onto rank 0's clock: ping-pongs on the job's own communicator (never a lone send/recv, which
NCCL would give a communicator of its own per pair), and an offset planted in one rank's clock found."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from commbench.run import clocks
from commbench.run.clocks import ClockOffsets, estimate_offsets
from commbench.run.dist import launch

PLANTED_S = 5.0  # far beyond any round trip on a busy host


class NcclCommunicators:
    """Which NCCL communicators the point-to-point calls of this process would use.

    The contract (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, ``ProcessGroupNCCL::pointToPoint``):
    ``bool batchP2P = ncclActiveGroupCounter_ > 0; if (batchP2P) { key = getKeyFromDevice(device); ... }
    else { // For single P2P, preserve the old two-rank behavior  key = getKeySendRecv(rank_, peer); ...}``,
    and ``getNCCLComm(key, ...)`` creates a communicator for a key it has not seen (``initNCCLComm``): a
    send or recv outside ``batch_isend_irecv`` (which calls them inside ``_coalescing_manager``, an NCCL
    group) gets a two-rank communicator keyed "low:high", made lazily by both ranks. On gloo every call goes
    through the one gloo context, so this records what NCCL would have done: the wrapped functions run the
    real gloo ones."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.batched = 0  # inside batch_isend_irecv
        self.keys: set[str] = set()

    def lone_key(self, peer: int) -> str:
        low, high = sorted((self.rank, peer))
        return f"{low}:{high}"

    def install(self) -> None:
        real_batch = c10d.batch_isend_irecv

        def batch(ops: list[Any]) -> list[Any]:
            self.batched += 1
            try:
                return real_batch(ops)
            finally:
                self.batched -= 1

        dist.batch_isend_irecv = c10d.batch_isend_irecv = batch
        for name in ("send", "recv", "isend", "irecv"):
            real = getattr(c10d, name)

            def wrapped(tensor: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
                peer = kwargs.get("dst", kwargs.get("src", kwargs.get("group_dst", kwargs.get("group_src"))))
                if peer is None and args:
                    peer = args[0]
                if not self.batched:
                    self.keys.add(self.lone_key(int(peer)))
                return _real(tensor, *args, **kwargs)

            # P2POp checks its op against the module's own isend / irecv: both names get the wrapper.
            setattr(dist, name, wrapped)
            setattr(c10d, name, wrapped)


def _offsets_and_communicators(comm: Any, planted_rank: int) -> tuple[ClockOffsets, set[str]]:
    recorder = NcclCommunicators(comm.rank)
    recorder.install()
    if comm.rank == planted_rank:  # this rank's clock runs PLANTED_S ahead of everyone else's
        real = time.perf_counter
        clocks.time = SimpleNamespace(perf_counter=lambda: real() + PLANTED_S)  # type: ignore[assignment]
    offsets = estimate_offsets(comm, rounds=4)
    return offsets, recorder.keys


@pytest.fixture(scope="module")
def planted() -> list[tuple[ClockOffsets, set[str]]]:
    return launch(3, _gathered, (2,), "gloo", 60)


def _gathered(comm: Any, planted_rank: int) -> list[tuple[ClockOffsets, set[str]]]:
    mine = _offsets_and_communicators(comm, planted_rank)
    return comm.all_gather_object(mine)


def test_no_pair_gets_a_communicator_of_its_own(planted: list[tuple[ClockOffsets, set[str]]]) -> None:
    """Every ping-pong message is batched: NCCL would use the job's communicator, never a pair's."""
    assert [keys for _, keys in planted] == [set(), set(), set()]


def test_a_planted_clock_offset_is_found_within_the_uncertainty(
    planted: list[tuple[ClockOffsets, set[str]]],
) -> None:
    offsets = planted[0][0]
    assert all(other == offsets for other, _ in planted)  # the same result on every rank
    assert offsets.offset_s[0] == 0.0 and offsets.uncertainty_s[0] == 0.0
    assert 0 < offsets.uncertainty_s[2] < 1.0
    assert abs(offsets.offset_s[2] - PLANTED_S) <= offsets.uncertainty_s[2] + 0.002
    # Rank 1 shares rank 0's CLOCK_MONOTONIC: 0 up to half a round trip (plus scheduling slack).
    assert abs(offsets.offset_s[1]) <= offsets.uncertainty_s[1] + 0.002
    assert offsets.to_reference(2, 10.0 + PLANTED_S) == pytest.approx(10.0, abs=1.0)

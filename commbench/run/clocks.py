"""Every rank's clock mapped onto rank 0's (the profiler's one timeline): offsets estimated by ping-pongs.

Each rank r > 0 in turn exchanges ``rounds`` ping-pongs with rank 0 over the process group: rank 0 reads
its clock (t0), sends; rank r reads its clock (tr) on receipt and answers; rank 0 reads its clock (t1) on
the answer. Then tr - (t0 + t1) / 2 is rank r's clock minus rank 0's, uncertain by at most (t1 - t0) / 2
(the reply may have been read anywhere in the round trip); the round with the shortest round trip is kept
(NTP's rule). Clocks are ``time.perf_counter`` (CLOCK_MONOTONIC on Linux: every process of a host reads the
same clock, so ranks of one host get offsets within their uncertainty of 0). On GPUs the small messages go
through NCCL with a synchronize on each side, which the uncertainty includes.

Every message is a ``batch_isend_irecv`` of one operation on the job's own communicator, never a bare
``dist.send``/``dist.recv``: ProcessGroupNCCL (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp,
``pointToPoint``) keys a lone send/recv by the rank pair and lazily creates a two-rank NCCL communicator for
it, which here would be one per rank, all made one after the other on rank 0; inside a batch (an active NCCL
group, ``ncclActiveGroupCounter_ > 0``) it takes the device's communicator, the one the collectives use. The
ranks not in the current exchange wait in the final gather; the whole estimate takes world x ``rounds``
round trips.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from commbench.run.comm import synchronize_device

DEFAULT_ROUNDS = 8


@dataclass(frozen=True)
class ClockOffsets:
    """``offset_s[r]``: rank r's clock minus rank 0's (seconds); ``uncertainty_s[r]``: half the shortest
    round trip it was measured with (0 for rank 0)."""

    offset_s: tuple[float, ...]
    uncertainty_s: tuple[float, ...]

    def to_reference(self, rank: int, host_seconds: float | np.ndarray) -> float | np.ndarray:
        """``host_seconds`` read on ``rank``'s clock, as rank 0's clock reads it."""
        return host_seconds - self.offset_s[rank]

    @property
    def max_uncertainty_us(self) -> float:
        return 1e6 * max(self.uncertainty_s, default=0.0)


def _message(op: Any, tensor: torch.Tensor, peer: int, group: Any) -> None:
    """Send or receive ``tensor`` (``op``: ``dist.isend`` or ``dist.irecv``) over the group's own communicator
    (a batch of one operation: module docstring) and wait for it."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)]):
        work.wait()


def estimate_offsets(comm: Any, rounds: int = DEFAULT_ROUNDS) -> ClockOffsets:
    """Collective: every rank's offset to rank 0 (module docstring); the same result on every rank."""
    world = comm.world_size
    if not dist.is_initialized():  # in-process thread ranks (mock, sim): one process, one clock
        return ClockOffsets((0.0,) * world, (0.0,) * world)
    device = comm.device
    message = torch.zeros(1, dtype=torch.float64, device=device)
    best: dict[int, tuple[float, float]] = {0: (0.0, 0.0)}  # rank -> (round trip, offset), on rank 0
    with comm.guard("clock offsets"):
        for peer in range(1, world):
            if comm.rank not in (0, peer):
                continue
            for _ in range(rounds):
                if comm.rank == 0:
                    synchronize_device(device)
                    sent_at = time.perf_counter()
                    _message(dist.isend, message, peer, comm.group)
                    _message(dist.irecv, message, peer, comm.group)
                    synchronize_device(device)
                    back_at = time.perf_counter()
                    peer_clock = float(message.item())
                    trip = back_at - sent_at
                    if peer not in best or trip < best[peer][0]:
                        best[peer] = (trip, peer_clock - (sent_at + back_at) / 2)
                else:
                    _message(dist.irecv, message, 0, comm.group)
                    synchronize_device(device)
                    message.fill_(time.perf_counter())
                    _message(dist.isend, message, 0, comm.group)
            comm.heartbeat()
    found = comm.all_gather_object(best if comm.rank == 0 else None)[0]
    offsets = tuple(float(found[rank][1]) for rank in range(world))
    uncertainty = tuple(float(found[rank][0]) / 2 for rank in range(world))
    return ClockOffsets(offsets, uncertainty)

"""counts=device's layout on the device: the fixed put and wait tables of every phase, rewritten from each
exchanged count matrix with torch operations of fixed shape and no host read (``protocol.device_tables``).

The NVSHMEM backend's kernels read these tables (``NvshmemBackend`` with ``--backend-option counts=device``);
this module has no NVSHMEM or Triton in it, so its arithmetic runs and is tested on CPU tensors. Tables:

* counts: the protocol's static all-gather of count rows (``protocol.count_layout``), one ADD signal per
  source and call;
* dispatch, combine: ``world x chunks`` put items (rows -1 past a segment's chunks: the put kernel skips
  them) and one wait per source, ``(word, running total, increment)``: ``advance`` adds each source's
  increment to its total before the phase's wait kernel, which waits until the word reaches the total
  (called with no epoch term). The totals live on the device, so a CUDA graph's replays keep advancing
  them (a host-side total would be frozen at the capture's values).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from commbench.backends.shmem import protocol as proto


def graph_refusal(settings: Mapping[str, Any], calls: int) -> str:
    """Why the NVSHMEM backend's calls with these (checked) ``settings`` cannot be captured ``calls`` at a
    time into a CUDA graph ("" when they can). A graph replays the kernels with the arguments of its
    capture: only counts=device keeps every per-call value on the device (with counts=host the counts are
    read on the host and each wait kernel gets the host's expected totals); vdev2d orders its output on the
    host; and a graph's calls alternate the two sides of each receive buffer (the side is the host's
    parity, captured), so only an even N replays into the sides it captured and keeps alternating across
    replays (the last replay's output is then the captured one)."""
    if settings["variant"] != "put":
        return "variant=vdev2d orders its output on the host each call; use variant=put"
    if settings["counts"] != "device":
        return (
            "counts=host reads the exchanged counts on the host each call; add --backend-option counts=device"
        )
    if calls % 2:
        return f"its calls alternate two receive buffers, so a graph needs an even N; use {calls + 1}"
    return ""


Table = tuple[torch.Tensor, torch.Tensor, int]  # (items [n, 5], waits [sources, 3], epoch base: 0 here)


class DeviceLayout:
    """The tables of one rank's phases on ``device`` (module docstring); ``signals`` = (dispatch, combine)."""

    def __init__(
        self,
        world: int,
        rank: int,
        slots: int,
        capacity: proto.Capacity,
        signals: tuple[proto.SignalConfig, proto.SignalConfig],
        device: torch.device,
    ) -> None:
        if any(signal.op != "add" for signal in signals):
            raise ValueError("counts on the device keep one running total per source: ADD signals only")
        self.world, self.rank, self.slots, self.signals = world, rank, slots, signals
        self.counts = proto.count_layout(world, rank)
        count_waits = np.stack(
            [self.counts.wait_word, np.zeros_like(self.counts.wait_word), self.counts.wait_increment], axis=1
        )
        self.tables: dict[str, Table] = {
            "counts": (
                torch.from_numpy(self.counts.items_table()).to(device),
                torch.from_numpy(count_waits).to(device),
                0,
            )
        }
        self.chunks = {
            phase: proto.max_chunks(signal, capacity)
            for phase, signal in zip(proto.PHASES, signals, strict=True)
        }
        words = torch.arange(world, dtype=torch.int64, device=device)
        for phase in proto.PHASES:
            items = torch.empty((world * self.chunks[phase], 5), dtype=torch.int64, device=device)
            waits = torch.stack([words, torch.zeros_like(words), torch.zeros_like(words)], dim=1)
            self.tables[phase] = (items, waits, 0)
        self.recv_counts = torch.empty((world, slots), dtype=torch.int64, device=device)

    def lay_out(self, rows: torch.Tensor) -> None:
        """The dispatch and combine tables from ``rows`` [src, dst] (int64 on the tables' device): items and
        each source's signal increment copied into the tables the kernels read (fixed addresses)."""
        for phase, phase_rows, signals in (
            ("dispatch", rows, self.signals[0]),
            ("combine", rows.t().contiguous(), self.signals[1]),
        ):
            items, increments = proto.device_tables(phase_rows, self.rank, signals, self.chunks[phase])
            table, waits, _base = self.tables[phase]
            table.copy_(items)
            waits[:, 2].copy_(increments)

    def receive(self, slots: torch.Tensor) -> torch.Tensor:
        """What the counts phase delivered, ``slots`` uint8 [src, world x slots x 8] (this call's side of
        counts_recv): the phases laid out from it; returns recv_counts [src, slots] in a buffer of its own
        (the count slots are rewritten two exchanges later)."""
        received = slots.view(torch.int64).view(self.world, self.world, self.slots)
        self.lay_out(received.sum(dim=2))
        self.recv_counts.copy_(received[:, self.rank, :])
        return self.recv_counts

    def advance(self, phase: str) -> None:
        """One call of ``phase``: every source's running total grows by its increment (on the device)."""
        waits = self.tables[phase][1]
        waits[:, 1].add_(waits[:, 2])

"""Transfer faults injected below commbench inside a rank process (tests of --check only, never imported by
commbench): a transfer that moves nothing after its first call ("stale"), one that skips one iteration
("skip"), and one byte flipped in one iteration ("flip").

gloo (and nccl) patch ``torch.distributed.all_to_all_single``; shmem-emu patches ``SharedHeap.put``, the
payload half of a put-with-signal (its signal still arrives, as when a put is lost). "stale" and "skip" hit
every rank alike (a collective skipped on one rank only would hang its peers); "flip" hits one rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

FAULTS = ("stale", "skip", "flip")


def flip_one_byte(buffer: torch.Tensor | np.ndarray) -> None:
    """Change one byte in the middle of ``buffer`` (an odd index: the high byte of a bf16 element)."""
    raw = buffer.view(torch.uint8).reshape(-1) if isinstance(buffer, torch.Tensor) else buffer.reshape(-1)
    raw[(raw.shape[0] // 2) | 1] ^= 0x40


@contextlib.contextmanager
def gloo_fault(
    fault: str, target: int, dtype: torch.dtype | None = None, rank: int = 1
) -> Iterator[dict[str, int]]:
    """Patch ``all_to_all_single`` in this process while the block runs. Counted calls: those whose output
    has ``dtype`` (None: all). stale: every counted call after the first does nothing; skip: counted call
    ``target`` (from 0) does nothing; flip: after counted call ``target``, one byte of the output changes on
    ``rank``. Yields the state (``calls``: counted calls so far)."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    real = dist.all_to_all_single
    state = {"calls": 0}

    def patched(output: torch.Tensor, input: torch.Tensor, *args, **kwargs):  # noqa: A002 - torch's name
        if dtype is not None and output.dtype != dtype:
            return real(output, input, *args, **kwargs)
        index = state["calls"]
        state["calls"] += 1
        if (fault == "stale" and index > 0) or (fault == "skip" and index == target):
            return None
        result = real(output, input, *args, **kwargs)
        if fault == "flip" and index == target and dist.get_rank() == rank and output.numel():
            flip_one_byte(output)
        return result

    dist.all_to_all_single = patched
    try:
        yield state
    finally:
        dist.all_to_all_single = real


@contextlib.contextmanager
def emu_fault(fault: str, target: int, puts_per_iteration: int, rank: int = 0) -> Iterator[dict[str, int]]:
    """Patch ``SharedHeap.put`` of shmem-emu in this process while the block runs. Iteration of a put:
    calls so far // ``puts_per_iteration`` (puts with rows, per rank, per iteration). stale: every put after
    the first is lost; skip: the puts of iteration ``target`` (from 0, warm-up included) are lost; flip:
    after the first put of iteration ``target`` on ``rank``, one byte of what it wrote changes."""
    from commbench.backends.shmem.emu import SharedHeap

    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    real = SharedHeap.put
    state = {"calls": 0}

    def patched(self, pe, region, side, first_row, rows):  # noqa: ANN001 - SharedHeap.put's signature
        index = state["calls"]
        state["calls"] += 1
        iteration = index // puts_per_iteration
        if (fault == "stale" and index > 0) or (fault == "skip" and iteration == target):
            return
        real(self, pe, region, side, first_row, rows)
        first_of_target = iteration == target and index % puts_per_iteration == 0
        if fault == "flip" and first_of_target and dist.get_rank() == rank:
            flip_one_byte(self.view(pe, region)[side, first_row : first_row + rows.shape[0]])

    SharedHeap.put = patched
    try:
        yield state
    finally:
        SharedHeap.put = real


def install(spec: str) -> None:
    """For a rank process started by a test: apply ``"<backend>:<fault>:<target>[:<per-iteration>]"`` for
    the rest of the process (gloo: payload calls, uint8; shmem-emu: puts, ``per-iteration`` per
    iteration)."""
    backend, fault, target, *rest = spec.split(":")
    if backend == "gloo":
        patch = gloo_fault(fault, int(target), torch.uint8)
    elif backend == "shmem-emu":
        patch = emu_fault(fault, int(target), int(rest[0]) if rest else 1)
    else:
        raise ValueError(f"no fault injection for backend {backend!r}")
    patch.__enter__()
    _INSTALLED.append(patch)  # held: a collected context manager would undo the patch


_INSTALLED: list[contextlib.AbstractContextManager] = []

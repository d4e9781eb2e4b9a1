"""How the fake dispatchers move data: rows of any dtype to chosen ranks through gloo all_to_all_single."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _as_bytes(tensor: torch.Tensor, count: int) -> torch.Tensor:
    return tensor.contiguous().reshape(count, math.prod(tensor.shape[1:])).view(torch.uint8)


def send_to_ranks(group: object, dst: torch.Tensor, *payloads: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Send row i of every payload to rank ``dst[i]``; returns (source rank of each received row, each
    payload's received rows), sources ascending, each source's rows in the order it listed them."""
    world = dist.get_world_size(group)
    order = torch.argsort(dst, stable=True)
    counts = torch.bincount(dst, minlength=world).to(torch.int64)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    send_splits, recv_splits = counts.tolist(), received_counts.tolist()
    total = int(sum(recv_splits))
    results = [torch.repeat_interleave(torch.arange(world), received_counts, output_size=total)]
    for payload in payloads:
        rows = _as_bytes(payload[order], int(dst.numel()))
        out = torch.empty((total, rows.shape[1]), dtype=torch.uint8)
        dist.all_to_all_single(out, rows, recv_splits, send_splits, group=group)
        shape = (total, *payload.shape[1:])
        results.append(out.view(payload.dtype).reshape(shape))
    return tuple(results)

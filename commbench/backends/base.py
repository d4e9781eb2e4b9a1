"""The backend interface: the few functions a backend plugs into the shared harness.

The harness owns timing, verification and result rows; a backend only moves data. Each call below is one
phase, run many times inside the timed region, so it must not allocate large buffers or loop over tokens
in Python.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from commbench.traffic.plan import RankPlan


def grown_buffer(
    buffer: torch.Tensor | None, rows: int, shape: tuple[int, ...], dtype: torch.dtype, device: Any
) -> torch.Tensor:
    """``buffer`` when it holds ``rows`` rows of ``shape`` and ``dtype``, else a new one of exactly ``rows``.

    Buffers grow on the first (warm-up) call and are reused after, so timed iterations do not allocate."""
    if buffer is None or buffer.shape[0] < rows or tuple(buffer.shape[1:]) != shape or buffer.dtype != dtype:
        buffer = torch.empty((rows, *shape), dtype=dtype, device=device)
    return buffer


class CombineReduction:
    """Combine's reduction into token order, the same arithmetic for every backend:
    out[t] = sum over rows r of token t of weight[r] * rows[r], product in float32, then ``index_add_``.

    ``rows`` are the combine rows back in this rank's send order. Returns float32 [num_tokens, hidden], a view
    of a buffer reused by the next call."""

    def __init__(self) -> None:
        self._weighted: torch.Tensor | None = None
        self._combined: torch.Tensor | None = None

    def __call__(
        self, rows: torch.Tensor, token_index: torch.Tensor, weight: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        count, hidden = int(rows.shape[0]), int(rows.shape[1])
        self._weighted = grown_buffer(self._weighted, count, (hidden,), torch.float32, rows.device)
        self._combined = grown_buffer(self._combined, num_tokens, (hidden,), torch.float32, rows.device)
        weighted = self._weighted[:count]
        if rows.device.type == "cuda":  # one fused kernel
            torch.mul(rows, weight.unsqueeze(1), out=weighted)
        else:  # the CPU kernel of a mixed bf16 x fp32 multiply is ~5x slower than convert, then multiply
            weighted.copy_(rows).mul_(weight.unsqueeze(1))
        combined = self._combined[:num_tokens].zero_()
        combined.index_add_(0, token_index, weighted)
        return combined


class Backend(abc.ABC):
    name: ClassVar[str] = ""
    # True where timings are not measured on real hardware (mock, sim, shmem-emu): reports label them.
    emulated: ClassVar[bool] = False

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        self.comm = comm  # commbench.run.dist.Comm
        self.options = dict(options or {})

    @property
    def label(self) -> str:
        """What the report's ``backend`` column shows (e.g. "nccl", "gloo", "shmem-emu (CPU emulator)")."""
        return self.name

    def knobs(self) -> dict[str, Any]:
        """Performance options that land in every result row (e.g. num_blocks, chunk_bytes)."""
        return {}

    def setup(self, plan: RankPlan) -> None:  # noqa: B027 - optional hook
        """Allocate buffers for ``plan`` (untimed)."""

    def setup_peers(self, plans: Sequence[RankPlan]) -> None:  # noqa: B027 - optional hook
        """Every rank's plan (``plans[src]``), given before ``setup`` (untimed). Only backends that model the
        traffic instead of moving it need it; the harness builds these plans anyway to verify."""

    def modelled_seconds(self) -> float | None:
        """Emulated timing: the modelled duration of the last exchange_counts + dispatch (or combine) calls.
        None (the default) = the harness measures the phase with its timer."""
        return None

    @abc.abstractmethod
    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """All-to-all of the [world, slots] count matrix; returns recv_counts [world, slots], row = source."""

    @abc.abstractmethod
    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        """Send ``tokens[plan.send_token_index]`` (grouped by destination) and return the received rows,
        uint8 [sum(recv_counts), plan.dispatch_row_bytes], in source-rank order, each source's rows in the
        order that source sent them."""

    @abc.abstractmethod
    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        """Send ``expert_out`` (one row per received dispatch row, same order) back to the token owners and
        reduce into token order: out[t] = sum over send rows r of token t of plan.combine_weight[r] * row(r).
        Returns float32 [plan.num_tokens, hidden]."""

    def synchronize(self) -> None:
        """Wait for outstanding device work (the harness calls it before reading a host clock)."""
        if torch.cuda.is_available() and self.comm.device.type == "cuda":
            torch.cuda.synchronize(self.comm.device)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release buffers and communicators."""

"""Implementation helpers shared by the backends: buffers reused across calls, the one combine reduction.

The interface a backend implements (``Backend``) belongs to the run stage: ``commbench.run.interface``.
"""

from __future__ import annotations

from typing import Any

import torch


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

"""The helpers every backend shares."""

from __future__ import annotations

import torch

from commbench.backends.base import CombineReduction, grown_buffer


def test_weighted_reduce_matches_a_loop() -> None:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(-64, 64, (9, 6), generator=generator).to(torch.bfloat16) / 64
    token = torch.tensor([0, 2, 2, 1, 0, 4, 2, 1, 1])
    weight = torch.rand(9, generator=generator)
    out = CombineReduction()(rows, token, weight, 5)
    reference = torch.zeros(5, 6, dtype=torch.float64)
    for r in range(9):
        reference[token[r]] += weight[r].double() * rows[r].double()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference, rtol=1e-6, atol=1e-6)
    assert (out[3] == 0).all()


def test_grown_buffer_is_reused_when_it_fits_and_replaced_when_not() -> None:
    first = grown_buffer(None, 8, (4,), torch.float32, "cpu")
    assert grown_buffer(first, 5, (4,), torch.float32, "cpu") is first
    assert grown_buffer(first, 9, (4,), torch.float32, "cpu").shape == (9, 4)
    assert grown_buffer(first, 5, (3,), torch.float32, "cpu").shape == (5, 3)
    assert grown_buffer(first, 5, (4,), torch.bfloat16, "cpu").dtype == torch.bfloat16

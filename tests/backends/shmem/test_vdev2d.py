"""The vdev2d reference variant: torch's tile limits refused in one line, its buffers in one order."""

from __future__ import annotations

import pytest
import torch

from commbench.backends.shmem import protocol as proto
from commbench.backends.shmem.vdev2d import Vdev2dExchange, check_vdev2d
from commbench.errors import UsageError


@pytest.mark.parametrize(("world", "slots"), [(1, 17), (17, 1), (32, 32)])
def test_beyond_torchs_tiles_is_one_line(world: int, slots: int) -> None:
    import torch.distributed._symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem

    with pytest.raises(UsageError, match="at most 16 experts per rank and 16 ranks") as info:
        check_vdev2d(world, slots)
    assert "\n" not in str(info.value) and f"this run has {slots} and {world}" in str(info.value)


def test_symmetric_buffers_come_in_the_same_order_on_every_rank() -> None:
    import torch.distributed._symmetric_memory  # noqa: F401

    from commbench.inputs.models import ModelConfig
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.plan import plan_rank
    from commbench.traffic.routing import RoutingConfig, route_rank

    model = ModelConfig(name="small", hidden=32, num_experts=8, topk=3, dispatch_dtype="fp8", scale_block=16)
    cfg = RoutingConfig(model=model, skew=parse_skew("uniform"), world_size=1, tokens_per_rank=16, seed=0)
    plan = plan_rank(route_rank(cfg, 0), model, 1, "selection")
    capacity = proto.buffer_capacity(plan.send_counts.numpy()[None])
    shapes: list[tuple] = []

    def symmetric(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        shapes.append((shape, dtype))  # symmetric allocation is collective: order and sizes must agree
        return torch.zeros(*(max(1, n) for n in shape), dtype=dtype)

    exchange = Vdev2dExchange(symmetric, plan, capacity, 1, torch.device("cpu"), "0")
    splits = 8  # world x experts per rank
    disp, comb = plan.dispatch_row_bytes, plan.combine_row_bytes
    assert shapes == [
        ((capacity.send_rows * disp,), torch.uint8),
        (((capacity.recv_rows + 8) * disp,), torch.uint8),
        ((splits,), torch.int64),
        ((2, splits), torch.int64),
        ((capacity.recv_rows * comb,), torch.uint8),
        ((capacity.send_rows * comb,), torch.uint8),
        ((2, splits), torch.int64),
        ((2, splits), torch.int64),
    ]
    assert len(exchange.receive_buffers()) == 3

"""Where fake ranks stand: hosts and NVLink fabric cliques for gloo ranks that all run on this one host, so
the adapters' layout checks and the fakes' handle-opening rules (CUDA IPC on one host, fabric handles in one
clique) meet the machines they stand for (an NVL72's 4-GPU trays, 8-GPU servers without a clique)."""

from __future__ import annotations

import torch.distributed as dist

from commbench.backends.adapters import common
from commbench.hardware.probes import RankPlace

PLACES: list[RankPlace] = []  # every rank's place, by rank; empty = the real one (this host, no clique)


def machines(world: int, per_host: int, clique: bool) -> list[RankPlace]:
    """``world`` ranks on hosts of ``per_host`` GPUs, all in one GPU fabric clique (an NVL72 rack's trays)
    or each host its own NVLink domain (no clique reported)."""
    return [
        RankPlace(
            host=f"tray{rank // per_host}",
            fabric_cluster_uuid="rack-0" if clique else "",
            fabric_clique_id=1 if clique else -1,
            device=rank % per_host,
        )
        for rank in range(world)
    ]


def use(places: list[RankPlace]) -> None:
    """Make this rank process (and the adapters' ``rank_layout``) see ``places``."""
    PLACES[:] = places
    common.local_place = _place if places else _REAL


def place(rank: int) -> RankPlace | None:
    return PLACES[rank] if PLACES else None


def _place(device_index: int | None = None) -> RankPlace:
    return PLACES[dist.get_rank()]


_REAL = common.local_place

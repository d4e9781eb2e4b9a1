"""Where each rank runs: its host and its NVLink domain, from the ranks' discovered places or from overrides.

A rank's NVLink domain is, on a multi-node NVLink system (GB200/GB300 NVL72), the GPU fabric's cluster UUID
and clique id reported by NVML (``commbench.hardware.probes.local_place``); on any other machine it is the
host. For CPU runs and what-ifs ``ranks_per_domain`` (and ``ranks_per_host``) override it: ranks are placed
contiguously, so a 4-process gloo run with ``ranks_per_domain=2`` stands for 2 domains of 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from commbench.errors import UsageError
from commbench.hardware.probes import RankPlace


@dataclass(frozen=True)
class Layout:
    """Hosts and NVLink domains of ``world_size`` ranks (contiguous placement for overrides)."""

    domain_of_rank: np.ndarray  # int64 [world]
    host_of_rank: np.ndarray  # int64 [world]
    source: str  # "override", "discovered" or "default" (all ranks in one host and domain)

    @property
    def world_size(self) -> int:
        return int(self.domain_of_rank.size)

    @property
    def num_domains(self) -> int:
        return int(self.domain_of_rank.max()) + 1 if self.domain_of_rank.size else 0

    def describe(self) -> str:
        sizes = np.bincount(self.domain_of_rank)
        hosts = int(self.host_of_rank.max()) + 1 if self.host_of_rank.size else 0
        values, counts = np.unique(sizes, return_counts=True)
        order = np.argsort(-counts, kind="stable")
        size_text = " + ".join(f"{int(counts[i])} x {int(values[i])}" for i in order)
        return (
            f"{self.world_size} ranks in NVLink domains of {size_text} ranks, {hosts} host(s) ({self.source})"
        )


def _contiguous(world_size: int, per_group: int, what: str) -> np.ndarray:
    if per_group <= 0:
        raise UsageError(f"{what} must be a positive integer, got {per_group}")
    return np.arange(world_size, dtype=np.int64) // per_group


def _dense_ids(keys: Sequence[str]) -> np.ndarray:
    """Integer ids in order of first appearance (rank 0's domain is domain 0)."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(key, len(ids)) for key in keys], dtype=np.int64)


def _places(discovered: Sequence[RankPlace | dict[str, Any]]) -> list[RankPlace]:
    return [p if isinstance(p, RankPlace) else RankPlace(**p) for p in discovered]


def domain_of_rank(
    world_size: int,
    ranks_per_domain: int | None = None,
    discovered: Sequence[RankPlace | dict[str, Any]] | None = None,
) -> np.ndarray:
    """NVLink domain id of every rank: override, else discovered places, else one domain for all ranks."""
    return build_layout(world_size, ranks_per_domain=ranks_per_domain, discovered=discovered).domain_of_rank


def host_of_rank(
    world_size: int,
    ranks_per_host: int | None = None,
    discovered: Sequence[RankPlace | dict[str, Any]] | None = None,
) -> np.ndarray:
    """Host id of every rank: override, else discovered host names, else one host for all ranks."""
    return build_layout(world_size, ranks_per_host=ranks_per_host, discovered=discovered).host_of_rank


def build_layout(
    world_size: int,
    ranks_per_domain: int | None = None,
    ranks_per_host: int | None = None,
    discovered: Sequence[RankPlace | dict[str, Any]] | None = None,
) -> Layout:
    """Hosts and domains of every rank.

    Overrides win over discovery: ``ranks_per_domain`` alone makes each domain one host (as on HGX servers);
    ``ranks_per_host`` alone keeps discovered (or a single) domain; both must nest (a host inside a domain).
    """
    if world_size <= 0:
        raise UsageError(f"world size must be positive, got {world_size}")
    places = _places(discovered) if discovered else None
    if places is not None and len(places) != world_size:
        raise UsageError(f"got {len(places)} rank places for world size {world_size}; gather one per rank")
    if ranks_per_domain is not None or ranks_per_host is not None:
        if ranks_per_domain is not None and ranks_per_host is not None and ranks_per_domain % ranks_per_host:
            raise UsageError(
                f"--ranks-per-domain {ranks_per_domain} is not a multiple of --ranks-per-host "
                f"{ranks_per_host}; a host must sit inside one NVLink domain"
            )
        if ranks_per_domain is not None:
            domains = _contiguous(world_size, ranks_per_domain, "--ranks-per-domain")
        elif places is not None:
            domains = _dense_ids([p.domain_key for p in places])
        else:
            domains = np.zeros(world_size, dtype=np.int64)
        per_host = ranks_per_host if ranks_per_host is not None else ranks_per_domain
        hosts = _contiguous(world_size, int(per_host), "--ranks-per-host")
        return Layout(domains, hosts, "override")
    if places is not None:
        hosts = _dense_ids([p.host for p in places])
        domains = _dense_ids([p.domain_key for p in places])
        return Layout(domains, hosts, "discovered")
    zeros = np.zeros(world_size, dtype=np.int64)
    return Layout(zeros, zeros.copy(), "default")


# ----------------------------------------------------------------------------------------------------------
# Discovery (NVML, sysfs, library versions, environment). Each probe returns data or a "why not" string.

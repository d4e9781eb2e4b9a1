"""Where each rank runs: its host and its NVLink domain, from the ranks' discovered places or from overrides.

A rank's NVLink domain is, on a multi-node NVLink system (GB200/GB300 NVL72), the GPU fabric's cluster UUID
and clique id reported by NVML (``commbench.hardware.probes.local_place``); on any other machine it is the
host. A host is a hostname, told apart by the launcher's node rank where ranks of different nodes share one
(two torchrun agents on one machine standing for two nodes: "myhost (node 1)"). For CPU runs and what-ifs
``ranks_per_domain`` (and ``ranks_per_host``) override it: ranks are placed contiguously, so a 4-process
gloo run with ``ranks_per_domain=2`` stands for 2 domains of 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from commbench.errors import UsageError
from commbench.hardware.probes import RankPlace

# How a run's layout was found (``Layout.method``), as its description says it.
FOUND_BY = {
    "override": "override (--ranks-per-domain / --ranks-per-host)",
    "nvml-clique": "NVML GPU fabric clique",
    "host": "host (no NVLink fabric clique reported: one domain per host)",
}


@dataclass(frozen=True)
class Layout:
    """Hosts and NVLink domains of ``world_size`` ranks (contiguous placement for overrides), and the places
    they were found from (every rank's ``RankPlace`` in a run; empty for what-ifs built without ranks)."""

    domain_of_rank: np.ndarray  # int64 [world]
    host_of_rank: np.ndarray  # int64 [world]
    source: str  # "override", "discovered" or "default" (all ranks in one host and domain)
    places: tuple[RankPlace, ...] = ()

    @property
    def world_size(self) -> int:
        return int(self.domain_of_rank.size)

    @property
    def num_domains(self) -> int:
        return int(self.domain_of_rank.max()) + 1 if self.domain_of_rank.size else 0

    @property
    def num_hosts(self) -> int:
        return int(self.host_of_rank.max()) + 1 if self.host_of_rank.size else 0

    @property
    def domain_sizes(self) -> np.ndarray:
        """Ranks in each NVLink domain, int64 [num_domains]."""
        return np.bincount(self.domain_of_rank)

    @property
    def method(self) -> str:
        """How the domains were found (a key of ``FOUND_BY``): "override", "nvml-clique" when a rank reported
        an NVLink fabric clique, else "host" (one domain per host, also the default layout)."""
        if self.source == "override":
            return "override"
        return "nvml-clique" if any(p.fabric_cluster_uuid for p in self.places) else "host"

    def describe(self) -> str:
        """One line: domain sizes, hosts, and how they were found (a run's gathered layout) or the source."""
        values, counts = np.unique(self.domain_sizes, return_counts=True)
        order = np.argsort(-counts, kind="stable")
        size_text = " + ".join(f"{int(counts[i])} x {int(values[i])}" for i in order)
        # CPU ranks (every gathered place without a GPU) have no NVLink: their domains are emulated.
        cpu = bool(self.places) and self.method != "nvml-clique" and all(p.device < 0 for p in self.places)
        kind = "emulated NVLink domains" if cpu else "NVLink domains"
        text = f"{self.world_size} ranks in {kind} of {size_text} ranks, {self.num_hosts} host(s)"
        if not self.places:  # not gathered from running ranks (a what-if): say where it came from
            return f"{text} ({self.source})"
        return f"{text}; found by {FOUND_BY[self.method]}"

    def to_meta(self) -> dict[str, Any]:
        """What a report's meta.json records about the layout."""
        return {
            "method": self.method,
            "description": self.describe(),
            "num_domains": self.num_domains,
            "ranks_per_domain": sorted({int(v) for v in self.domain_sizes}),
            "num_hosts": self.num_hosts,
            "domain_of_rank": self.domain_of_rank.tolist(),
            "host_of_rank": self.host_of_rank.tolist(),
            "places": [p.to_dict() for p in self.places],
        }


def _contiguous(world_size: int, per_group: int, what: str, partial_last: bool = False) -> np.ndarray:
    if per_group <= 0:
        raise UsageError(f"{what} must be a positive integer, got {per_group}")
    if world_size > per_group and world_size % per_group and not partial_last:
        # Groups of unequal size (3 + 1 at world 4) are no machine anyone builds: refuse, do not guess. A
        # world inside one group (2 ranks of an 8-GPU domain) is a part of one machine: that is fine.
        fits = [str(n) for n in range(1, world_size + 1) if world_size % n == 0]
        raise UsageError(
            f"{what} {per_group} does not divide the {world_size} ranks; use one of {', '.join(fits[:12])}"
        )
    return np.arange(world_size, dtype=np.int64) // per_group


def _dense_ids(keys: Sequence[str]) -> np.ndarray:
    """Integer ids in order of first appearance (rank 0's domain is domain 0)."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(key, len(ids)) for key in keys], dtype=np.int64)


def _places(discovered: Sequence[RankPlace | dict[str, Any]]) -> list[RankPlace]:
    """RankPlace objects (a meta.json's dicts too, older ones without ``node``), with hostnames that ranks
    of several launcher nodes share made distinct and readable: "myhost (node 1)". A real multi-node run (a
    hostname per node) and a single-node one keep their hostnames, so their layout does not change."""
    places = [p if isinstance(p, RankPlace) else RankPlace(**p) for p in discovered]
    nodes_of_host: dict[str, set[int]] = {}
    for place in places:
        nodes_of_host.setdefault(place.host, set()).add(place.node)
    shared = {host for host, nodes in nodes_of_host.items() if len(nodes) > 1}
    return [replace(p, host=f"{p.host} (node {p.node})") if p.host in shared else p for p in places]


def build_layout(
    world_size: int,
    ranks_per_domain: int | None = None,
    ranks_per_host: int | None = None,
    discovered: Sequence[RankPlace | dict[str, Any]] | None = None,
    partial_last: bool = False,
) -> Layout:
    """Hosts and domains of every rank.

    Overrides win over discovery: ``ranks_per_domain`` alone makes each domain one host (as on HGX servers);
    ``ranks_per_host`` alone keeps the discovered fabric cliques (NVL72 racks), and where no rank reported
    one the domains follow the overridden hosts (a domain is then a host, as without overrides: 4 CPU ranks
    with ``ranks_per_host=2`` stand for 2 hosts of 2); both must nest (a host inside a domain).
    An override that does not divide the ranks (3 + 1 at world 4) is refused unless ``partial_last``: a
    what-if on a spec's machines (300 GPUs of 72-GPU racks: 4 full and one partial) may end in a partial one.
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
        domains = None
        if ranks_per_domain is not None:
            domains = _contiguous(world_size, ranks_per_domain, "--ranks-per-domain", partial_last)
        elif places is not None and any(p.fabric_cluster_uuid for p in places):
            domains = _dense_ids([p.domain_key for p in places])
        per_host = ranks_per_host if ranks_per_host is not None else ranks_per_domain
        hosts = _contiguous(world_size, int(per_host), "--ranks-per-host", partial_last)
        # No fabric clique: a rank's NVLink domain is its host, the overridden one.
        return Layout(hosts.copy() if domains is None else domains, hosts, "override", tuple(places or ()))
    if places is not None:
        hosts = _dense_ids([p.host for p in places])
        domains = _dense_ids([p.domain_key for p in places])
        return Layout(domains, hosts, "discovered", tuple(places))
    zeros = np.zeros(world_size, dtype=np.int64)
    return Layout(zeros, zeros.copy(), "default")

"""Fabric model: predict an all-to-all phase's time from its [src][dst] traffic and a system spec.

Resources (docs/fabric-model.md has the derivation and the calibration):

- per GPU, NVLink egress and ingress, each ``nvlink_GBps_per_direction`` through a non-blocking switch
  (NVSwitch), so within a domain only the GPU ends limit;
- per GPU, NIC egress and ingress, each ``nic_Gbps_per_direction / 8`` GB/s, for bytes between domains. On a
  rail-optimized fabric with PXN (NCCL's default there), a byte for rank ``dst`` of another domain first moves
  over NVLink to the GPU of the sender's host on ``dst``'s rail and leaves through that GPU's NIC;
- optionally, leaf-group uplinks (``pod_gpus`` GPUs under one leaf group, ``oversubscription`` > 1): bytes
  leaving or entering a leaf group share pod_gpus x NIC / oversubscription.

A resource's time is bytes / (bandwidth x efficiency of its link class) + per-message latency x peers it
exchanges with; the phase takes the fixed phase latency + the slowest resource of any rank. The model names
that resource: the bottleneck (rank, link class, direction). Self traffic costs nothing (it never leaves the
GPU). Everything is vectorized over the matrix; traffic may also be given as [G, m, m] blocks (G groups of m
contiguous ranks that only talk inside their group, such as expert-parallel groups), never materializing the
n x n matrix.

``python -m commbench.fabric.model --calibration`` prints the comparison with published measurements.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from commbench.errors import UsageError
from commbench.inputs.layout import Layout, build_layout
from commbench.inputs.specs import SystemSpec, load_spec

NVLINK, SCALEOUT = 0, 1
SEND, RECV = 0, 1
CLASS_NAMES = ("nvlink", "scaleout")
DIRECTION_NAMES = ("send", "recv")

# Calibrated defaults (docs/fabric-model.md, `python -m commbench.fabric.model --calibration`):
# - NVLink efficiency: nccl-tests alltoall busbw inside one NVL72 rack (GB300 and GB200, 4 to 64 GPUs,
#   8-16 GiB) is 615-685 GB/s of 900 GB/s per direction: median 0.72 of line rate.
# - Scale-out efficiency: nccl-tests alltoall across GB200 racks (2 and 3 racks) gives 0.84-0.90 of the
#   400 Gb/s NIC; DeepEP's RDMA figures on H800 sit in the same range. GB300 across two racks (0.24) is an
#   outlier the model does not explain (see the doc).
# - Latencies: nccl-tests alltoall at 512 KiB inside a GB300 rack takes 14.5 us at 4 GPUs, 15.3 us at 8 and
#   32.7 us at 64: about 12 us fixed + 0.3 us per NVLink peer. Per scale-out peer: 3 us, from RDMA write
#   latency across racks (3.2 us, OCI GB200 quick-start); not fitted to an all-to-all (none published).
DEFAULT_NVLINK_EFFICIENCY = 0.72
DEFAULT_SCALEOUT_EFFICIENCY = 0.87
DEFAULT_PHASE_LATENCY_S = 12e-6
DEFAULT_NVLINK_PEER_LATENCY_S = 0.3e-6
DEFAULT_SCALEOUT_PEER_LATENCY_S = 3e-6


@dataclass(frozen=True)
class FabricParams:
    """Model knobs; ``from_spec`` takes a spec's optional overrides, else the calibrated defaults."""

    nvlink_efficiency: float = DEFAULT_NVLINK_EFFICIENCY
    scaleout_efficiency: float = DEFAULT_SCALEOUT_EFFICIENCY
    phase_latency_s: float = DEFAULT_PHASE_LATENCY_S
    nvlink_peer_latency_s: float = DEFAULT_NVLINK_PEER_LATENCY_S
    scaleout_peer_latency_s: float = DEFAULT_SCALEOUT_PEER_LATENCY_S
    rail_optimized: bool = True
    pxn: bool = True  # forward scale-out bytes over NVLink to the destination's rail (NCCL PXN)
    oversubscription: float = 1.0
    pod_gpus: int = 0  # GPUs under one leaf group; 0 = one non-blocking fabric (no uplink limit)

    @classmethod
    def from_spec(cls, spec: SystemSpec, **overrides: Any) -> FabricParams:
        values: dict[str, Any] = {
            "rail_optimized": spec.rail_optimized,
            "oversubscription": spec.oversubscription,
            "pod_gpus": spec.pod_gpus,
        }
        for key in ("nvlink_efficiency", "scaleout_efficiency"):
            if getattr(spec, key) is not None:
                values[key] = getattr(spec, key)
        for key in ("phase_latency", "nvlink_peer_latency", "scaleout_peer_latency"):
            if getattr(spec, f"{key}_us") is not None:
                values[f"{key}_s"] = getattr(spec, f"{key}_us") * 1e-6
        values.update({k: v for k, v in overrides.items() if v is not None})
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        for key in ("nvlink_efficiency", "scaleout_efficiency"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise UsageError(f"{key} must be in (0, 1], got {value:g}")
        if self.oversubscription < 1:
            raise UsageError(
                f"oversubscription must be >= 1 (1 = non-blocking), got {self.oversubscription:g}"
            )
        if self.pod_gpus < 0:
            raise UsageError(f"pod_gpus must be >= 0 (0 = one pod), got {self.pod_gpus}")
        for key in ("phase_latency_s", "nvlink_peer_latency_s", "scaleout_peer_latency_s"):
            if getattr(self, key) < 0:
                raise UsageError(f"{key} must be >= 0, got {getattr(self, key):g}")


@dataclass(frozen=True)
class Fabric:
    """What a job runs on: the system spec, where its ranks sit, and the model knobs."""

    spec: SystemSpec
    layout: Layout
    params: FabricParams

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def describe(self) -> str:
        p = self.params
        fabric = "rail-optimized" + (" + PXN" if p.pxn else "") if p.rail_optimized else "fat-tree"
        if p.oversubscription > 1 and p.pod_gpus:
            fabric += f", {p.oversubscription:g}:1 oversubscribed above {p.pod_gpus}-GPU leaf groups"
        else:
            fabric += ", non-blocking"
        return f"{self.spec.name}; {self.layout.describe()}; scale-out {fabric}"


def make_fabric(
    spec: SystemSpec | str | None,
    world_size: int,
    ranks_per_domain: int | None = None,
    ranks_per_host: int | None = None,
    params: FabricParams | None = None,
    **overrides: Any,
) -> Fabric:
    """Contiguous placement of ``world_size`` ranks on ``spec`` (domain and host sizes from the spec unless
    overridden; an overridden domain size keeps hosts inside domains)."""
    system = load_spec(spec)
    per_domain = ranks_per_domain or system.gpus_per_domain
    per_host = ranks_per_host or math.gcd(per_domain, system.ranks_per_host)
    layout = build_layout(world_size, ranks_per_domain=per_domain, ranks_per_host=per_host)
    knobs = replace(params, **{k: v for k, v in overrides.items() if v is not None}) if params else None
    knobs = knobs or FabricParams.from_spec(system, **overrides)
    knobs.validate()
    if knobs.pod_gpus and knobs.pod_gpus % per_host:
        raise UsageError(f"pod_gpus {knobs.pod_gpus} is not a multiple of the {per_host} ranks per host")
    return Fabric(system, layout, knobs)


@dataclass
class LinkLoads:
    """Bytes and messages per rank and resource: [rank, class (nvlink, scaleout), direction (send, recv)]."""

    bytes: np.ndarray  # float64 [n, 2, 2]
    messages: np.ndarray  # int64 [n, 2, 2]: peers exchanged with through that resource
    uplink_bytes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))  # [leaf groups, send/recv]
    uplink_GBps: np.ndarray = field(
        default_factory=lambda: np.zeros(0)
    )  # [leaf groups] capacity per direction
    total_bytes: float = 0.0  # every byte of the phase, self included
    self_bytes: float = 0.0
    forwarded_bytes: float = 0.0  # NVLink bytes added by PXN forwarding (already inside ``bytes``)


@dataclass
class PhasePrediction:
    """Predicted time of one phase and what limits it."""

    time_s: float
    bottleneck_rank: int  # -1 when a leaf uplink or the fixed latency limits
    bottleneck_class: str  # "nvlink" | "scaleout" | "uplink" | "latency"
    bottleneck_dir: str  # "send" | "recv" | ""
    bottleneck_bytes: float
    resource_time_s: dict[str, float]  # slowest rank per resource ("nvlink_send", ...), latency excluded
    world_size: int
    total_bytes: float
    self_bytes: float
    nvlink_bytes: float  # sent over NVLink, PXN forwarding included
    scaleout_bytes: float
    forwarded_bytes: float
    rank_time_s: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 2, 2)))

    @property
    def bottleneck(self) -> str:
        if self.bottleneck_class == "latency":
            return "latency (no bytes cross a link)"
        if self.bottleneck_class == "uplink":
            return f"leaf-group uplink {self.bottleneck_dir}"
        name = "NVLink" if self.bottleneck_class == "nvlink" else "scale-out NIC"
        return f"rank {self.bottleneck_rank} {name} {self.bottleneck_dir}"

    @property
    def per_gpu_GBps(self) -> float:
        """Bytes the average GPU moves in this phase (self included: what the layer sees) per second, GB/s."""
        return self.total_bytes / self.world_size / self.time_s / 1e9

    def as_dict(self) -> dict[str, Any]:
        return {
            "time_us": self.time_s * 1e6,
            "bottleneck": self.bottleneck,
            "bottleneck_rank": self.bottleneck_rank,
            "bottleneck_class": self.bottleneck_class,
            "bottleneck_dir": self.bottleneck_dir,
            "bottleneck_bytes": self.bottleneck_bytes,
            "per_gpu_GBps": self.per_gpu_GBps,
            "total_bytes": self.total_bytes,
            "self_bytes": self.self_bytes,
            "nvlink_bytes": self.nvlink_bytes,
            "scaleout_bytes": self.scaleout_bytes,
            "forwarded_bytes": self.forwarded_bytes,
            **{f"{k}_us": v * 1e6 for k, v in self.resource_time_s.items()},
        }


def _as_blocks(traffic: np.ndarray, world_size: int) -> np.ndarray:
    t = np.asarray(traffic)
    if t.ndim == 2:
        t = t[None]
    if t.ndim != 3 or t.shape[1] != t.shape[2]:
        raise UsageError(f"traffic must be [n, n] or [groups, m, m], got shape {np.shape(traffic)}")
    if t.shape[0] * t.shape[1] != world_size:
        raise UsageError(f"traffic covers {t.shape[0] * t.shape[1]} ranks but the fabric has {world_size}")
    if (t < 0).any():
        raise UsageError("traffic has negative byte counts")
    return t.astype(np.float64, copy=False)


def _uniform_host_size(layout: Layout) -> int | None:
    """Ranks per host when hosts are contiguous and equal, else None."""
    hosts = layout.host_of_rank
    sizes = np.bincount(hosts)
    size = int(sizes[0])
    if not np.all(sizes == size) or not np.array_equal(hosts, np.arange(hosts.size) // size):
        return None
    return size


def compute_loads(traffic: np.ndarray, fabric: Fabric) -> LinkLoads:
    """Bytes and peers on every rank's NVLink and NIC, and on leaf uplinks, for one phase."""
    layout, p = fabric.layout, fabric.params
    n = layout.world_size
    t = _as_blocks(traffic, n)
    groups, m, _ = t.shape
    dom = layout.domain_of_rank.reshape(groups, m)
    same = dom[:, :, None] == dom[:, None, :]
    off_diagonal = ~np.eye(m, dtype=bool)
    nvlink = np.where(same & off_diagonal, t, 0.0)
    scaleout = np.where(same, 0.0, t)

    loads = np.zeros((n, 2, 2))
    msgs = np.zeros((n, 2, 2), dtype=np.int64)
    loads[:, NVLINK, SEND] = nvlink.sum(2).ravel()
    loads[:, NVLINK, RECV] = nvlink.sum(1).ravel()
    msgs[:, NVLINK, SEND] = (nvlink > 0).sum(2).ravel()
    msgs[:, NVLINK, RECV] = (nvlink > 0).sum(1).ravel()
    loads[:, SCALEOUT, RECV] = scaleout.sum(1).ravel()

    per_host = _uniform_host_size(layout)
    use_pxn = p.rail_optimized and p.pxn and per_host is not None and per_host > 1 and m % per_host == 0
    forwarded = 0.0
    if use_pxn:
        assert per_host is not None
        hosts = m // per_host
        # [group, src host, src local, dst host, dst local (= rail)]
        by_pair = scaleout.reshape(groups, hosts, per_host, hosts, per_host)
        by_src_rail = by_pair.sum(3)  # [g, src host, src local, rail]
        host_to_dst = by_pair.sum(2)  # [g, src host, dst host, dst local]
        loads[:, SCALEOUT, SEND] = by_src_rail.sum(2).reshape(n)  # NIC of (src host, rail)
        reached = host_to_dst > 0
        msgs[:, SCALEOUT, SEND] = reached.sum(2).reshape(n)  # distinct destinations per carrier NIC
        msgs[:, SCALEOUT, RECV] = reached.sum(1).reshape(n)  # distinct source hosts per destination
        hop = np.where(~np.eye(per_host, dtype=bool), by_src_rail, 0.0)  # src local != rail: NVLink hop
        loads[:, NVLINK, SEND] += hop.sum(3).reshape(n)
        loads[:, NVLINK, RECV] += hop.sum(2).reshape(n)
        msgs[:, NVLINK, SEND] += (hop > 0).sum(3).reshape(n)
        msgs[:, NVLINK, RECV] += (hop > 0).sum(2).reshape(n)
        forwarded = float(hop.sum())
    else:
        loads[:, SCALEOUT, SEND] = scaleout.sum(2).ravel()
        msgs[:, SCALEOUT, SEND] = (scaleout > 0).sum(2).ravel()
        msgs[:, SCALEOUT, RECV] = (scaleout > 0).sum(1).ravel()

    uplink_bytes, uplink_GBps = _uplinks(scaleout, fabric, per_host, use_pxn)
    return LinkLoads(
        bytes=loads,
        messages=msgs,
        uplink_bytes=uplink_bytes,
        uplink_GBps=uplink_GBps,
        total_bytes=float(t.sum()),
        self_bytes=float(np.einsum("gii->", t)),
        forwarded_bytes=forwarded,
    )


def _uplinks(
    scaleout: np.ndarray, fabric: Fabric, per_host: int | None, use_pxn: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes leaving/entering each leaf group through the spine, and each group's uplink capacity."""
    p, spec = fabric.params, fabric.spec
    if p.oversubscription <= 1 or p.pod_gpus <= 0:
        return np.zeros((0, 2)), np.zeros(0)
    groups, m, _ = scaleout.shape
    ranks = np.arange(groups * m).reshape(groups, m)
    pod = ranks // p.pod_gpus
    rails = per_host if (p.rail_optimized and per_host) else 1
    local = ranks % rails
    # Leaf group of the sending NIC: with PXN the NIC on the destination's rail in the sender's host.
    send_rail = local[:, None, :] if use_pxn else local[:, :, None]
    leaf_send = pod[:, :, None] * rails + np.broadcast_to(send_rail, scaleout.shape)
    leaf_recv = np.broadcast_to(pod[:, None, :] * rails + local[:, None, :], scaleout.shape)
    crossing = (leaf_send != leaf_recv) & (scaleout > 0)
    leaves = int(pod.max() + 1) * rails
    out = np.bincount(leaf_send[crossing], weights=scaleout[crossing], minlength=leaves)
    into = np.bincount(leaf_recv[crossing], weights=scaleout[crossing], minlength=leaves)
    members = np.bincount((pod * rails + local).ravel(), minlength=leaves)
    capacity = members * spec.nic_GBps_per_direction / p.oversubscription
    return np.stack([out, into], axis=1), capacity


def predict_loads(loads: LinkLoads, fabric: Fabric) -> PhasePrediction:
    """Phase time = fixed latency + slowest resource (bytes / (bw x eff) + peers x per-message latency)."""
    p, spec = fabric.params, fabric.spec
    bandwidth = np.array(
        [
            spec.nvlink_GBps_per_direction * p.nvlink_efficiency,
            spec.nic_GBps_per_direction * p.scaleout_efficiency,
        ]
    )
    latency = np.array([p.nvlink_peer_latency_s, p.scaleout_peer_latency_s])
    rank_time = loads.bytes / (bandwidth[None, :, None] * 1e9) + loads.messages * latency[None, :, None]
    resource = {
        f"{CLASS_NAMES[c]}_{DIRECTION_NAMES[d]}": float(rank_time[:, c, d].max(initial=0.0))
        for c in range(2)
        for d in range(2)
    }
    slowest = float(rank_time.max(initial=0.0))
    rank, cls, direction = (
        np.unravel_index(int(np.argmax(rank_time)), rank_time.shape) if rank_time.size else (0, 0, 0)
    )
    neck = ("nvlink" if cls == NVLINK else "scaleout", int(rank), DIRECTION_NAMES[direction])
    neck_bytes = float(loads.bytes[rank, cls, direction]) if rank_time.size else 0.0
    if loads.uplink_bytes.size:
        uplink_time = loads.uplink_bytes / (loads.uplink_GBps[:, None] * 1e9 * p.scaleout_efficiency)
        resource["uplink_send"] = float(uplink_time[:, SEND].max())
        resource["uplink_recv"] = float(uplink_time[:, RECV].max())
        leaf, direction = np.unravel_index(int(np.argmax(uplink_time)), uplink_time.shape)
        if uplink_time[leaf, direction] > slowest:
            slowest = float(uplink_time[leaf, direction])
            neck = ("uplink", -1, DIRECTION_NAMES[direction])
            neck_bytes = float(loads.uplink_bytes[leaf, direction])
    if slowest <= 0:
        neck, neck_bytes = ("latency", -1, ""), 0.0
    nvlink_bytes = float(loads.bytes[:, NVLINK, SEND].sum())
    return PhasePrediction(
        time_s=p.phase_latency_s + slowest if (slowest > 0 or p.phase_latency_s > 0) else 1e-9,
        bottleneck_rank=neck[1],
        bottleneck_class=neck[0],
        bottleneck_dir=neck[2],
        bottleneck_bytes=neck_bytes,
        resource_time_s=resource,
        world_size=fabric.world_size,
        total_bytes=loads.total_bytes,
        self_bytes=loads.self_bytes,
        nvlink_bytes=nvlink_bytes,
        scaleout_bytes=float(loads.bytes[:, SCALEOUT, RECV].sum()),
        forwarded_bytes=loads.forwarded_bytes,
        rank_time_s=rank_time,
    )


def predict_phase(traffic: np.ndarray, fabric: Fabric) -> PhasePrediction:
    """Predicted time of one phase whose bytes are ``traffic`` ([src][dst], or [G, m, m] groups)."""
    return predict_loads(compute_loads(traffic, fabric), fabric)


def balanced_traffic(world_size: int, bytes_per_peer: float) -> np.ndarray:
    """nccl-tests alltoall: every rank sends ``bytes_per_peer`` to every rank (itself included)."""
    return np.full((world_size, world_size), float(bytes_per_peer))


# ----------------------------------------------------------------------------------------------------------
# Expert-parallel traffic at scale: EP groups, the sampled fast path, and `simulate`.


def expert_owner(num_experts: int, ep_size: int) -> np.ndarray:
    """EP rank (0..ep_size-1) holding each expert: contiguous and as even as possible.

    ``floor(e * ep_size / num_experts)``: the project's ``e // (num_experts // ep_size)`` when ep_size divides
    the experts; otherwise ranks hold floor or ceil of num_experts / ep_size experts (256 experts on
    72 ranks: 3 or 4 each), which is how a 72-GPU rack is used without redundant experts.
    """
    if not 1 <= ep_size <= num_experts:
        raise UsageError(f"--ep-size {ep_size} must be between 1 and the model's {num_experts} experts")
    return (np.arange(num_experts, dtype=np.int64) * ep_size) // num_experts


def default_ep_size(world_size: int, num_experts: int) -> int:
    return min(world_size, num_experts)


@dataclass
class GroupedPattern:
    """Dispatch traffic of ``world_size / ep_size`` EP groups (contiguous: group g = ranks g*m .. g*m+m-1),
    each routing its own tokens over all experts. Matrices are [group, src, dst] within a group."""

    model: Any  # commbench.inputs.models.ModelConfig
    world_size: int
    ep_size: int
    tokens_per_rank: int
    send_mode: str
    skew_text: str
    expert_owner: np.ndarray  # int64 [num_experts]: EP rank of each expert
    dispatch_tokens: np.ndarray  # int64 [G, m, m]: tokens, once per destination rank
    dispatch_selections: np.ndarray  # int64 [G, m, m]: (token, expert) selections
    method: str  # "exact" or "sampled"
    sample_tokens: int = 0  # pooled routed tokens behind the hit probabilities (sampled method)
    hit_probability: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [m] P(token reaches rank)

    @property
    def num_groups(self) -> int:
        return self.world_size // self.ep_size

    @property
    def dispatch_rows(self) -> np.ndarray:
        return self.dispatch_tokens if self.send_mode == "token" else self.dispatch_selections

    @property
    def dispatch_bytes(self) -> np.ndarray:
        return self.dispatch_rows * int(self.model.dispatch_bytes_per_token)

    @property
    def combine_bytes(self) -> np.ndarray:
        """Combine returns what dispatch delivered: [g, src, dst] = dispatch rows [g, dst, src] x row size."""
        return np.ascontiguousarray(self.dispatch_rows.transpose(0, 2, 1)) * int(
            self.model.combine_bytes_per_token
        )

    def describe(self) -> str:
        per_rank = np.bincount(self.expert_owner, minlength=self.ep_size)
        experts = (
            f"{per_rank[0]} expert(s) per rank"
            if per_rank.min() == per_rank.max()
            else f"{per_rank.min()}-{per_rank.max()} experts per rank (uneven)"
        )
        groups = self.num_groups
        layout = f"EP{self.ep_size} ({experts})" + (
            f" x {groups} data-parallel EP groups communicating at once" if groups > 1 else ""
        )
        how = (
            "exact routing of every token"
            if self.method == "exact"
            else (
                f"sampled: hit probabilities from {self.sample_tokens} routed tokens, per-pair counts drawn"
            )
        )
        return (
            f"{self.model.name}, {self.tokens_per_rank} tokens/rank, skew {self.skew_text}, {layout}; {how}"
        )


def _routing_world(model: Any, skew: Any, ep_size: int) -> int:
    if model.num_experts % ep_size == 0:
        return ep_size
    if skew.kind == "rank-imbalance":
        raise UsageError(
            f"--skew {skew.text} needs an --ep-size that divides {model.num_experts} experts (got {ep_size})"
        )
    return 1  # popularity does not depend on the world size for the other skews


def _hits(topk_ids: np.ndarray, owner: np.ndarray, ep_size: int) -> np.ndarray:
    """int64 [tokens, ep_size]: selections of each token on each EP rank (dropped ids -1 count nowhere)."""
    tokens = topk_ids.shape[0]
    kept = topk_ids >= 0
    dest = owner[np.where(kept, topk_ids, 0)]
    key = (np.arange(tokens)[:, None] * ep_size + dest)[kept]
    return np.bincount(key, minlength=tokens * ep_size).reshape(tokens, ep_size)


def _exchangeable_classes(owner: np.ndarray, weights: np.ndarray | None, model: Any) -> np.ndarray:
    """Class id per EP rank: ranks whose experts are interchangeable under the routing (same popularity
    weights, in groups of the same weight profile) share a class, so their hit rates can be pooled."""
    ep_size = int(owner.max()) + 1
    if weights is None:  # trace replay: nothing is known to be interchangeable
        return np.arange(ep_size)
    groups = model.n_group if model.group_limited else 1
    group_of = np.arange(owner.size) // (owner.size // groups)
    rounded = np.round(np.asarray(weights, dtype=np.float64), 9)
    profile = {g: tuple(np.sort(rounded[group_of == g])) for g in range(groups)}
    keys = []
    for rank in range(ep_size):
        experts = np.flatnonzero(owner == rank)
        parts = sorted(
            (profile[g], tuple(np.sort(rounded[experts[group_of[experts] == g]])))
            for g in np.unique(group_of[experts])
        )
        keys.append(repr(parts))
    return np.unique(np.array(keys), return_inverse=True)[1]


def grouped_pattern(
    model: Any,
    world_size: int,
    tokens_per_rank: int = 4096,
    skew: Any = "uniform",
    ep_size: int | None = None,
    send_mode: str = "token",
    seed: int = 0,
    sample_tokens: int = 4096,
    exact: bool | None = None,
) -> GroupedPattern:
    """Dispatch traffic of ``world_size`` ranks in EP groups of ``ep_size`` (default min(world, experts)).

    ``exact=True`` routes every token (cost grows with world x tokens). The sampled fast path (default when
    world x tokens exceeds 65,536) exploits that expert popularity is global: it routes ``sample_tokens``
    tokens once, estimates for each EP rank the probability that a token reaches it (pooled over ranks whose
    experts are interchangeable) and the selections per reaching token, then draws every (src, dst) count:
    tokens ~ Binomial(tokens_per_rank, p[dst]), extra selections ~ Poisson. Column sums (what a rank
    receives) then have the exact build's distribution given p; docs/fabric-model.md gives the error.
    """
    from commbench.inputs.models import ModelConfig, load_model
    from commbench.inputs.skew import SkewSpec, parse_skew
    from commbench.traffic.routing import RoutingConfig, expert_popularity, route_rank

    cfg_model = model if isinstance(model, ModelConfig) else load_model(str(model))
    skew_spec = skew if isinstance(skew, SkewSpec) else parse_skew(str(skew))
    if send_mode not in ("token", "selection"):
        raise UsageError(f"unknown send mode {send_mode!r}; choose token or selection")
    if tokens_per_rank < 1:
        raise UsageError(f"--tokens must be positive, got {tokens_per_rank}")
    experts = cfg_model.num_experts
    ep = ep_size or default_ep_size(world_size, experts)
    owner = expert_owner(experts, ep)
    if world_size % ep:
        raise UsageError(
            f"{world_size} ranks do not split into EP groups of {ep}; pass --ep-size dividing {world_size} "
            f"(at most {experts}, the model's experts)"
        )
    groups = world_size // ep
    routing_world = _routing_world(cfg_model, skew_spec, ep)
    use_exact = exact if exact is not None else world_size * tokens_per_rank <= 65536
    rng = np.random.default_rng([seed, 0xFAB])
    common = {"model": cfg_model, "skew": skew_spec, "world_size": routing_world}
    if use_exact:
        tokens = np.zeros((groups, ep, ep), dtype=np.int64)
        selections = np.zeros_like(tokens)
        for g in range(groups):
            if routing_world == ep:  # one routing stream per rank, as the real ranks would
                cfg = RoutingConfig(**common, tokens_per_rank=tokens_per_rank, seed=seed + g)
                ids = np.concatenate([route_rank(cfg, r).topk_ids.numpy() for r in range(ep)])
            else:  # uneven placement: route the group's tokens in one stream and split them by rank
                cfg = RoutingConfig(**common, tokens_per_rank=tokens_per_rank * ep, seed=seed + g)
                ids = route_rank(cfg, 0).topk_ids.numpy()
            hits = _hits(ids, owner, ep).reshape(ep, tokens_per_rank, ep)
            tokens[g] = (hits > 0).sum(1)
            selections[g] = hits.sum(1)
        return GroupedPattern(
            cfg_model,
            world_size,
            ep,
            tokens_per_rank,
            send_mode,
            skew_spec.text,
            owner,
            tokens,
            selections,
            "exact",
        )
    if sample_tokens < 1:
        raise UsageError(f"--sample-tokens must be positive, got {sample_tokens}")
    cfg = RoutingConfig(**common, tokens_per_rank=int(sample_tokens), seed=seed)
    hits = _hits(route_rank(cfg, 0).topk_ids.numpy(), owner, ep)
    weights = None if skew_spec.kind == "trace" else expert_popularity(cfg).weights
    classes = _exchangeable_classes(owner, weights, cfg_model)
    reached = (hits > 0).mean(0)
    selected = hits.mean(0)
    members = np.bincount(classes).astype(np.float64)
    p_hit = (np.bincount(classes, weights=reached) / members)[classes]
    per_token = (np.bincount(classes, weights=selected) / members)[classes]
    extra_per_hit = np.where(p_hit > 0, per_token / np.maximum(p_hit, 1e-300) - 1.0, 0.0)
    tokens = rng.binomial(tokens_per_rank, np.broadcast_to(p_hit, (groups, ep, ep))).astype(np.int64)
    selections = tokens + rng.poisson(tokens * np.maximum(extra_per_hit, 0.0)[None, None, :])
    return GroupedPattern(
        cfg_model,
        world_size,
        ep,
        tokens_per_rank,
        send_mode,
        skew_spec.text,
        owner,
        tokens,
        selections,
        "sampled",
        sample_tokens=int(sample_tokens),
        hit_probability=p_hit,
    )


def scaled_pattern(model: Any, world_size: int, **kwargs: Any) -> GroupedPattern:
    """The fast path of ``grouped_pattern`` (sampled hit probabilities), whatever the size."""
    return grouped_pattern(model, world_size, exact=False, **kwargs)


@dataclass
class Simulation:
    rows: list[dict[str, Any]]
    notes: list[str]


def simulate(
    model: Any,
    ranks: Sequence[int],
    spec: SystemSpec | str | None = None,
    tokens_per_rank: int = 4096,
    skew: Any = "uniform",
    ranks_per_domain: int | None = None,
    ranks_per_host: int | None = None,
    ep_size: int | None = None,
    send_mode: str = "token",
    seed: int = 0,
    sample_tokens: int = 4096,
    exact: bool | None = None,
    **fabric_overrides: Any,
) -> Simulation:
    """Predicted dispatch and combine per world size, with per-GPU throughput and scaling efficiency.

    Scaling efficiency = per-GPU token throughput (tokens per rank / phase time) at a size over that at the
    smallest size: every GPU does the same work at every size, so it is the ratio of phase times.
    """
    from commbench.inputs.models import load_model
    from commbench.inputs.skew import parse_skew

    sizes = sorted({int(r) for r in ranks})
    if not sizes or sizes[0] < 1:
        raise UsageError(f"--ranks needs positive world sizes, got {list(ranks)!r}")
    # Every input is checked before the first (slow) routing.
    system = load_spec(spec)
    model = model if hasattr(model, "num_experts") else load_model(str(model))
    skew = skew if hasattr(skew, "kind") else parse_skew(str(skew))
    fabrics = [make_fabric(system, w, ranks_per_domain, ranks_per_host, **fabric_overrides) for w in sizes]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    base: dict[str, float] = {}
    for world, fabric in zip(sizes, fabrics, strict=True):
        pattern = grouped_pattern(
            model, world, tokens_per_rank, skew, ep_size, send_mode, seed, sample_tokens, exact
        )
        note = f"{world} ranks: {pattern.describe()}; {fabric.describe()}" + _span_note(pattern, fabric)
        per_host = _uniform_host_size(fabric.layout)
        if fabric.params.rail_optimized and fabric.params.pxn and per_host and pattern.ep_size % per_host:
            note += (
                f"; PXN not modelled: EP groups of {pattern.ep_size} do not align with {per_host}-rank hosts"
            )
        notes.append(note)
        dispatch = predict_phase(pattern.dispatch_bytes, fabric)
        combine = predict_phase(pattern.combine_bytes, fabric)
        for phase, pred in (("dispatch", dispatch), ("combine", combine)):
            rows.append(_sim_row(world, pattern, fabric, phase, pred.time_s, pred, base))
        rows.append(_sim_row(world, pattern, fabric, "total", dispatch.time_s + combine.time_s, None, base))
    return Simulation(rows, notes)


def _span_note(pattern: GroupedPattern, fabric: Fabric) -> str:
    domains = fabric.layout.domain_of_rank.reshape(pattern.num_groups, pattern.ep_size)
    spans = [len(np.unique(d)) for d in domains]
    if max(spans) == 1:
        return "; each EP group sits inside one NVLink domain (no scale-out traffic)"
    low, high = min(spans), max(spans)
    text = f"{low}" if low == high else f"{low}-{high}"
    return f"; each EP group spans {text} NVLink domains (contiguous ranks) and shares the scale-out fabric"


def _sim_row(
    world: int,
    pattern: GroupedPattern,
    fabric: Fabric,
    phase: str,
    time_s: float,
    pred: PhasePrediction | None,
    base: dict[str, float],
) -> dict[str, Any]:
    tokens_per_s = pattern.tokens_per_rank / time_s
    base.setdefault(phase, tokens_per_s)
    row: dict[str, Any] = {
        "ranks": world,
        "ep_size": pattern.ep_size,
        "ep_groups": pattern.num_groups,
        "domains": fabric.layout.num_domains,
        "phase": phase,
        "time_us": time_s * 1e6,
        "tokens_per_s_per_gpu": tokens_per_s,
        "scaling_efficiency": tokens_per_s / base[phase],
        "method": pattern.method,
    }
    if pred is not None:
        row.update(
            {
                "per_gpu_GBps": pred.per_gpu_GBps,
                "bottleneck": pred.bottleneck,
                "nvlink_bytes_per_gpu": pred.nvlink_bytes / world,
                "scaleout_bytes_per_gpu": pred.scaleout_bytes / world,
            }
        )
    return row


# ----------------------------------------------------------------------------------------------------------
# Calibration against published measurements. Each case states the figure exactly as its source defines it,
# and the model's prediction of that same figure.


@dataclass(frozen=True)
class CalibrationCase:
    label: str
    spec: str
    world_size: int
    ranks_per_domain: int
    metric: str  # what the published number is
    published: float
    source: str
    kind: str  # "nccl_busbw", "nccl_time_us", "deepep_dispatch", "deepep_combine"
    size_bytes: int = 0  # nccl-tests size (bytes per rank)
    note: str = ""


_OCI_GB300 = "oracle-quickstart/oci-gpu-quickstarts nvidia/GB300 README (NCCL 2.28.7)"
_OCI_GB200 = "oracle-quickstart/oci-gpu-quickstarts nvidia/GB200 README"
_DEEPEP = "deepseek-ai/DeepEP README (V1 normal kernels, H800 + CX7 400 Gb/s)"
GiB = 1 << 30
KiB = 1 << 10

CALIBRATION_CASES: tuple[CalibrationCase, ...] = (
    CalibrationCase(
        "GB300 1 tray", "gb300-nvl72", 4, 72, "busbw GB/s", 627.69, _OCI_GB300, "nccl_busbw", 16 * GiB
    ),
    CalibrationCase(
        "GB300 2 trays", "gb300-nvl72", 8, 72, "busbw GB/s", 685.06, _OCI_GB300, "nccl_busbw", 16 * GiB
    ),
    CalibrationCase(
        "GB300 16 trays, 1 rack",
        "gb300-nvl72",
        64,
        72,
        "busbw GB/s",
        666.92,
        _OCI_GB300,
        "nccl_busbw",
        16 * GiB,
    ),
    CalibrationCase(
        "GB300 2 racks x 16 trays",
        "gb300-nvl72",
        128,
        64,
        "busbw GB/s",
        47.67,
        _OCI_GB300,
        "nccl_busbw",
        16 * GiB,
        note="not explained: 24% of the 800 Gb/s NICs; the GB200 racks reach 90% of theirs",
    ),
    CalibrationCase(
        "GB200 1 tray", "gb200-nvl72", 4, 72, "busbw GB/s", 615.30, _OCI_GB200, "nccl_busbw", 8 * GiB
    ),
    CalibrationCase(
        "GB200 2 trays", "gb200-nvl72", 8, 72, "busbw GB/s", 662.27, _OCI_GB200, "nccl_busbw", 16 * GiB
    ),
    CalibrationCase(
        "GB200 16 trays, 1 rack",
        "gb200-nvl72",
        64,
        72,
        "busbw GB/s",
        622.92,
        _OCI_GB200,
        "nccl_busbw",
        8 * GiB,
    ),
    CalibrationCase(
        "GB200 2 racks x 16 trays",
        "gb200-nvl72",
        128,
        64,
        "busbw GB/s",
        89.70,
        _OCI_GB200,
        "nccl_busbw",
        8 * GiB,
    ),
    CalibrationCase(
        "GB200 3 racks x 16 trays",
        "gb200-nvl72",
        192,
        64,
        "busbw GB/s",
        62.49,
        _OCI_GB200,
        "nccl_busbw",
        8 * GiB,
    ),
    CalibrationCase(
        "GB300 1 tray, 512 KiB", "gb300-nvl72", 4, 72, "time us", 14.50, _OCI_GB300, "nccl_time_us", 512 * KiB
    ),
    CalibrationCase(
        "GB300 2 trays, 512 KiB",
        "gb300-nvl72",
        8,
        72,
        "time us",
        15.25,
        _OCI_GB300,
        "nccl_time_us",
        512 * KiB,
    ),
    CalibrationCase(
        "GB300 1 rack (64), 512 KiB",
        "gb300-nvl72",
        64,
        72,
        "time us",
        32.65,
        _OCI_GB300,
        "nccl_time_us",
        512 * KiB,
    ),
    CalibrationCase(
        "GB300 2 racks (128), 512 KiB",
        "gb300-nvl72",
        128,
        64,
        "time us",
        580.6,
        _OCI_GB300,
        "nccl_time_us",
        512 * KiB,
        note="not explained: a 450-580 us floor across racks at every size up to 8 MiB",
    ),
    CalibrationCase(
        "DeepEP EP8 intranode dispatch", "hgx-h800", 8, 8, "NVL GB/s", 153, _DEEPEP, "deepep_dispatch"
    ),
    CalibrationCase(
        "DeepEP EP8 intranode combine", "hgx-h800", 8, 8, "NVL GB/s", 158, _DEEPEP, "deepep_combine"
    ),
    CalibrationCase("DeepEP EP16 dispatch", "hgx-h800", 16, 8, "RDMA GB/s", 43, _DEEPEP, "deepep_dispatch"),
    CalibrationCase("DeepEP EP16 combine", "hgx-h800", 16, 8, "RDMA GB/s", 43, _DEEPEP, "deepep_combine"),
    CalibrationCase("DeepEP EP32 dispatch", "hgx-h800", 32, 8, "RDMA GB/s", 58, _DEEPEP, "deepep_dispatch"),
    CalibrationCase("DeepEP EP32 combine", "hgx-h800", 32, 8, "RDMA GB/s", 57, _DEEPEP, "deepep_combine"),
    CalibrationCase("DeepEP EP64 dispatch", "hgx-h800", 64, 8, "RDMA GB/s", 51, _DEEPEP, "deepep_dispatch"),
    CalibrationCase("DeepEP EP64 combine", "hgx-h800", 64, 8, "RDMA GB/s", 50, _DEEPEP, "deepep_combine"),
)

# DeepEP's benchmark setting (tests/test_intranode.py, tests/test_internode.py): 4096 tokens per rank, hidden
# 7168, 256 experts, top-8; internode: experts grouped by node, top min(nodes, 4) nodes per token by the max
# score in each node. FP8 dispatch rows = hidden x (1 + 4/128) bytes, BF16 combine rows = 2 x hidden.
DEEPEP_TOKENS, DEEPEP_HIDDEN, DEEPEP_EXPERTS, DEEPEP_TOPK = 4096, 7168, 256, 8
DEEPEP_FP8_ROW = DEEPEP_HIDDEN + DEEPEP_HIDDEN // 128 * 4
DEEPEP_BF16_ROW = 2 * DEEPEP_HIDDEN
DEEPEP_LOCAL_RANKS = 8


def deepep_test_hits(num_ranks: int, tokens: int, rng: np.random.Generator, chunk: int = 8) -> np.ndarray:
    """bool [src rank, token, dst rank]: which ranks each token reaches under DeepEP's test routing
    (|N(0,1)| + 1 scores, node-group limit top-min(nodes, 4) by max score, then top-8 experts)."""
    nodes = max(1, num_ranks // DEEPEP_LOCAL_RANKS)
    topk_groups = min(nodes, 4)
    experts_per_node = DEEPEP_EXPERTS // nodes
    experts_per_rank = DEEPEP_EXPERTS // num_ranks
    hits = np.zeros((num_ranks, tokens, num_ranks), dtype=bool)
    for start in range(0, num_ranks, chunk):
        count = min(chunk, num_ranks - start)
        scores = np.abs(rng.standard_normal((count, tokens, DEEPEP_EXPERTS), dtype=np.float32)) + 1.0
        if nodes > 1 and topk_groups < nodes:
            group_scores = scores.reshape(count, tokens, nodes, experts_per_node).max(-1)
            keep = np.argpartition(-group_scores, topk_groups - 1, axis=-1)[..., :topk_groups]
            kept = np.zeros_like(group_scores, dtype=bool)
            np.put_along_axis(kept, keep, True, axis=-1)
            scores = np.where(np.repeat(kept, experts_per_node, axis=-1), scores, 0.0)
        experts = np.argpartition(-scores, DEEPEP_TOPK - 1, axis=-1)[..., :DEEPEP_TOPK]
        np.put_along_axis(hits[start : start + count], experts // experts_per_rank, True, axis=-1)
    return hits


def deepep_internode_loads(
    hits: np.ndarray, row_bytes: int, combine: bool = False
) -> tuple[LinkLoads, np.ndarray]:
    """DeepEP normal-kernel traffic (dispatch, or its mirror for combine) and the bytes DeepEP's test counts.

    A token crosses the network once per destination node (to the rank with the sender's local index there),
    then that rank forwards it over NVLink to each rank of the node that holds its experts; the sender's own
    node is reached over NVLink directly. The counted bytes follow the test: RDMA = (token, node) pairs,
    the sender's own node included; NVL (intranode) = rows received, the rank's own included.
    """
    num_ranks, tokens, _ = hits.shape
    local_ranks = min(DEEPEP_LOCAL_RANKS, num_ranks)
    nodes = num_ranks // local_ranks
    by_node = hits.reshape(num_ranks, tokens, nodes, local_ranks)
    node_hit = by_node.any(-1)  # [src, token, node]
    src_node = np.arange(num_ranks) // local_ranks
    src_local = np.arange(num_ranks) % local_ranks
    rows_to_node = node_hit.sum(1).astype(np.float64)  # [src, node]
    remote = src_node[:, None] != np.arange(nodes)[None, :]
    # NVLink forwarding at node b by the rank with the sender's local index l: every rank hit there but l.
    hits_at = by_node.sum(1).astype(np.float64)  # [src, node, local]: tokens of src that reach (node, local)
    own_slot = hits_at[np.arange(num_ranks), :, src_local]  # [src, node]: reach the forwarder itself
    forward_rows = hits_at.sum(-1) - own_slot  # [src, node]
    receive_rows = hits_at.copy()
    receive_rows[np.arange(num_ranks), :, src_local] = 0.0  # the forwarder's own rows stay on its GPU

    loads = np.zeros((num_ranks, 2, 2))
    msgs = np.zeros((num_ranks, 2, 2), dtype=np.int64)
    nic_out = np.where(remote, rows_to_node, 0.0)
    loads[:, SCALEOUT, SEND] = nic_out.sum(1) * row_bytes
    msgs[:, SCALEOUT, SEND] = (nic_out > 0).sum(1)
    # The receiving NIC of node b with local index l takes what every remote sender with local index l sends.
    recv_nic = np.zeros((nodes, local_ranks))
    recv_msgs = np.zeros((nodes, local_ranks), dtype=np.int64)
    np.add.at(recv_nic, (slice(None), src_local), nic_out.T)
    np.add.at(recv_msgs, (slice(None), src_local), (nic_out > 0).T.astype(np.int64))
    loads[:, SCALEOUT, RECV] = recv_nic.reshape(-1) * row_bytes
    msgs[:, SCALEOUT, RECV] = recv_msgs.reshape(-1)
    forward = np.zeros((nodes, local_ranks))
    np.add.at(forward, (slice(None), src_local), forward_rows.T)
    loads[:, NVLINK, SEND] = forward.reshape(-1) * row_bytes
    loads[:, NVLINK, RECV] = receive_rows.sum(0).reshape(-1) * row_bytes
    msgs[:, NVLINK, :] = local_ranks - 1
    if combine:  # combine mirrors dispatch: every send becomes a receive
        loads = loads[:, :, ::-1].copy()
        msgs = msgs[:, :, ::-1].copy()
    rdma_counted = rows_to_node.sum(1) * row_bytes
    nvl_counted = hits.sum((0, 1)).astype(np.float64) * row_bytes
    counted = rdma_counted if nodes > 1 else nvl_counted
    total = hits.sum() * float(row_bytes)
    return LinkLoads(bytes=loads, messages=msgs, total_bytes=total), counted


def predict_case(
    case: CalibrationCase, params: FabricParams | None, tokens: int, seed: int
) -> tuple[float, PhasePrediction]:
    """The model's value of the case's published figure, and the prediction behind it."""
    fabric = make_fabric(case.spec, case.world_size, ranks_per_domain=case.ranks_per_domain, params=params)
    if case.kind.startswith("nccl"):
        prediction = predict_phase(
            balanced_traffic(case.world_size, case.size_bytes / case.world_size), fabric
        )
        if case.kind == "nccl_time_us":
            return prediction.time_s * 1e6, prediction
        busbw = case.size_bytes * (case.world_size - 1) / case.world_size / prediction.time_s / 1e9
        return busbw, prediction
    hits = deepep_test_hits(case.world_size, tokens, np.random.default_rng(seed))
    combine = case.kind == "deepep_combine"
    loads, counted = deepep_internode_loads(hits, DEEPEP_BF16_ROW if combine else DEEPEP_FP8_ROW, combine)
    prediction = predict_loads(loads, fabric)
    # DeepEP prints rank 0's counted bytes over its kernel time; the mean over ranks is its expectation.
    return float(counted.mean()) / prediction.time_s / 1e9, prediction


def calibration_rows(
    params: FabricParams | None = None, tokens: int = DEEPEP_TOKENS, seed: int = 0
) -> list[dict[str, Any]]:
    """Every calibration case with the model's prediction and its error (prediction / published - 1)."""
    rows = []
    for case in CALIBRATION_CASES:
        predicted, prediction = predict_case(case, params, tokens, seed)
        rows.append(
            {
                "case": case.label,
                "spec": case.spec,
                "ranks": case.world_size,
                "metric": case.metric,
                "published": case.published,
                "predicted": predicted,
                "error_pct": 100.0 * (predicted / case.published - 1.0),
                "bottleneck": prediction.bottleneck,
                "source": case.source,
                "note": case.note,
            }
        )
    return rows


def calibration_markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| case | spec | ranks | metric | published | model | error | model's bottleneck |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        flag = " (!)" if r["note"] else ""
        lines.append(
            f"| {r['case']}{flag} | {r['spec']} | {r['ranks']} | {r['metric']} | {r['published']:.1f} | "
            f"{r['predicted']:.1f} | {r['error_pct']:+.0f}% | {r['bottleneck']} |"
        )
    notes = [f"- (!) {r['case']}: {r['note']}" for r in rows if r["note"]]
    sources = sorted({r["source"] for r in rows})
    return "\n".join(lines + [""] + notes + [""] + [f"Sources: {'; '.join(sources)}."])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m commbench.fabric.model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--calibration", action="store_true", help="print the calibration table (markdown)")
    parser.add_argument(
        "--tokens", type=int, default=DEEPEP_TOKENS, help="tokens per rank for the DeepEP cases"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.calibration:
        parser.print_help()
        return
    print(calibration_markdown(calibration_rows(tokens=args.tokens, seed=args.seed)))


if __name__ == "__main__":
    main()

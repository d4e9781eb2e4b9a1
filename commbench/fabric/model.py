"""Fabric model: predict an all-to-all phase's time from its [src][dst] traffic and a system spec.

Resources (docs/fabric-model.md has the derivation and the calibration):

- per GPU, NVLink egress and ingress, each ``nvlink_GBps_per_direction`` through a non-blocking switch
  (NVSwitch), so within a domain only the GPU ends limit;
- per GPU, NIC egress and ingress, each ``nic_Gbps_per_direction / 8`` GB/s, for bytes between domains. On a
  rail-optimized fabric with PXN (NCCL's default there), a byte for rank ``dst`` of another domain first moves
  over NVLink to the GPU of the sender's host on ``dst``'s rail and leaves through that GPU's NIC;
- optionally, leaf-group uplinks (``pod_gpus`` GPUs under one leaf group, ``oversubscription`` > 1): bytes
  leaving or entering a leaf group share pod_gpus x NIC / oversubscription.

A resource's time is bytes / (bandwidth x efficiency of its link class) + its message latency (every peer
in sequence for the host-initiated nccl engine, one message for the GPU-initiated engines, whose peers are
in flight at once; ``commbench.fabric.engines``) + the transport's per-message cost on a NIC; a GPU-initiated
kernel's SMs are one more resource per rank. The phase takes the fixed latency (launch unless CUDA graph, +
the engine's) + the slowest resource of any rank. The model names
that resource: the bottleneck (rank, link class, direction). Self traffic costs nothing (it never leaves the
GPU). Everything is vectorized over the matrix; traffic may also be given as [G, m, m] blocks (G groups of m
contiguous ranks that only talk inside their group, such as expert-parallel groups), never materializing the
n x n matrix.

EP-group traffic for it at scale is built in ``commbench.fabric.ep_groups``; ``commbench.fabric.calibration``
compares it with published measurements (``commbench simulate --calibration``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from commbench.errors import UsageError
from commbench.fabric.engines import KERNELS, LIBRARIES, REFERENCE_LIBRARY, engine_defaults
from commbench.inputs.layout import Layout, build_layout
from commbench.inputs.specs import TRANSPORTS, SystemSpec, load_spec

NVLINK, SCALEOUT = 0, 1
SEND, RECV = 0, 1
CLASS_NAMES = ("nvlink", "scaleout")
DIRECTION_NAMES = ("send", "recv")

# Defaults: the nccl engine on InfiniBand, from the parameter table (calibration.yaml, each value sourced).
_NCCL = engine_defaults("nccl", "infiniband")
DEFAULT_NVLINK_EFFICIENCY = _NCCL["nvlink_efficiency"]
DEFAULT_SCALEOUT_EFFICIENCY = _NCCL["scaleout_efficiency"]
DEFAULT_PHASE_LATENCY_S = _NCCL["phase_latency_s"]
DEFAULT_NVLINK_PEER_LATENCY_S = _NCCL["nvlink_peer_latency_s"]
DEFAULT_SCALEOUT_PEER_LATENCY_S = _NCCL["scaleout_peer_latency_s"]
# Spec keys that override an engine's values (spec in us -> params in s).
_SPEC_US = ("phase_latency", "nvlink_peer_latency", "scaleout_peer_latency")


@dataclass(frozen=True)
class FabricParams:
    """Model knobs; ``from_spec`` takes the engine's and transport's values from the parameter table, then
    the spec's optional overrides, then the caller's."""

    nvlink_efficiency: float = DEFAULT_NVLINK_EFFICIENCY
    scaleout_efficiency: float = DEFAULT_SCALEOUT_EFFICIENCY
    phase_latency_s: float = DEFAULT_PHASE_LATENCY_S  # nccl's fixed latency per phase, launch excluded
    nvlink_peer_latency_s: float = DEFAULT_NVLINK_PEER_LATENCY_S
    scaleout_peer_latency_s: float = DEFAULT_SCALEOUT_PEER_LATENCY_S
    rail_optimized: bool = True
    pxn: bool = True  # forward scale-out bytes over NVLink to the destination's rail (NCCL PXN)
    oversubscription: float = 1.0
    pod_gpus: int = 0  # GPUs under one leaf group; 0 = one non-blocking fabric (no uplink limit)
    kernel: str = "nccl"  # transfer engine (commbench.fabric.engines.KERNELS)
    library: str = REFERENCE_LIBRARY  # whose kernels run a GPU-initiated engine (engines.LIBRARIES)
    transport: str = "infiniband"  # scale-out transport (commbench.inputs.specs.TRANSPORTS)
    kernel_latency_s: float = 0.0  # GPU-initiated engines' fixed latency per phase (nccl: phase_latency_s)
    # ... and what a phase that crosses the scale-out adds to it (an internode kernel's notify: the counts
    # exchanged over RDMA and a barrier across nodes before the first token moves)
    scaleout_kernel_latency_s: float = 0.0
    combine_latency_factor: float = 1.0  # the library's combine kernel's fixed latency / its dispatch's
    sms: int = 0  # SMs a GPU-initiated kernel runs on; 0 = no per-SM bound
    per_sm_GBps: float = _NCCL["per_sm_GBps"]
    row_cost_s: float = _NCCL["row_cost_s"]  # SM time per row (token or selection) a GPU kernel handles
    combine_sm_speed: float = 1.0  # a combine's bytes and rows per SM / its dispatch's (it also reduces)
    message_cost_s: float = 0.0  # per scale-out message, per NIC (a CPU-proxy transport's cost)
    net_max_recvs: int = 8  # nccl over PXN: source ranks' messages received as one (SystemSpec's field)
    nics_per_gpu: int = 1
    launch_s: float = _NCCL["launch_s"]  # per call, unless replayed from a CUDA graph
    cuda_graph: bool = False
    api_overhead_s: float = 0.0  # host time around the kernel when a call is timed through its Python API
    rows_per_message: float = 1.0  # rows one scale-out message carries (normal kernels send chunks of rows)

    @classmethod
    def from_spec(
        cls, spec: SystemSpec, table: Mapping[str, float] | None = None, **overrides: Any
    ) -> FabricParams:
        """``table``: parameter values by name (a fit's), else calibration.yaml's."""
        kernel = overrides.get("kernel") or "nccl"
        transport = overrides.get("transport") or spec.transport
        library = overrides.get("library") or REFERENCE_LIBRARY
        if kernel not in KERNELS or transport not in TRANSPORTS or library not in LIBRARIES:
            cls(kernel=kernel, transport=transport, library=library).validate()  # before any table lookup
        values: dict[str, Any] = {
            **engine_defaults(kernel, transport, table, library),
            "kernel": kernel,
            "transport": transport,
            "library": library,
            "rail_optimized": spec.rail_optimized,
            "oversubscription": spec.oversubscription,
            "pod_gpus": spec.pod_gpus,
            "nics_per_gpu": spec.nics_per_gpu,
            "net_max_recvs": spec.net_max_recvs,
            # Per-selection messages leave from the GPU's own NIC (no NVLink hop to another rail).
            "pxn": kernel != "low-latency",
        }
        for key in ("nvlink_efficiency", "scaleout_efficiency"):
            if getattr(spec, key) is not None:
                values[key] = getattr(spec, key)
        for key in _SPEC_US:
            if getattr(spec, f"{key}_us") is not None:
                values[f"{key}_s"] = getattr(spec, f"{key}_us") * 1e-6
        values.update({k: v for k, v in overrides.items() if v is not None})
        params = cls(**values)
        params.validate()
        return params

    @property
    def fixed_latency_s(self) -> float:
        """A dispatch's fixed time inside one NVLink domain: the launch (none from a CUDA graph) + the
        engine's fixed latency."""
        return self.phase_fixed_latency_s(combine=False, scaleout=False)

    def phase_fixed_latency_s(self, combine: bool, scaleout: bool) -> float:
        """The phase's fixed time; a GPU-initiated combine's kernel latency x ``combine_latency_factor``;
        ``scaleout``: the phase moves bytes over the NIC (a GPU-initiated kernel's internode notify)."""
        if self.kernel == "nccl":
            base = self.phase_latency_s
        else:
            kernel = self.kernel_latency_s + (self.scaleout_kernel_latency_s if scaleout else 0.0)
            base = kernel * (self.combine_latency_factor if combine else 1.0)
        return base + self.api_overhead_s + (0.0 if self.cuda_graph else self.launch_s)

    def validate(self) -> None:
        if self.kernel not in KERNELS:
            raise UsageError(f"kernel {self.kernel!r} is not one of {', '.join(KERNELS)}")
        if self.transport not in TRANSPORTS:
            raise UsageError(f"transport {self.transport!r} is not one of {', '.join(TRANSPORTS)}")
        if self.library not in LIBRARIES:
            raise UsageError(f"library {self.library!r} is not one of {', '.join(LIBRARIES)}")
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
        if self.net_max_recvs < 1:
            raise UsageError(f"net_max_recvs must be >= 1, got {self.net_max_recvs}")
        if self.sms < 0 or self.nics_per_gpu < 1 or self.per_sm_GBps <= 0 or self.rows_per_message < 1:
            raise UsageError(
                f"sms must be >= 0, nics_per_gpu >= 1, per_sm_GBps > 0, rows_per_message >= 1; got "
                f"{self.sms}, {self.nics_per_gpu}, {self.per_sm_GBps:g}, {self.rows_per_message:g}"
            )
        for key in ("combine_latency_factor", "combine_sm_speed"):
            if getattr(self, key) <= 0:
                raise UsageError(f"{key} must be > 0, got {getattr(self, key):g}")
        for key in (
            "phase_latency_s",
            "nvlink_peer_latency_s",
            "scaleout_peer_latency_s",
            "kernel_latency_s",
            "scaleout_kernel_latency_s",
            "message_cost_s",
            "launch_s",
            "row_cost_s",
            "api_overhead_s",
        ):
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
        engine = f"{p.kernel} engine" if p.kernel == "nccl" else f"{p.kernel} engine ({p.library}'s kernels)"
        engine += f" on {p.sms} SMs" if p.kernel != "nccl" and p.sms else ""
        engine += ", CUDA graph" if p.cuda_graph else ""
        return f"{self.spec.name}; {self.layout.describe()}; scale-out {fabric}, {p.transport}; {engine}"


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
    # The spec's own sizes may leave a partial last rack or host (a what-if of 300 GPUs on NVL72 racks); a
    # size the user gave must divide the ranks.
    from_spec = ranks_per_domain is None and ranks_per_host is None
    layout = build_layout(world_size, per_domain, per_host, partial_last=from_spec)
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
    # Messages each NIC side posts ([n, send/recv]): bytes / message size when the caller knows the message
    # (a row per token or selection), else one per peer. A CPU-proxy transport pays a cost per message.
    wire_messages: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    message_bytes: float = 0.0  # one row's size when known (0: not known)


@dataclass
class PhasePrediction:
    """Predicted time of one phase and what limits it."""

    time_s: float
    bottleneck_rank: int  # -1 when a leaf uplink or the fixed latency limits
    bottleneck_class: str  # "nvlink" | "scaleout" | "uplink" | "sm" | "latency"
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
        if self.bottleneck_class == "sm":
            return f"rank {self.bottleneck_rank} SM throughput"
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


def uniform_host_size(layout: Layout) -> int | None:
    """Ranks per host when hosts are contiguous and equal, else None."""
    hosts = layout.host_of_rank
    sizes = np.bincount(hosts)
    size = int(sizes[0])
    if not np.all(sizes == size) or not np.array_equal(hosts, np.arange(hosts.size) // size):
        return None
    return size


def compute_loads(traffic: np.ndarray, fabric: Fabric, message_bytes: float | None = None) -> LinkLoads:
    """Bytes and peers on every rank's NVLink and NIC, and on leaf uplinks, for one phase.
    ``message_bytes``: the size of one message (a token's row), when the engine sends one per row."""
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

    per_host = uniform_host_size(layout)
    use_pxn = p.rail_optimized and p.pxn and per_host is not None and per_host > 1 and m % per_host == 0
    forwarded = 0.0
    if use_pxn:
        assert per_host is not None
        hosts = m // per_host
        # [group, src host, src local, dst host, dst local (= rail)]
        by_pair = scaleout.reshape(groups, hosts, per_host, hosts, per_host)
        by_src_rail = by_pair.sum(3)  # [g, src host, src local, rail]
        loads[:, SCALEOUT, SEND] = by_src_rail.sum(2).reshape(n)  # NIC of (src host, rail)
        # A message per destination rank and group of up to net_max_recvs source ranks of the carrier's host.
        sources = (by_pair > 0).sum(2)  # [g, src host, dst host, dst local]
        grouped = np.ceil(sources / p.net_max_recvs)
        msgs[:, SCALEOUT, SEND] = grouped.sum(2).reshape(n)  # per carrier NIC (src host, rail)
        msgs[:, SCALEOUT, RECV] = grouped.sum(1).reshape(n)  # per destination
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
    if message_bytes:
        wire = np.ceil(loads[:, SCALEOUT, :] / float(message_bytes))
    else:
        wire = msgs[:, SCALEOUT, :].astype(np.float64)
    return LinkLoads(
        wire_messages=wire,
        message_bytes=float(message_bytes or 0.0),
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


def predict_loads(loads: LinkLoads, fabric: Fabric, combine: bool = False) -> PhasePrediction:
    """Phase time = fixed latency + slowest resource (docs/fabric-model.md, "Transfer engines"); ``combine``:
    the phase is a combine (a library's combine kernel has its own fixed latency).

    A resource's time is bytes / (bw x eff) + its message latency: every peer in sequence for nccl, one
    message for the GPU-initiated engines (their peers are in flight at once); a NIC side also pays the
    transport's per-message cost over its NICs. A GPU-initiated kernel on ``sms`` SMs is one more resource
    per rank: the bytes it sends or receives, whichever is more, over sms x per-SM rate."""
    p, spec = fabric.params, fabric.spec
    bandwidth = np.array(
        [
            spec.nvlink_GBps_per_direction * p.nvlink_efficiency,
            spec.nic_GBps_per_direction * p.scaleout_efficiency,
        ]
    )
    latency = np.array([p.nvlink_peer_latency_s, p.scaleout_peer_latency_s])
    messages = loads.messages if p.kernel == "nccl" else np.minimum(loads.messages, 1)
    rank_time = loads.bytes / (bandwidth[None, :, None] * 1e9) + messages * latency[None, :, None]
    if p.message_cost_s and loads.wire_messages.size:
        wire = loads.wire_messages / (p.rows_per_message if loads.message_bytes else 1.0)
        rank_time[:, SCALEOUT, :] += np.ceil(wire) * p.message_cost_s / p.nics_per_gpu
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
    if p.kernel != "nccl" and p.sms and loads.bytes.size:
        handled = loads.bytes.sum(axis=1).max(axis=1)  # per rank: sent or received bytes, the larger
        sm_time = handled / (p.sms * p.per_sm_GBps * 1e9)
        if loads.message_bytes:  # and a fixed cost per row (FP8 rows cost more per byte than BF16 rows)
            sm_time = sm_time + handled / loads.message_bytes * p.row_cost_s / p.sms
        if combine:  # a combine reduces each token's returned rows on its SMs too
            sm_time = sm_time / p.combine_sm_speed
        resource["sm"] = float(sm_time.max())
        rank = int(np.argmax(sm_time))
        if sm_time[rank] > slowest:
            slowest, neck, neck_bytes = float(sm_time[rank]), ("sm", rank, ""), float(handled[rank])
    if slowest <= 0:
        neck, neck_bytes = ("latency", -1, ""), 0.0
    nvlink_bytes = float(loads.bytes[:, NVLINK, SEND].sum())
    fixed = p.phase_fixed_latency_s(combine, scaleout=bool(loads.bytes[:, SCALEOUT, :].any()))
    return PhasePrediction(
        time_s=fixed + slowest if (slowest > 0 or fixed > 0) else 1e-9,
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


def predict_phase(
    traffic: np.ndarray, fabric: Fabric, message_bytes: float | None = None, combine: bool = False
) -> PhasePrediction:
    """Predicted time of one phase whose bytes are ``traffic`` ([src][dst], or [G, m, m] groups);
    ``message_bytes``: one message's size when the engine sends one per row (else one per peer);
    ``combine``: the phase is a combine."""
    return predict_loads(compute_loads(traffic, fabric, message_bytes), fabric, combine)


def balanced_traffic(world_size: int, bytes_per_peer: float) -> np.ndarray:
    """nccl-tests alltoall: every rank sends ``bytes_per_peer`` to every rank (itself included)."""
    return np.full((world_size, world_size), float(bytes_per_peer))

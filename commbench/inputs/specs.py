"""Hardware spec catalogue: NVLink-domain and scale-out bandwidths of a system, each with a stated direction.

The shipped specs are the YAML files in ``commbench/inputs/catalogue/`` (package data), each value with its
source in a comment. A user passes a name (``gb300-nvl72``) or the path of their own YAML file with the same
keys.

Direction conventions, binding for every user of a spec:

- ``nvlink_GBps_per_direction``: one GPU's NVLink bandwidth ONE way (NVLink 5: 1.8 TB/s bidirectional =
  900 GB/s per direction). Achieved per-GPU figures (bytes one rank sent, or received, per second) are
  compared with this, never with the bidirectional figure.
- ``nic_Gbps_per_direction``: one GPU's scale-out NIC line rate in Gb/s, one way (Ethernet and InfiniBand
  line rates are per direction, full duplex); ``nic_GBps_per_direction`` = that / 8.
- ``aggregate_GBps_bidirectional``: the whole domain, both directions summed (NVL72: 130 TB/s);
  ``aggregate_GBps_per_direction(ranks)`` halves it and scales it to the ranks used.

Compute: ``dense_tflops_bf16`` / ``dense_tflops_fp8`` are one GPU's dense tensor-core peaks in TFLOP/s
(datasheets quote "with sparsity" figures twice as high; the catalogue holds the dense half).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib import resources
from typing import Any

from commbench.errors import UsageError
from commbench.inputs.userfiles import load_yaml_mapping, read_user_text, shorten

DEFAULT_SPEC_NAME = "gb300-nvl72"
# Scale-out transports the fabric model tells apart (efficiency, per-message cost: commbench/fabric/
# calibration.yaml): RDMA InfiniBand, RDMA over Converged Ethernet, AWS EFA (SRD through a CPU proxy).
TRANSPORTS = ("infiniband", "roce", "efa")
# The spec of a run with nothing to compare with (a CPU run, an unknown GPU): every figure NaN.
NO_SPEC_NAME = "none"

# key -> (type, required). Counts are ints, bandwidths floats (ints accepted), flags bools, text str.
_KEYS: dict[str, tuple[type, bool]] = {
    "name": (str, True),
    "gpus_per_domain": (int, True),
    "nvlink_GBps_per_direction": (float, True),
    "nic_Gbps_per_direction": (float, True),
    "description": (str, False),
    "gpu": (str, False),
    "nic": (str, False),
    "gpus_per_host": (int, False),
    "nvlink_links_per_gpu": (int, False),
    "aggregate_GBps_bidirectional": (float, False),
    "nics_per_gpu": (int, False),
    "transport": (str, False),
    "net_max_recvs": (int, False),
    "rail_optimized": (bool, False),
    "oversubscription": (float, False),
    "pod_gpus": (int, False),
    # Fabric-model overrides (docs/fabric-model.md); absent = the calibrated model defaults.
    "nvlink_efficiency": (float, False),
    "scaleout_efficiency": (float, False),
    "phase_latency_us": (float, False),
    "nvlink_peer_latency_us": (float, False),
    "scaleout_peer_latency_us": (float, False),
    # Dense (no 2:4 sparsity) tensor-core peak of one GPU, TFLOP/s: the comm/compute budget's peak throughput.
    "dense_tflops_bf16": (float, False),
    "dense_tflops_fp8": (float, False),
}
# Keys that may be zero (pod_gpus = 0: the whole scale-out fabric is one non-blocking pod) or are flags/text.
_MAY_BE_ZERO = {"pod_gpus", "phase_latency_us", "nvlink_peer_latency_us", "scaleout_peer_latency_us"}


@dataclass(frozen=True)
class SystemSpec:
    """One system's link bandwidths. See the module docstring for the direction of every figure."""

    name: str
    gpus_per_domain: int
    nvlink_GBps_per_direction: float
    nic_Gbps_per_direction: float
    description: str = ""
    gpu: str = ""
    nic: str = ""
    gpus_per_host: int = 0  # 0 = one host per domain (HGX servers)
    nvlink_links_per_gpu: int = 0  # 0 = not stated
    aggregate_GBps_bidirectional: float = 0.0  # 0 = gpus_per_domain x 2 x nvlink_GBps_per_direction
    # NICs sharing nic_Gbps_per_direction (already the GPU's total): a CPU-proxy transport's per-message cost
    # is paid by each NIC's proxy in parallel (docs/fabric-model.md).
    nics_per_gpu: int = 1
    transport: str = "infiniband"  # one of TRANSPORTS: the scale-out transport's efficiency and message cost
    # nccl over PXN: how many source ranks' messages to one remote rank the net plugin receives as one
    # (``maxRecvs``): 8 for NCCL's InfiniBand/RoCE transport (NCCL_NET_IB_MAX_RECVS) and aws-ofi-nccl from
    # v1.19.1 (by default from v1.20.0); 1 for aws-ofi-nccl before it (NCCL_OFI_MAX_RECVS 1): every
    # (source, destination) pair is a message of its own on the carrier NIC.
    net_max_recvs: int = 8
    rail_optimized: bool = True
    oversubscription: float = 1.0  # scale-out leaf-to-spine oversubscription (1 = non-blocking)
    pod_gpus: int = 0  # GPUs under one leaf group; traffic leaving it shares uplinks (0 = one pod)
    nvlink_efficiency: float | None = None
    scaleout_efficiency: float | None = None
    phase_latency_us: float | None = None
    nvlink_peer_latency_us: float | None = None
    scaleout_peer_latency_us: float | None = None
    dense_tflops_bf16: float | None = None  # one GPU's dense BF16 tensor peak, TFLOP/s (None: not stated)
    dense_tflops_fp8: float | None = None  # one GPU's dense FP8 tensor peak, TFLOP/s (None: not stated)
    source: str = ""  # file the spec was read from

    @property
    def ranks_per_host(self) -> int:
        return self.gpus_per_host or self.gpus_per_domain

    @property
    def nvlink_GBps_bidirectional(self) -> float:
        return 2.0 * self.nvlink_GBps_per_direction

    @property
    def nic_GBps_per_direction(self) -> float:
        """Scale-out bandwidth per GPU, one way, in GB/s (800 Gb/s -> 100 GB/s)."""
        return self.nic_Gbps_per_direction / 8.0

    @property
    def domain_aggregate_GBps_bidirectional(self) -> float:
        return (
            self.aggregate_GBps_bidirectional or 2.0 * self.gpus_per_domain * self.nvlink_GBps_per_direction
        )

    def aggregate_GBps_per_direction(self, ranks: int) -> float:
        """The domain's aggregate one way, scaled to ``ranks`` GPUs (NVL72: 65 TB/s x ranks / 72)."""
        return self.domain_aggregate_GBps_bidirectional / 2.0 * ranks / self.gpus_per_domain

    def describe(self) -> str:
        return (
            f"{self.name}: NVLink {self.nvlink_GBps_per_direction:g} GB/s per GPU per direction "
            f"({self.nvlink_GBps_bidirectional:g} bidirectional), {self.gpus_per_domain} GPUs per NVLink "
            f"domain, aggregate {self.domain_aggregate_GBps_bidirectional:g} GB/s bidirectional; scale-out "
            f"{self.nic_Gbps_per_direction:g} Gb/s = {self.nic_GBps_per_direction:g} GB/s per GPU per "
            "direction"
        )


def list_specs() -> list[str]:
    """Names of the shipped specs."""
    root = resources.files("commbench.inputs").joinpath("catalogue")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def _looks_like_path(text: str) -> bool:
    return text.endswith((".yaml", ".yml")) or os.sep in text or "/" in text or os.path.isfile(text)


def load_spec(name_or_path: str | SystemSpec | None = None) -> SystemSpec:
    """A shipped spec by name (default ``gb300-nvl72``) or a YAML file path; UsageError on bad input."""
    if isinstance(name_or_path, SystemSpec):
        return name_or_path
    text = (name_or_path or DEFAULT_SPEC_NAME).strip()
    if _looks_like_path(text):
        if not os.path.lexists(text):
            raise UsageError(
                f"spec file {text!r} does not exist; pass a shipped name ({', '.join(list_specs())})"
            )
        return parse_spec(read_user_text(text, "spec file"), source=text)  # bounded, UTF-8, a regular file
    if text not in list_specs():
        raise UsageError(
            f"unknown spec {text!r}; choose one of {', '.join(list_specs())} or pass a YAML file path"
        )
    data = (
        resources.files("commbench.inputs")
        .joinpath("catalogue")
        .joinpath(f"{text}.yaml")
        .read_text(encoding="utf-8")
    )
    return parse_spec(data, source=f"commbench/inputs/catalogue/{text}.yaml")


def parse_spec(text: str, source: str = "<string>") -> SystemSpec:
    """Validate YAML text into a SystemSpec; every problem is a one-line UsageError naming ``source``."""
    where = f"spec {source}"
    # Bounded YAML (size, aliases, tags, int64), a flat mapping of known keys to single values; see userfiles.
    data = load_yaml_mapping(text, where, _KEYS)
    return _validated(data, where, source)


def spec_from_dict(saved: Mapping[str, Any], where: str) -> SystemSpec:
    """A spec saved with ``dataclasses.asdict`` (meta.json's ``system_spec``) as a SystemSpec again, checked
    like a file (problems name ``where``). Keys this version does not know (``description_line``, keys of
    newer versions) are ignored; fields saved at their default stay at it (a default such as
    ``gpus_per_host: 0`` is not a valid file value)."""
    defaults = {f.name: f.default for f in fields(SystemSpec)}
    data = {key: value for key, value in saved.items() if key in _KEYS and value != defaults[key]}
    return _validated(data, f"spec in {where}", str(saved.get("source") or where))


def _validated(data: Mapping[str, Any], where: str, source: str) -> SystemSpec:
    missing = [k for k, (_, required) in _KEYS.items() if required and data.get(k) is None]
    if missing:
        raise UsageError(
            f"{where}: missing key(s) {', '.join(missing)}; see commbench/inputs/catalogue/gb300-nvl72.yaml"
        )
    values: dict[str, Any] = {"source": source}
    for key, raw in data.items():
        if raw is None:
            continue
        values[key] = _checked(where, key, raw)
    spec = SystemSpec(**values)
    if spec.gpus_per_host and spec.gpus_per_domain % spec.gpus_per_host:
        raise UsageError(
            f"{where}: gpus_per_domain {spec.gpus_per_domain} is not a multiple of gpus_per_host "
            f"{spec.gpus_per_host}; a host must sit inside one NVLink domain"
        )
    if spec.oversubscription < 1.0:
        raise UsageError(
            f"{where}: oversubscription {spec.oversubscription:g} < 1; use 1 for a non-blocking fabric"
        )
    if spec.transport not in TRANSPORTS:
        raise UsageError(f"{where}: transport {spec.transport!r} is not one of {', '.join(TRANSPORTS)}")
    for key in ("nvlink_efficiency", "scaleout_efficiency"):
        value = getattr(spec, key)
        if value is not None and value > 1.0:
            raise UsageError(f"{where}: {key} {value:g} > 1; an efficiency is a fraction of line rate")
    return spec


def _checked(where: str, key: str, raw: Any) -> Any:
    kind = _KEYS[key][0]
    shown = shorten(raw)  # a user's value is quoted in bounded length, whatever it is
    if kind is str:
        if not isinstance(raw, str) or len(raw) > 512:
            raise UsageError(f"{where}: {key} must be text of at most 512 characters, got {shown}")
        return raw
    if kind is bool:
        if not isinstance(raw, bool):
            raise UsageError(f"{where}: {key} must be true or false, got {shown}")
        return raw
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise UsageError(f"{where}: {key} must be a number, got {shown}")
    if isinstance(raw, int) and abs(raw) >= 1 << 63:  # float(raw) would overflow or lose the value
        raise UsageError(f"{where}: {key} is out of range, got {shown}")
    if kind is int and (not float(raw).is_integer()):
        raise UsageError(f"{where}: {key} must be a whole number, got {shown}")
    value = int(raw) if kind is int else float(raw)
    if not math.isfinite(value) or value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
        raise UsageError(f"{where}: {key} must be positive, got {shown}")
    return value


def no_spec(reason: str) -> SystemSpec:
    """The spec of a run with no hardware spec to compare with (a CPU run, a GPU the catalogue does not
    know): every figure NaN, so no %spec and no spec line is ever computed from it; ``description`` says
    why."""
    return SystemSpec(
        name=NO_SPEC_NAME,
        gpus_per_domain=1,
        nvlink_GBps_per_direction=math.nan,
        nic_Gbps_per_direction=math.nan,
        description=reason,
    )


def has_figures(spec: SystemSpec) -> bool:
    """Whether ``spec`` has figures to compare with (False for ``no_spec``)."""
    return spec.name != NO_SPEC_NAME and math.isfinite(spec.nvlink_GBps_per_direction)

"""Calibration cases: published all-to-all figures as the fabric model predicts them, from two data files.

``calibration.yaml`` holds the cases the model was first calibrated on, in this module's terms.
``published.yaml`` (when shipped) holds the published measurements gathered from the EP libraries' READMEs,
papers and cloud benchmark posts, in their own terms (its header and docs/fabric-model.md describe the
fields); ``published_case`` maps each entry to a ``CalibrationCase`` or says why the model cannot
predict it (no catalogue spec for the GPU, a figure whose bytes are not defined, ...). Entries marked
``untrusted`` keep their reason and are listed, never fitted or scored; entries marked ``in_fit`` are the
calibration.yaml cases again and are skipped there.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from commbench.fabric.engines import REFERENCE_LIBRARY
from commbench.inputs.userfiles import load_package_yaml

# What a published figure is (calibration.yaml's header defines each); the engine that produced it.
KIND_KERNEL = {
    "nccl_busbw": "nccl",
    "nccl_time_us": "nccl",
    "deepep_dispatch": "normal",
    "deepep_combine": "normal",
    "ep_dispatch_us": "normal",
    "ep_combine_us": "normal",
    "ll_dispatch_us": "low-latency",
    "ll_combine_us": "low-latency",
    "ll_dispatch_GBps": "low-latency",
    "ll_combine_GBps": "low-latency",
}
KINDS = tuple(KIND_KERNEL)
# Regimes the accuracy is stated for (docs/fabric-model.md): one node or one NVL72 rack; nccl-tests-style
# all-to-all across NVLink domains; GPU-initiated EP kernels across nodes; low-latency (decode) kernels.
REGIMES = ("node_or_rack", "nccl_multinode", "ep_multinode", "low_latency")
CASE_FILES = ("calibration.yaml", "published.yaml")
# GPU as published -> catalogue spec (commbench/inputs/catalogue); other GPUs are listed as not modelled.
GPU_SPECS = {
    "H800": "hgx-h800",
    "H100": "hgx-h100",
    "H200": "hgx-h200",
    "B200": "hgx-b200",
    "GB200": "gb200-nvl72",
    "GB300": "gb300-nvl72",
    # Same NVLink as a catalogue spec; the case's own NIC line rate (nic_gbps) replaces the spec's:
    "B300": "hgx-b200",  # HGX B300: NVLink 5 (900 GB/s per direction, as B200), ConnectX-8 800 Gb/s
    "H20": "hgx-h100",  # HGX H20: NVLink 4 with 18 links (900 GB/s bidirectional, as H100)
}
GPU_NIC_GBPS = {"B300": 800.0}  # where a case states no NIC rate and its spec's differs (ConnectX-8)
# published.yaml's library -> whose kernels ran (fabric.engines.LIBRARIES); others run the reference's.
CASE_LIBRARY = {
    "deepep-normal": "deepep",
    "deepep-ll": "deepep",
    "deepep-v2": "deepep-v2",
    "hybrid-ep": "hybrid-ep",
    "uccl-ep": "uccl-ep",
    "uccl-ep-ll": "uccl-ep",
    "pplx": "pplx",
    "trtllm-nvlink-one-sided": "trtllm",
    "nccl-ep": "nccl-ep",
}


@dataclass(frozen=True)
class CalibrationCase:
    """One published figure: what was run (spec, ranks, NVLink domain size), what was measured, and where."""

    label: str
    spec: str
    world_size: int
    ranks_per_domain: int
    metric: str  # what the published number is, e.g. "busbw GB/s"
    published: float
    source: str
    kind: str  # one of KINDS
    size_bytes: int = 0  # nccl-tests size (bytes per rank)
    note: str = ""  # set when the model does not explain the figure
    untrusted: str = ""  # why the figure is not used to fit or judge the model (listed, never dropped)
    regime: str = ""  # one of REGIMES; "" = from the kind and the layout
    series: str = ""  # cases of one table share conditions; the fit weighs every series alike
    transport: str = ""  # "" = the spec's
    nic_gbps: float = 0.0  # the GPU's NIC line rate as run, Gb/s per direction; 0 = the spec's
    ranks_per_host: int = 0  # 0 = the spec's
    net_max_recvs: int = 0  # nccl net plugin's grouped receives (the spec's net_max_recvs); 0 = the spec's
    sms: int = 0  # SMs the kernel ran on; 0 = the engine's default
    tokens: int = 0  # tokens per rank of an EP case; 0 = DeepEP's test default for the kind
    hidden: int = 0  # 0 = DeepEP's 7168
    experts: int = 0  # 0 = DeepEP's 256
    topk: int = 0  # 0 = DeepEP's 8
    max_nodes: int = 4  # group-limited routing: nodes per token (DeepEP's tests: 4); 0 = no limit
    dispatch_fp8: bool = True  # FP8 dispatch rows (hidden + scales) rather than BF16
    cuda_graph: bool = False  # the figure excludes launch cost (CUDA graph, or kernel time from a profiler)
    torch_api: bool = False  # timed around the library's Python call (pre- and post-processing included)
    per_rank: bool = (
        False  # a low-latency kernel sending each token once per destination rank, not per expert
    )
    library: str = REFERENCE_LIBRARY  # whose kernels ran a GPU-initiated engine (fabric.engines.LIBRARIES)

    @property
    def kernel(self) -> str:
        return KIND_KERNEL[self.kind]

    @property
    def case_regime(self) -> str:
        if self.regime:
            return self.regime
        if self.kernel == "low-latency":
            return REGIMES[3]
        if self.world_size <= self.ranks_per_domain:
            return REGIMES[0]
        return REGIMES[1] if self.kernel == "nccl" else REGIMES[2]


@dataclass(frozen=True)
class NotModelled:
    """A published figure the model cannot predict, and why (listed beside the table)."""

    label: str
    regime: str
    source: str
    reason: str


def _read(file_name: str) -> dict[str, Any]:
    return load_package_yaml("commbench.fabric", file_name)


def _own_cases(data: Mapping[str, Any]) -> list[CalibrationCase]:
    known = {f.name for f in fields(CalibrationCase)}
    cases = []
    for entry in data.get("cases") or []:
        unknown = sorted(set(entry) - known)
        if unknown or entry.get("kind") not in KINDS or entry.get("regime", REGIMES[0]) not in REGIMES:
            raise ValueError(
                f"calibration.yaml, case {entry.get('label')!r}: unknown keys {unknown}, kind "
                f"{entry.get('kind')!r} not one of {', '.join(KINDS)}, or regime not one of {REGIMES}"
            )
        cases.append(CalibrationCase(**{**entry, "published": float(entry["published"])}))
    return cases


def _first_int(value: Any) -> int:
    match = re.match(r"\s*(\d+)", str(value or ""))
    return int(match.group(1)) if match else 0


def _kind(entry: Mapping[str, Any]) -> str | None:
    library, metric, phase = entry.get("library", ""), entry.get("metric", ""), entry.get("phase")
    combine = phase == "combine"
    if library == "nccl-tests alltoall_perf":
        return {"busbw GB/s": "nccl_busbw", "time us": "nccl_time_us"}.get(metric)
    if library.startswith("nccl (ncclAlltoAll") and metric.startswith("time us"):
        return "nccl_time_us"
    if library in ("deepep-normal", "uccl-ep", "hybrid-ep") and metric == "time us":
        return "ep_combine_us" if combine else "ep_dispatch_us"
    if library in ("deepep-normal", "uccl-ep", "hybrid-ep", "deepep-v2") and "GB/s" in metric:
        if "max over" in metric or "peak" in metric:
            return None  # a maximum over ranks or sizes, not the figure of one run
        return "deepep_combine" if combine else "deepep_dispatch"
    if library in ("deepep-ll", "uccl-ep-ll", "pplx", "trtllm-nvlink-one-sided") and (
        metric == "time us" or metric.startswith("time us (mean")
    ):
        return "ll_combine_us" if combine else "ll_dispatch_us"
    if library == "nccl-ep" and "BW (GB/s)" in metric:
        return "ll_combine_GBps" if combine else "ll_dispatch_GBps"
    return None


def published_case(entry: Mapping[str, Any], sources: Mapping[str, Any]) -> CalibrationCase | NotModelled:
    """One ``published.yaml`` entry as a case the model predicts, or the reason it cannot."""
    label, regime = str(entry["label"]), str(entry.get("regime", ""))
    source_id = str(entry.get("source", ""))
    where = sources.get(source_id) or {}
    source = " ".join(str(where.get(k, "")) for k in ("repo", "path")).strip()
    if source and where.get("commit"):
        source += f"@{str(where['commit'])[:8]}"  # one README at two commits: two sources
    source = source or str(where.get("url", source_id))
    kind = _kind(entry)
    spec = GPU_SPECS.get(str(entry.get("gpu", "")))
    if kind is None:
        reason = f"{entry.get('library')} {entry.get('metric')!r}: no model of this figure"
        if entry.get("untrusted"):
            reason += f" (and untrusted: {entry['untrusted']})"
        return NotModelled(label, regime, source, reason)
    if spec is None:
        return NotModelled(label, regime, source, f"no catalogue spec for GPU {entry.get('gpu')!r}")
    per_node = int(entry.get("gpus_per_node") or 8)
    per_domain = int(entry.get("ranks_per_domain") or per_node)
    # ranks_per_domain 1: every peer over the NIC (DeepEP's low-latency kernels before NVLink P2P, #173).
    transport = str(entry.get("transport") or "")
    size = int(entry.get("size_bytes") or 0)
    if kind == "nccl_time_us" and not size and entry.get("message_bytes"):
        size = int(entry["message_bytes"]) * int(entry["world_size"])
    if kind.startswith("nccl") and not size:
        return NotModelled(label, regime, source, "no size_bytes: the bytes moved are not stated")
    experts = entry.get("num_experts")
    if kind.startswith("ll") and not experts:
        # Not stated: DeepSeek-V3's 256 routed experts, the setting the low-latency tables follow (its tests'
        # default of 288 does not divide EP64-EP256, which DeepEP's buffer requires).
        experts = 256
    return CalibrationCase(
        label=label,
        spec=spec,
        world_size=int(entry["world_size"]),
        ranks_per_domain=per_domain,
        metric=str(entry.get("metric", "")),
        published=float(entry["published"]),
        source=source,
        kind=kind,
        size_bytes=size,
        untrusted=str(entry.get("untrusted") or ""),
        regime=regime if regime in REGIMES else "",
        series=str(entry.get("series") or source_id),
        transport=transport if transport in ("infiniband", "roce", "efa") else "",
        nic_gbps=float(entry.get("nic_gbps") or GPU_NIC_GBPS.get(str(entry.get("gpu")), 0)),
        ranks_per_host=per_node if per_node <= per_domain and per_domain % per_node == 0 else 0,
        net_max_recvs=int(entry.get("net_max_recvs") or 0),
        sms=_first_int(entry.get("sms")),
        tokens=int(entry.get("tokens_per_rank") or 0),
        hidden=int(entry.get("hidden") or 0),
        experts=int(experts or 0),
        topk=int(entry.get("topk") or 0),
        max_nodes=int(entry.get("topk_groups") or 0),
        dispatch_fp8=str(entry.get("dtype") or "fp8").lower().startswith(("fp8", "mxfp8")),
        cuda_graph=entry.get("timing") == "kernel_only" or "CUDA graph" in str(entry.get("notes", "")),
        torch_api=entry.get("timing") == "torch_api",
        # TensorRT-LLM's one-sided NVLink kernels write a token once per destination rank (its notes'
        # bytes: batch x min(ep, top-k) x token bytes).
        per_rank=str(entry.get("library")) == "trtllm-nvlink-one-sided",
        library=CASE_LIBRARY.get(str(entry.get("library")), REFERENCE_LIBRARY),
    )


@functools.lru_cache(maxsize=1)
def _all_cases() -> tuple[tuple[CalibrationCase, ...], tuple[NotModelled, ...]]:
    cases = _own_cases(_read(CASE_FILES[0]))
    skipped: list[NotModelled] = []
    published = _read(CASE_FILES[1])
    for entry in published.get("cases") or []:
        if entry.get("in_fit"):
            continue  # the same figure is a calibration.yaml case
        case = published_case(entry, published.get("sources") or {})
        (skipped if isinstance(case, NotModelled) else cases).append(case)  # type: ignore[arg-type]
    return tuple(cases), tuple(skipped)


def calibration_cases() -> tuple[CalibrationCase, ...]:
    """The cases of calibration.yaml, then those of published.yaml the model predicts, in file order."""
    return _all_cases()[0]


def not_modelled() -> tuple[NotModelled, ...]:
    """The ``published.yaml`` entries the model cannot predict, each with the reason."""
    return _all_cases()[1]

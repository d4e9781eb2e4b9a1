"""Which catalogue spec describes this machine: chosen from detected hardware facts, with how it was chosen.

``choose_spec(facts)`` is a pure function of ``HardwareFacts`` (GPU names as NVML reports them, NVLink links
per GPU, whether the GPUs registered in a multi-node NVLink fabric clique, GPUs per host);
``facts_from_probe`` builds the facts from ``commbench.hardware.probes.probe_gpus()``'s answer. ``--spec``
overrides the choice.
No GPU: no spec at all (a CPU run is never compared with a GPU fabric).

The rules (NVML names: "NVIDIA GB300", "NVIDIA GB200", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H800",
"NVIDIA B200"; PCIe and NVL cards say "PCIe" or "NVL" in the name):

- GB300 -> gb300-nvl72, GB200 -> gb200-nvl72 (the GPU of an NVL72 rack; without a registered fabric clique
  the choice says that multi-node NVLink is not up, so the NVLink domain is the host);
- B200 -> hgx-b200, or gb200-nvl72 when it sits in a fabric clique with at most 4 GPUs per host (a tray);
- H100 / H200 / H800 SXM -> hgx-h100 / hgx-h200 / hgx-h800, checked against the spec's NVLink link count
  when NVML reports it (H100 and H200 SXM: 18 links; H800 SXM: 8);
- PCIe / NVL cards, other GPUs and mixed GPUs: None, with the reason and ``--spec``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

CPU_RUN_TEXT = "CPU run: no GPU found, figures measure this host's memory and loopback, not a GPU fabric"

# (name pattern, spec, NVLink links per GPU of that spec's SXM part), first match wins: GB before B.
_RULES: tuple[tuple[str, str, int], ...] = (
    (r"\bGB300\b", "gb300-nvl72", 18),
    (r"\bGB200\b", "gb200-nvl72", 18),
    (r"\bB200\b", "hgx-b200", 18),
    (r"\bH100\b", "hgx-h100", 18),
    (r"\bH200\b", "hgx-h200", 18),
    (r"\bH800\b", "hgx-h800", 8),
)
_NOT_SXM = re.compile(r"\b(PCIE|NVL)\b")  # "H100 PCIe", "H100 NVL", "H200 NVL": PCIe cards
_TRAY_GPUS = 4  # GPUs per compute tray (host) of an NVL72 rack: 18 trays x 4


@dataclass(frozen=True)
class HardwareFacts:
    """What the machine shows, as plain values (so that choosing a spec is a pure, testable function).

    ``gpu_names``: every visible GPU's NVML name; ``nvlink_links``: NVLink links present per GPU (same
    order; empty or 0 = not reported); ``fabric_cluster_uuids``: each GPU's multi-node NVLink fabric cluster
    ("" when not registered); ``gpus_per_host``: GPUs on one host (0 = unknown); ``cuda_devices``: devices
    torch sees (a GPU NVML cannot name still counts); ``nvml_error``: why NVML saw nothing, if it did not.
    """

    gpu_names: tuple[str, ...] = ()
    nvlink_links: tuple[int, ...] = ()
    fabric_cluster_uuids: tuple[str, ...] = ()
    gpus_per_host: int = 0
    cuda_devices: int = 0
    nvml_error: str = ""


class SpecChoice(NamedTuple):
    """The chosen spec name (None: no spec, a CPU run or an unknown GPU) and one line saying how."""

    name: str | None
    how: str


def facts_from_probe(probe: Mapping[str, Any], cuda_devices: int = 0) -> HardwareFacts:
    """Facts from ``probe_gpus()``'s answer (``{"gpus": [{"name", "nvlink_links", "fabric_cluster_uuid"},
    ...], "error": ...}``); names NVML could not read ("? (...)") are left out."""
    gpus = [gpu for gpu in probe.get("gpus") or [] if isinstance(gpu, Mapping)]
    named = [gpu for gpu in gpus if str(gpu.get("name", "")) and not str(gpu.get("name")).startswith("?")]
    return HardwareFacts(
        gpu_names=tuple(str(gpu["name"]) for gpu in named),
        nvlink_links=tuple(int(gpu.get("nvlink_links") or 0) for gpu in named),
        fabric_cluster_uuids=tuple(str(gpu.get("fabric_cluster_uuid") or "") for gpu in named),
        gpus_per_host=len(gpus),
        cuda_devices=int(cuda_devices),
        nvml_error=str(probe.get("error") or ""),
    )


def choose_spec(facts: HardwareFacts, override: str | None = None) -> SpecChoice:
    """The spec for ``facts``, or ``override`` (``--spec``) when given, with a one-line reason."""
    detected = _detect(facts)
    if override:
        seen = f"detected: {detected.name}" if detected.name else f"detection: {detected.how}"
        return SpecChoice(override, f"--spec {override} (given; {seen})")
    return detected


def _detect(facts: HardwareFacts) -> SpecChoice:
    if not facts.gpu_names:
        if facts.cuda_devices:
            why = f" ({facts.nvml_error})" if facts.nvml_error else ""
            return SpecChoice(
                None,
                f"{facts.cuda_devices} CUDA device(s) but NVML named none{why}: no spec chosen; "
                "pass --spec NAME",
            )
        return SpecChoice(None, CPU_RUN_TEXT)
    names = sorted(set(facts.gpu_names))
    if len(names) > 1:
        return SpecChoice(None, f"mixed GPUs ({', '.join(names)}): no one spec fits; pass --spec NAME")
    name = names[0]
    upper = name.upper()
    count = f"{len(facts.gpu_names)} x {name}"
    rule = next(((spec, links) for pattern, spec, links in _RULES if re.search(pattern, upper)), None)
    if rule is None:
        return SpecChoice(None, f"{count}: no catalogue spec for this GPU; pass --spec NAME or a spec file")
    spec, spec_links = rule
    if _NOT_SXM.search(upper):
        return SpecChoice(
            None, f"{count}: a PCIe/NVL card, not an HGX/NVL72 system; pass --spec with a spec file for it"
        )
    links = max(facts.nvlink_links, default=0)
    if links and spec.startswith("hgx-") and links != spec_links:
        return SpecChoice(
            None,
            f"{count} with {links} NVLink links per GPU, but {spec} has {spec_links}: not that system; "
            "pass --spec NAME",
        )
    link_text = f", {links} NVLink links per GPU" if links else ", NVLink links not reported"
    clusters = {uuid for uuid in facts.fabric_cluster_uuids if uuid}
    per_host = facts.gpus_per_host
    if spec == "hgx-b200" and clusters and 0 < per_host <= _TRAY_GPUS:
        spec = "gb200-nvl72"
        return SpecChoice(
            spec, f"{count}{link_text}, in NVLink fabric clique(s), {per_host} per host (a tray) -> {spec}"
        )
    if spec.endswith("-nvl72"):
        if clusters:
            return SpecChoice(spec, f"{count}{link_text}, in an NVLink fabric clique (NVL72) -> {spec}")
        return SpecChoice(
            spec,
            f"{count}{link_text}, NO NVLink fabric clique reported (multi-node NVLink not up: the NVLink "
            f"domain is this host; check `nvidia-smi -q` Fabric state) -> {spec}",
        )
    return SpecChoice(spec, f"{count}{link_text} -> {spec}")


def describe_choice(choice: SpecChoice) -> str:
    """The line a report prints: "spec: gb300-nvl72 (4 x NVIDIA GB300, ...)" or the CPU-run line."""
    return f"spec: {choice.name} ({choice.how})" if choice.name else f"spec: none ({choice.how})"

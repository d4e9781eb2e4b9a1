"""Preflight findings: each GPU's facts against the spec and the other ranks, before anything is measured.

``preflight_elements`` judges the ``GpuHealth`` of every rank (group "preflight"): GPUs per host and per
NVLink domain, NVLink links up (against the spec's ``nvlink_links_per_gpu``) and their speed, ECC,
persistence, one driver / CUDA driver / NCCL version across the job, the fabric registration and clique
(only where the spec's NVLink domain spans hosts). A finding (WARN, FAIL) is one element naming the rank,
host and GPU; the GPUs that pass one check share one PASS element, those that could not be checked one SKIP
per reason (``gather``, which ``judge.counters`` shares for the counters after the run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from commbench.hardware.health import CounterSnapshot, GpuHealth
from commbench.inputs.specs import SystemSpec, has_figures
from commbench.report.judge.verdict import Element

PREFLIGHT = "preflight"
NO_SPEC = "no GPU spec to compare with"
_LINKS_REMEDY = (
    "`nvidia-smi nvlink -s` on that host shows each link's state and speed; reset the GPU, then reseat or "
    "replace the tray (or its NVLink cable cartridge) if the link stays down or slow"
)
_COUNT_REMEDY = "`nvidia-smi -L` on that host; `dmesg | grep -i xid` (Xid 79: fallen off the bus); reseat"
_ECC_REMEDY = "`nvidia-smi -q -d ECC` on that host; `nvidia-smi -e 1` and a GPU reset turn ECC on"
_PERSISTENCE_REMEDY = "run nvidia-persistenced (or `nvidia-smi -pm 1`) on that host"
_VERSION_REMEDY = "install one driver, CUDA and NCCL (torch) version on every host of the job"
_FABRIC_REMEDY = (
    "`nvidia-smi -q | grep -A8 -i fabric` on that host; check nvidia-imex and the NVLink switch trays' "
    "fabric manager (NMX), and that the tray belongs to the rack's partition"
)


@dataclass(frozen=True)
class Finding:
    """One subject's (a rank's GPU, a host, a clique) outcome of one check. ``message``: the full line of
    a WARN or FAIL, the shared text of a PASS, the reason of a SKIP."""

    status: str
    message: str
    measured: Any = None
    limit: Any = None
    unit: str = ""
    remedy: str = ""


def skip(reason: str) -> Finding:
    """A subject that could not be checked, and why."""
    return Finding("SKIP", reason)


def rank_label(rank: int, item: GpuHealth | CounterSnapshot, names: Mapping[int, str] | None) -> str:
    """The rank as messages name it: "rank 5 (host h2, GPU 1 [0000:19:00])", or the caller's name."""
    if names and names.get(rank):
        return f"rank {rank} ({names[rank]})"
    gpu = f"GPU {item.device}" + (f" [{item.bus_id}]" if item.bus_id else "") if item.device >= 0 else "CPU"
    return f"rank {rank} (host {item.host}, {gpu})"


def _ranks_text(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 5] -> "ranks 0-3, 5"."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _subjects_text(keys: Sequence[int | str]) -> str:
    if all(isinstance(key, int) for key in keys):
        return _ranks_text(keys)  # type: ignore[arg-type]
    return ", ".join(str(key) for key in keys)


def gather(group: str, check: str, findings: Mapping[int | str, Finding]) -> list[Element]:
    """One element per WARN / FAIL subject ("<check>: rank 5" / "<check>: host h2"), one SKIP per reason,
    one PASS per shared text; in that order."""
    out = []
    for key, found in findings.items():
        if found.status in ("WARN", "FAIL"):
            subject = f"rank {key}" if isinstance(key, int) else str(key)
            fields = (found.message, found.measured, found.limit, found.unit, found.remedy)
            out.append(Element(group, f"{check}: {subject}", found.status, *fields))
    for status, suffix in (("SKIP", ": not checked"), ("PASS", "")):
        by_text: dict[str, list[int | str]] = {}
        for key, found in findings.items():
            if found.status == status:
                by_text.setdefault(found.message, []).append(key)
        for n, (text, keys) in enumerate(by_text.items()):
            name = f"{check}{suffix}" + (f" #{n + 1}" if n else "")
            where = _subjects_text(keys)
            line = f"{check} not checked on {where}: {text}" if status == "SKIP" else f"{text}: {where}"
            limit = next(findings[k].limit for k in keys)
            out.append(Element(group, name, status, line, None, limit, findings[keys[0]].unit))
    return out


def _per_gpu(check: str, healths: Sequence[GpuHealth], judge: Any) -> list[Element]:
    findings = {
        rank: skip(h.skipped["gpu"]) if "gpu" in h.skipped else judge(rank, h)
        for rank, h in enumerate(healths)
    }
    return gather(PREFLIGHT, check, findings)


def _links_text(links: Sequence[int]) -> str:
    return f"link{'s' if len(links) > 1 else ''} {', '.join(str(link) for link in links)}"


def _judge_links(label: str, h: GpuHealth, spec: SystemSpec | None) -> Finding:
    """Active links against the spec's ``nvlink_links_per_gpu``. Without that count nothing says how many
    links should be up (a single-GPU VM shows its links present and inactive): no FAIL; some up and some
    not WARNs, none up SKIPs."""
    if "nvlink" in h.skipped:
        return skip(h.skipped["nvlink"])
    present = set(h.nvlink_active) | set(h.nvlink_inactive)
    up = len(h.nvlink_active)
    expected = spec.nvlink_links_per_gpu if spec is not None else 0
    if not expected:
        why = NO_SPEC if spec is None else f"spec {spec.name} states no NVLink link count"
        if not up:
            return skip(f"{len(present)} NVLink links present, none active; {why} (NVLink not in use here?)")
        if h.nvlink_inactive:
            message = (
                f"{label}: {up} of {len(present)} NVLink links up ({_links_text(sorted(h.nvlink_inactive))} "
                f"down); {why}: not judged as a failure"
            )
            return Finding("WARN", message, up, len(present), "links", _LINKS_REMEDY)
        return Finding("PASS", f"all {up} present NVLink links up ({why})", up, None, "links")
    if up >= expected:
        return Finding("PASS", f"{expected} of {expected} NVLink links up", up, expected, "links")
    # Down: reported inactive, or not reported at all below the number the spec expects.
    down = sorted(set(h.nvlink_inactive) | {link for link in range(expected) if link not in present})
    message = f"{label}: {up} of {expected} NVLink links up ({_links_text(down)} down)"
    return Finding("FAIL", message, up, expected, "links", _LINKS_REMEDY)


def _judge_speed(label: str, h: GpuHealth, spec: SystemSpec | None) -> Finding:
    if spec is None:
        return skip(NO_SPEC)
    if not spec.nvlink_links_per_gpu:
        return skip(f"spec {spec.name} states no NVLink link count: no per-link speed to expect")
    if "nvlink_speed" in h.skipped:
        return skip(h.skipped["nvlink_speed"])
    # The spec's per-direction NVLink figure is the GPU's data rate over all its links, so one link carries
    # figure / links (H100: 450 / 18 = 25 GB/s). NVML reports each link's raw signalling rate one way in
    # MB/s (H100: 26,562), a little above the data rate, so a healthy link reads at or above the expected
    # figure and a link trained at a lower rate (or fewer lanes) reads below it.
    expected = spec.nvlink_GBps_per_direction * 1000.0 / spec.nvlink_links_per_gpu
    speeds = h.nvlink_speed_MBps or dict.fromkeys(h.nvlink_active, h.nvlink_common_speed_MBps or 0)
    slow = sorted(link for link, speed in speeds.items() if speed < expected)
    text = f"{expected / 1000:g} GB/s per link ({spec.name}: {spec.nvlink_GBps_per_direction:g} GB/s / "
    text += f"{spec.nvlink_links_per_gpu} links)"
    if not slow:
        return Finding("PASS", f"every active NVLink link at >= {text}", None, round(expected), "MB/s")
    lowest = min(speeds[link] for link in slow)
    message = f"{label}: NVLink {_links_text(slow)} at {lowest / 1000:.1f} GB/s < {text}"
    return Finding("WARN", message, lowest, round(expected), "MB/s", _LINKS_REMEDY)


def _judge_ecc(label: str, h: GpuHealth) -> Finding:
    if "ecc" in h.skipped:
        return skip(h.skipped["ecc"])
    if not h.ecc_current:
        message = f"{label}: ECC off" + (" (on after the next GPU reset)" if h.ecc_pending else "")
        return Finding("WARN", message, "off", "on", "", _ECC_REMEDY)
    if not h.ecc_pending:
        message = f"{label}: ECC on, but off after the next GPU reset (a change is pending)"
        return Finding("WARN", message, "on, pending off", "on", "", _ECC_REMEDY)
    return Finding("PASS", "ECC on", limit="on")


def _judge_persistence(label: str, h: GpuHealth) -> Finding:
    if "persistence" in h.skipped:
        return skip(h.skipped["persistence"])
    if not h.persistence:
        message = f"{label}: persistence mode off (the driver may unload between jobs; slower starts)"
        return Finding("WARN", message, "off", "on", "", _PERSISTENCE_REMEDY)
    return Finding("PASS", "persistence mode on", limit="on")


def _judge_fabric(label: str, h: GpuHealth, spec: SystemSpec | None) -> Finding:
    """The multi-node NVLink fabric registration, judged only where the spec's NVLink domain spans hosts
    (an NVL72 rack): on one host (or without a spec) the NVLink domain is the host and a fabric state that
    is not "completed" (a single-GPU VM: "not started") is only reported."""
    if "fabric" in h.skipped:
        return skip(f"fabric info not readable: {h.skipped['fabric']}")
    multi_host = spec is not None and spec.gpus_per_domain > spec.ranks_per_host
    if not multi_host:
        if h.fabric_state == "completed" and not h.fabric_status:
            return Finding("PASS", "NVLink fabric registration completed", limit="completed")
        why = NO_SPEC if spec is None else f"{spec.name}'s NVLink domain is one host"
        if h.fabric_state == "not supported":
            return skip(f"no multi-node NVLink fabric on this GPU; {why}: the NVLink domain is the host")
        state = h.fabric_state + (f", NVML status {h.fabric_status}" if h.fabric_status else "")
        return skip(f"NVLink fabric registration {state}; {why}: the fabric is not judged")
    assert spec is not None
    if h.fabric_state == "not supported":
        message = (
            f"{label}: GPU has no multi-node NVLink fabric, but {spec.name} has {spec.gpus_per_domain} "
            "GPUs per NVLink domain across hosts"
        )
        return Finding("FAIL", message, h.fabric_state, "completed", "", _FABRIC_REMEDY)
    if h.fabric_state != "completed":
        message = f"{label}: NVLink fabric registration {h.fabric_state} (not completed)"
        return Finding("FAIL", message, h.fabric_state, "completed", "", _FABRIC_REMEDY)
    if h.fabric_status:
        message = f"{label}: NVLink fabric registration failed (NVML status {h.fabric_status})"
        return Finding("FAIL", message, h.fabric_status, 0, "", _FABRIC_REMEDY)
    return Finding("PASS", "NVLink fabric registration completed", limit="completed")


def _host_gpus(healths: Sequence[GpuHealth]) -> dict[str, int | None]:
    """host -> GPUs NVML sees there (None: no rank there could read it)."""
    counts: dict[str, int | None] = {}
    for h in healths:
        known = [count for count in (counts.get(h.host), h.host_gpu_count) if count is not None]
        counts[h.host] = max(known) if known else None
    return counts


def _gpu_count(healths: Sequence[GpuHealth], spec: SystemSpec | None) -> list[Element]:
    if spec is None:
        return gather(PREFLIGHT, "GPUs per host", {"every host": skip(NO_SPEC)})
    expected = spec.ranks_per_host
    reasons = {h.host: h.skipped.get("gpu", "GPU count not read") for h in healths}
    findings: dict[int | str, Finding] = {}
    for host, count in _host_gpus(healths).items():
        key = f"host {host}"
        if count is None:
            findings[key] = skip(reasons[host])
        elif count < expected:
            message = f"host {host}: {count} GPU(s) visible to NVML, {spec.name} has {expected} per host"
            findings[key] = Finding("FAIL", message, count, expected, "GPUs", _COUNT_REMEDY)
        else:
            more = (
                f"host {host}: {count} GPUs visible to NVML, more than {spec.name}'s {expected}: wrong spec?"
            )
            status, text = ("WARN", more) if count > expected else ("PASS", f"{expected} GPUs per host")
            findings[key] = Finding(status, text, count, expected, "GPUs", "pass --spec for this system")
    return gather(PREFLIGHT, "GPUs per host", findings)


def _clique_of(h: GpuHealth) -> str:
    """The NVLink domain a registered GPU is in ("" when it is not registered)."""
    registered = h.fabric_state == "completed" and not h.fabric_status and h.fabric_cluster_uuid
    return f"clique {h.fabric_cluster_uuid}:{h.fabric_clique_id}" if registered else ""


def _domains(healths: Sequence[GpuHealth], spec: SystemSpec | None) -> list[Element]:
    """GPUs per NVLink domain (fabric clique) against the spec, and each host's GPUs in one clique."""
    if spec is None or spec.gpus_per_domain <= spec.ranks_per_host:
        return []  # the domain is one host: "GPUs per host" checks it
    cliques: dict[str, set[str]] = {}
    host_cliques: dict[str, set[str]] = {}
    for h in healths:
        if _clique_of(h):
            cliques.setdefault(_clique_of(h), set()).add(h.host)
            host_cliques.setdefault(h.host, set()).add(_clique_of(h))
    if not cliques:
        return gather(PREFLIGHT, "GPUs per NVLink domain", {"every host": skip("no GPU reports a clique")})
    counts, expected = _host_gpus(healths), spec.gpus_per_domain
    job_gpus = len({(h.host, h.uuid) for h in healths if h.uuid})
    findings: dict[int | str, Finding] = {}
    for clique, hosts in cliques.items():
        count = sum(counts[host] or 0 for host in hosts)
        where = f"{clique} ({len(hosts)} host(s))"
        if count == expected:
            findings[clique] = Finding("PASS", f"{expected} GPUs per NVLink domain", count, expected, "GPUs")
        elif count > expected or job_gpus >= expected:
            message = f"{where} holds {count} GPUs, {spec.name} has {expected} per NVLink domain"
            findings[clique] = Finding("FAIL", message, count, expected, "GPUs", _FABRIC_REMEDY)
        else:
            partial = (
                f"the job's hosts hold {count} of the domain's {expected} GPUs (part of a domain: not judged)"
            )
            findings[clique] = skip(partial)
    out = gather(PREFLIGHT, "GPUs per NVLink domain", findings)
    spans: dict[int | str, Finding] = {}
    for host, seen in host_cliques.items():
        if len(seen) > 1:
            message = f"host {host}: its GPUs are in {len(seen)} NVLink cliques ({', '.join(sorted(seen))})"
            spans[f"host {host}"] = Finding("FAIL", message, len(seen), 1, "cliques", _FABRIC_REMEDY)
        else:
            spans[f"host {host}"] = Finding("PASS", "each host's GPUs in one NVLink clique", 1, 1, "cliques")
    return out + gather(PREFLIGHT, "fabric clique", spans)


def _versions(healths: Sequence[GpuHealth]) -> list[Element]:
    """One driver, CUDA driver and NCCL version across the job; the hosts with another one are named."""
    out = []
    for check, attribute, fact in (
        ("driver version", "driver_version", "driver"),
        ("CUDA driver version", "cuda_driver_version", "cuda_driver"),
        ("NCCL version", "nccl_version", "nccl"),
    ):
        ranks: dict[str, list[int]] = {}
        for rank, h in enumerate(healths):
            if getattr(h, attribute):
                ranks.setdefault(str(getattr(h, attribute)), []).append(rank)
        if not ranks:
            reason = next(filter(None, (h.skipped.get("gpu") or h.skipped.get(fact) for h in healths)), None)
            out += gather(PREFLIGHT, check, {"every rank": skip(reason or "no rank reported it")})
            continue
        common = max(ranks, key=lambda version: (len(ranks[version]), version))
        hosts = {v: sorted({healths[r].host for r in rs}) for v, rs in ranks.items()}
        if len(ranks) == 1:
            text = f"{check} {common} on {_ranks_text(ranks[common])} ({len(hosts[common])} host(s))"
            out.append(Element(PREFLIGHT, check, "PASS", text, common, common))
            continue
        odd = [
            f"{v} on host {', '.join(hosts[v])} ({_ranks_text(rs)})" for v, rs in ranks.items() if v != common
        ]
        message = (
            f"mixed {check}s in one job: {'; '.join(odd)}; {common} on the other {len(ranks[common])} rank(s)"
        )
        odd_versions = ", ".join(v for v in ranks if v != common)
        out.append(Element(PREFLIGHT, check, "FAIL", message, odd_versions, common, "", _VERSION_REMEDY))
    return out


def preflight_elements(
    healths: Sequence[GpuHealth], spec: SystemSpec | None = None, names: Mapping[int, str] | None = None
) -> list[Element]:
    """Group "preflight": every rank's GPU (``healths[rank]``) against ``spec`` (None or ``no_spec``: the
    checks that need figures SKIP) and against the other ranks. ``names``: rank -> "host h2, GPU 1 ..." for
    the messages (default: host, GPU ordinal and bus id from the health itself)."""
    if not healths:
        return [Element(PREFLIGHT, "GPU health", "SKIP", "no rank reported its GPU health")]
    if all("gpu" in h.skipped for h in healths):  # a CPU run, or no NVML anywhere: one SKIP says it all
        return gather(PREFLIGHT, "GPU health", {r: skip(h.skipped["gpu"]) for r, h in enumerate(healths)})
    spec = spec if spec is not None and has_figures(spec) else None

    def label(rank: int) -> str:
        return rank_label(rank, healths[rank], names)

    return [
        *_gpu_count(healths, spec),
        *_domains(healths, spec),
        *_per_gpu("NVLink links", healths, lambda r, h: _judge_links(label(r), h, spec)),
        *_per_gpu("NVLink speed", healths, lambda r, h: _judge_speed(label(r), h, spec)),
        *_per_gpu("ECC mode", healths, lambda r, h: _judge_ecc(label(r), h)),
        *_per_gpu("persistence mode", healths, lambda r, h: _judge_persistence(label(r), h)),
        *_per_gpu("NVLink fabric", healths, lambda r, h: _judge_fabric(label(r), h, spec)),
        *_versions(healths),
    ]

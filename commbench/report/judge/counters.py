"""Health findings: each rank's GPU counters after the run against before it, and the health.csv table.

``counter_elements`` judges the ``CounterSnapshot``s (group "health"): whether the GPU's NVLink error
counters could be read at all (a GPU with active links and none readable WARNs: never a SKIP that lets the
check pass without looking), each NVLink error counter its GPU has (NVLink 4: replay / recovery / CRC;
NVLink 5: the NVML_FI_DEV_NVLINK_COUNT_* errors and recoveries), ECC errors, Xid critical errors and clock
slowdowns. Elements as ``judge.preflight.gather`` makes them. ``health_frame`` is health.csv: one row per
rank, its GPU's facts and each counter before and after.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from commbench.hardware.health import ECC_COUNTERS, CounterSnapshot, GpuHealth
from commbench.hardware.nvlink_counters import (
    ALL_NVLINK_COUNTERS,
    NOT_SUPPORTED,
    NVLINK5_COUNTERS,
    NVLINK_COUNTERS,
)
from commbench.report.judge.preflight import Finding, gather, rank_label, skip
from commbench.report.judge.verdict import Element

HEALTH = "health"
_ERRORS_REMEDY = (
    "`nvidia-smi nvlink -e` (NVLink errors) and `nvidia-smi -q -d ECC` on that host; rerun to see if the "
    "errors recur; a link that keeps counting needs its tray or cable cartridge reseated or replaced"
)
_UNREAD_REMEDY = (
    "`nvidia-smi nvlink -e` on that host reads them by hand; NVLink 5 counters need an nvidia-ml-py and a "
    "driver with the NVML_FI_DEV_NVLINK_COUNT_* fields, and NVML may refuse them inside some containers"
)
_XID_REMEDY = "`dmesg | grep -i xid` on that host; look the Xid up in NVIDIA's Xid catalog; drain and reset"
_SLOWDOWN_REMEDY = "`nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER` on that host; check cooling and power"
# Xids that name their cause in the message (NVIDIA's Xid catalog); the rest are shown by number only.
_XID_NAMES = {
    48: "double-bit ECC error",
    63: "ECC row remap / page retirement",
    64: "ECC row remap / page retirement failed",
    74: "NVLink error",
    79: "GPU fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
}


# Each counter as messages name it (NVLink 5 names after nvml.h's NVML_FI_DEV_NVLINK_COUNT_* descriptions).
_COUNTER_NAMES = {
    "nvlink_replay": "NVLink replay errors",
    "nvlink_recovery": "NVLink recovery errors",
    "nvlink_crc_flit": "NVLink CRC flit errors",
    "nvlink_crc_data": "NVLink CRC data errors",
    "nvlink_rx_errors": "NVLink received packet errors",
    "nvlink_rx_malformed": "NVLink malformed packets received",
    "nvlink_rx_buffer_overrun": "NVLink packets lost to buffer overrun",
    "nvlink_rx_remote": "NVLink packets received with a remote error",
    "nvlink_rx_general": "NVLink packets received with a header mismatch",
    "nvlink_link_integrity": "NVLink local link integrity errors",
    "nvlink_tx_discards": "NVLink transmit discards",
    "nvlink_symbol": "NVLink symbol errors",
    "nvlink_recovery_ok": "NVLink link recoveries",
    "nvlink_recovery_failed": "NVLink failed link recoveries (link down)",
    "ecc_corrected": "ECC corrected errors",
    "ecc_uncorrected": "ECC uncorrected errors",
}
_NVLINK_SOURCES = (
    (tuple(NVLINK_COUNTERS), "nvmlDeviceGetNvLinkErrorCounter"),
    (tuple(NVLINK5_COUNTERS), "NVML_FI_DEV_NVLINK_COUNT_* fields"),
)


def _counter_name(counter: str) -> str:
    """A counter as messages name it: "nvlink_crc_flit" -> "NVLink CRC flit errors"."""
    return _COUNTER_NAMES[counter]


def _nvlink_read(before: CounterSnapshot, after: CounterSnapshot) -> list[str]:
    """The NVLink error counters read both before and after."""
    return [c for c in ALL_NVLINK_COUNTERS if before.total(c) is not None and after.total(c) is not None]


def _coverage_finding(label: str, before: CounterSnapshot, after: CounterSnapshot) -> Finding:
    """Whether this GPU's NVLink errors are watched at all: a GPU with active links whose every NVLink
    counter went unread WARNs (never a SKIP that lets the health check pass without looking)."""
    read = _nvlink_read(before, after)
    if read:
        sources = [source for counters, source in _NVLINK_SOURCES if set(counters) & set(read)]
        return Finding("PASS", f"{len(read)} NVLink error counters read per link ({', '.join(sources)})")
    if not before.nvlink_active:
        return skip("no active NVLink link: no NVLink error to watch")
    parts = []
    for counters, source in _NVLINK_SOURCES:
        reasons = sorted({before.skipped.get(c) or after.skipped.get(c) or "not read" for c in counters})
        parts.append(f"{source}: {'; '.join(reasons)}")
    message = (
        f"{label}: none of the NVLink error counters readable on a GPU with {len(before.nvlink_active)} "
        f"active NVLink links ({' | '.join(parts)}): NVLink errors during the run not checked"
    )
    return Finding("WARN", message, 0, len(ALL_NVLINK_COUNTERS), "counters", _UNREAD_REMEDY)


def _counter_finding(
    label: str, counter: str, before: CounterSnapshot, after: CounterSnapshot, max_increase: int
) -> Finding:
    why = before.skipped.get(counter) or after.skipped.get(counter)
    old, new = before.total(counter), after.total(counter)
    if why or old is None or new is None:
        return skip(why or "not read")
    name, increase = _counter_name(counter), new - old
    if increase <= max_increase:
        return Finding("PASS", f"{name}: no increase above {max_increase} during the run", limit=max_increase)
    first, links = before.nvlink.get(counter, {}), after.nvlink.get(counter, {})
    grown = [f"link {k} +{n - first.get(k, 0)}" for k, n in sorted(links.items()) if n > first.get(k, 0)]
    where = f" ({', '.join(grown)})" if grown else ""
    message = f"{label}: {name} +{increase} during the run ({old} -> {new}){where}"
    # Corrected ECC errors were fixed by the hardware (the data is intact): a finding to watch, not a fault.
    status = "WARN" if counter == "ecc_corrected" else "FAIL"
    return Finding(status, message, increase, max_increase, "errors", _ERRORS_REMEDY)


def _xid_finding(label: str, before: CounterSnapshot, after: CounterSnapshot) -> Finding:
    if after.xid_events:
        xids = ", ".join(
            f"{xid} ({_XID_NAMES[xid]})" if xid in _XID_NAMES else str(xid) for xid in after.xid_events
        )
        message = f"{label}: Xid critical error(s) during the run: Xid {xids}"
        return Finding("FAIL", message, len(after.xid_events), 0, "events", _XID_REMEDY)
    why = before.skipped.get("xid") or after.skipped.get("xid")
    return skip(why) if why else Finding("PASS", "no Xid critical error during the run", limit=0)


def _slowdown_finding(label: str, before: CounterSnapshot, after: CounterSnapshot) -> Finding:
    why = before.skipped.get("clocks") or after.skipped.get("clocks")
    if why:
        return skip(why)
    new = [name for name in after.slowdowns if name not in before.slowdowns]
    old = list(before.slowdowns)
    if not new and not old:
        return Finding("PASS", "no hardware or thermal clock slowdown before or after the run")
    parts = [f"{', '.join(new)} active after the run"] if new else []
    parts += [f"{', '.join(old)} already active before it"] if old else []
    message = f"{label}: clocks slowed: {'; '.join(parts)}"
    return Finding("WARN", message, ", ".join(new + old), "none", "", _SLOWDOWN_REMEDY)


def counter_elements(
    before: Sequence[CounterSnapshot],
    after: Sequence[CounterSnapshot],
    names: Mapping[int, str] | None = None,
    max_increase: int = 0,
) -> list[Element]:
    """Group "health": each rank's counters after the run against before it. "NVLink error counters" says
    which were read per GPU (none readable on a GPU with active links: WARN). An NVLink or uncorrected ECC
    counter that grew by more than ``max_increase`` FAILs (corrected ECC: WARN), naming the links that
    grew; any Xid critical error FAILs; a HW / thermal clock slowdown WARNs. Unread counters SKIP."""
    if not before or not after:
        return [Element(HEALTH, "GPU counters", "SKIP", "no counters gathered before and after the run")]
    pairs = list(zip(before, after, strict=False))
    unread = {r: b.skipped.get("gpu") or a.skipped.get("gpu") for r, (b, a) in enumerate(pairs)}
    if all(unread.values()):  # a CPU run, or no NVML anywhere: one SKIP says it all
        return gather(HEALTH, "GPU counters", {r: skip(why) for r, why in unread.items()})  # type: ignore[arg-type]
    for rank, (b, a) in enumerate(pairs):
        if not unread[rank] and b.uuid != a.uuid:
            unread[rank] = "the rank's GPU changed between before and after"

    def label(rank: int) -> str:
        return rank_label(rank, pairs[rank][1], names)

    coverage: dict[int | str, Finding] = {
        r: skip(unread[r]) if unread[r] else _coverage_finding(label(r), b, a)
        for r, (b, a) in enumerate(pairs)
    }
    out = gather(HEALTH, "NVLink error counters", coverage)
    for counter in ALL_NVLINK_COUNTERS:
        # Only the GPUs whose NVLink counters were read: a counter of the other NVLink generation (not
        # supported on this GPU) is not this GPU's; one the GPU refused (no permission) SKIPs with why.
        findings: dict[int | str, Finding] = {}
        for rank, (b, a) in enumerate(pairs):
            if unread[rank] or not _nvlink_read(b, a):
                continue
            why = b.skipped.get(counter) or a.skipped.get(counter) or ""
            if not why.startswith(NOT_SUPPORTED):
                findings[rank] = _counter_finding(label(rank), counter, b, a, max_increase)
        out += gather(HEALTH, _counter_name(counter), findings)
    judges = {
        **{
            _counter_name(c): (lambda b, a, lb, c=c: _counter_finding(lb, c, b, a, max_increase))
            for c in ECC_COUNTERS
        },
        "Xid errors": lambda b, a, lb: _xid_finding(lb, b, a),
        "clock slowdowns": lambda b, a, lb: _slowdown_finding(lb, b, a),
    }
    for check, judge in judges.items():
        found = {
            rank: skip(unread[rank]) if unread[rank] else judge(b, a, label(rank))  # type: ignore[arg-type]
            for rank, (b, a) in enumerate(pairs)
        }
        out += gather(HEALTH, check, found)
    return out


def health_frame(
    healths: Sequence[GpuHealth],
    before: Sequence[CounterSnapshot] = (),
    after: Sequence[CounterSnapshot] = (),
) -> pd.DataFrame:
    """health.csv: one row per rank, its GPU's facts, and each counter before and after the run."""
    rows = []
    for rank in range(max(len(healths), len(before), len(after))):
        row: dict[str, Any] = {"rank": rank}
        if rank < len(healths):
            h = healths[rank]
            row.update({k: v for k, v in h.to_dict().items() if not isinstance(v, (dict, tuple, list))})
            row["nvlink_active"] = len(h.nvlink_active)
            row["nvlink_inactive_links"] = " ".join(str(link) for link in h.nvlink_inactive)
            speeds = list(h.nvlink_speed_MBps.values()) or [h.nvlink_common_speed_MBps]
            row["nvlink_min_speed_MBps"] = min((s for s in speeds if s), default=None)
            row["skipped"] = "; ".join(f"{k}: {v}" for k, v in h.skipped.items())
        for when, snapshots in (("before", before), ("after", after)):
            if rank < len(snapshots):
                snap = snapshots[rank]
                row.update({f"{c}_{when}": snap.total(c) for c in (*ALL_NVLINK_COUNTERS, *ECC_COUNTERS)})
                row[f"slowdowns_{when}"] = ", ".join(snap.slowdowns)
                row[f"counters_skipped_{when}"] = "; ".join(f"{k}: {v}" for k, v in snap.skipped.items())
                row.setdefault("host", snap.host)
        if rank < len(after):
            row["xid_events"] = " ".join(str(xid) for xid in after[rank].xid_events)
        rows.append(row)
    return pd.DataFrame(rows)

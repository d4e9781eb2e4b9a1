"""The pairwise link test judged: each ordered pair against its link class's robust median and floor, slow
pairs confirmed by reruns, the [src][dst] matrices and their heatmaps.

Per test (latency, bandwidth one way, bidir: one direction while the other runs) and link class (nvlink,
scaleout) the pairs' times per message give a median and a scaled MAD (1.4826 x MAD, as ``report.outliers``).
The rule works on times, where a slow pair stands out (a bandwidth has a floor at 0 and squeezes the slow tail
together): a pair is flagged (``PairRule``) when its time is more than ``k_mads`` scaled MADs above the median
AND ``min_excess_us`` above it AND, for bandwidth, its bandwidth (size / time) is ``bandwidth_drop_pct`` %
below the class's (size / median time), or, for latency, its time is ``latency_excess_pct`` % above the
median. Reruns of the flagged pairs (``spread.confirm_reruns``, rule ``spread.confirm_rule``) are judged
against the first pass's median and MAD (a rerun of a few pairs has no median of its own): a flag that repeats
as the rule asks is FAIL when its smallest gap above the class median (first pass and reruns) is more than
``spread.noise_k`` times the class's own noise (the median over its pairs of the range of their repeat
windows: ``ClassStats.noise_us``), else WARN; one that comes back less often WARN (intermittent), one that
never comes back PASS with the note "not reproduced" (one slow measurement). On a CPU run a timing finding is
WARN at most, except the direction planted with ``--inject-delay SRC-DST:US`` (``outliers.timing_status``).
Against the spec (GPU runs): each class's slowest pair against ``pairwise.<class>.busbw_{warn,fail}_fraction``
of the class's per-direction figure; a CPU run SKIPs that.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from commbench.inputs.limits import Floor, PairRule, SpreadRule
from commbench.report.judge.outliers import SCALED_MAD, timing_status
from commbench.report.judge.verdict import CPU_SKIP, Element

PAIRS_FILE = "pairs.csv"
CLASS_WORDS = {"nvlink": "NVLink", "scaleout": "scale-out", "self": "self"}
# CPU ranks (device -1) talk over the host's own transport (gloo: loopback TCP on one host; shmem-emu: shared
# memory) whatever their class: the class is only the layout's emulated NVLink domain or not.
_CPU_CLASS_WORDS = {"nvlink": "CPU pair in one emulated NVLink domain", "scaleout": "CPU pair across domains"}
TEST_WORDS = {"latency": "latency", "bandwidth": "one-way bandwidth", "bidir": "bidirectional bandwidth"}
_PAIR_REMEDY = (
    "check that link: `nvidia-smi nvlink -s` (speeds) and `nvidia-smi nvlink -e` (errors) on both hosts; "
    "for scale-out `ibstat` / `ethtool` and the NIC's counters; rerun nccl-tests sendrecv_perf on that pair"
)
_CPU_PAIR_REMEDY = "on a CPU run a slow pair is this host's scheduling (or --inject-delay): check other load"
_WRONG_PAIR_REMEDY = "data was corrupted on a link: see the pairs with wrong > 0 in pairs.csv"
_CONTENTION_REMEDY = (
    "compare with nccl-tests alltoall_perf; check switch and port counters and the NCCL algorithm and "
    "protocol chosen (NCCL_DEBUG=INFO)"
)
_NOTHING_TO_BISECT = "no all-to-all case is below its limits: nothing to bisect"


@dataclass(frozen=True)
class ClassStats:
    """One (test, link class): its pairs' median and scaled MAD, or why it was not judged."""

    test: str
    link_class: str
    pairs: int
    median: float  # time per message, us
    scaled_mad: float  # us
    size_bytes: int = 0  # the message size (its bandwidth = size / time)
    skipped: str = ""
    noise_us: float = 0.0  # median over the class's pairs of their repeat windows' range (max - min), us

    @property
    def median_GBps(self) -> float:
        return self.size_bytes / (self.median * 1e3) if self.median > 0 else math.nan


@dataclass(frozen=True)
class PairFlag:
    """A pair outside its class: its value against the class median."""

    test: str
    src: int
    dst: int
    link_class: str
    time_us: float
    median_us: float
    scaled_mad: float
    off_pct: float  # % below the class bandwidth (bandwidth, bidir) or above the median time (latency)
    size_bytes: int = 0

    @property
    def key(self) -> tuple[str, int, int]:
        return self.test, self.src, self.dst


@dataclass(frozen=True)
class ConfirmedPair:
    flag: PairFlag
    status: str  # FAIL or WARN
    note: str


def class_stats(frame: pd.DataFrame, rule: PairRule) -> list[ClassStats]:
    """Median and scaled MAD per (test, link class) of a ``pair_frame``."""
    out: list[ClassStats] = []
    if frame.empty:
        return out
    for (test, link), rows in frame.groupby(["test", "link_class"], sort=False):
        values = pd.to_numeric(rows["time_us"], errors="coerce").dropna().to_numpy(dtype=float)
        size = int(pd.to_numeric(rows["size_bytes"], errors="coerce").max())
        if len(values) < rule.min_pairs:
            why = f"{len(values)} pair(s): a median of fewer than {rule.min_pairs} pairs means nothing"
            out.append(ClassStats(str(test), str(link), len(values), math.nan, math.nan, size, why))
            continue
        median = float(np.median(values))
        mad = SCALED_MAD * float(np.median(np.abs(values - median)))
        noise = 0.0
        if {"time_us_min", "time_us_max"} <= set(rows.columns):  # folders before the range was kept lack it
            ranges = pd.to_numeric(rows["time_us_max"], errors="coerce") - pd.to_numeric(
                rows["time_us_min"], errors="coerce"
            )
            ranges = ranges.dropna()
            noise = float(ranges.median()) if not ranges.empty else 0.0
        out.append(ClassStats(str(test), str(link), len(values), median, mad, size, noise_us=noise))
    return out


def _off(test: str, time_us: float, stats: ClassStats, rule: PairRule) -> float | None:
    """How far a pair's time per message is beyond the rule (percent: bandwidth below the class's, or
    latency above the median), or None when it is within it."""
    if stats.skipped or math.isnan(time_us) or time_us <= 0:
        return None
    excess = time_us - stats.median
    if test == "latency":
        pct = 100.0 * excess / stats.median if stats.median > 0 else math.inf
        beyond = pct > rule.latency_excess_pct
    else:
        pct = 100.0 * (1.0 - stats.median / time_us)  # the bandwidth drop: 1 - bw / class bw
        beyond = pct > rule.bandwidth_drop_pct
    beyond = beyond and excess > rule.min_excess_us  # per message: jitter of a few us never flags a pair
    mads = excess / stats.scaled_mad if stats.scaled_mad > 0 else math.inf
    return pct if beyond and excess > 0 and mads > rule.k_mads else None


def find_slow_pairs(frame: pd.DataFrame, stats: Sequence[ClassStats], rule: PairRule) -> list[PairFlag]:
    """Every row of ``frame`` beyond the rule against its class's ``stats``."""
    by_class = {(s.test, s.link_class): s for s in stats}
    flags = []
    for record in frame.to_dict("records"):
        test = str(record["test"])
        stat = by_class.get((test, str(record["link_class"])))
        if stat is None:
            continue
        value = float(record["time_us"]) if record.get("time_us") is not None else math.nan
        off = _off(test, value, stat, rule)
        if off is not None:
            src, dst, size = int(record["src"]), int(record["dst"]), int(record["size_bytes"])
            flags.append(
                PairFlag(test, src, dst, stat.link_class, value, stat.median, stat.scaled_mad, off, size)
            )
    return flags


def rerun_rounds(flags: Sequence[PairFlag]) -> list[list[tuple[int, int]]]:
    """The flagged pairs (unordered) in rounds of disjoint pairs, for the confirmation reruns."""
    pending = sorted({(min(f.src, f.dst), max(f.src, f.dst)) for f in flags})
    rounds: list[list[tuple[int, int]]] = []
    while pending:
        busy: set[int] = set()
        this_round = []
        for pair in list(pending):
            if pair[0] not in busy and pair[1] not in busy:
                this_round.append(pair)
                busy.update(pair)
                pending.remove(pair)
        rounds.append(this_round)
    return rounds


def confirm_pairs(
    flags: Sequence[PairFlag],
    stats: Sequence[ClassStats],
    reruns: Sequence[pd.DataFrame],
    rule: PairRule,
    spread: SpreadRule,
    *,
    cpu_run: bool = False,
    planted: Collection[tuple[int, int]] = (),
) -> list[ConfirmedPair]:
    """Each first-pass flag judged by the reruns (``pair_frame``s of the flagged pairs) against the first
    pass's class statistics and noise (module docstring); ``planted``: the (src, dst) directions
    ``--inject-delay`` slowed."""
    by_class = {(s.test, s.link_class): s for s in stats}
    out = []
    for flag in flags:
        stat = by_class[(flag.test, flag.link_class)]
        repeats, gaps = 0, [flag.time_us - stat.median]
        for frame in reruns:
            same = (frame["test"] == flag.test) & (frame["src"] == flag.src) & (frame["dst"] == flag.dst)
            rows = frame[same]
            value = float(rows["time_us"].iloc[0]) if not rows.empty else math.nan
            again = _off(flag.test, value, stat, rule) is not None
            repeats += again
            if again:
                gaps.append(value - stat.median)
        count = len(reruns)
        if spread.confirm_reruns == 0:
            status, note = "FAIL", "not rerun (spread.confirm_reruns is 0)"
        elif count == 0:
            status, note = "WARN", "not confirmed: the pair was not rerun"
        else:
            repeated = repeats == count if spread.confirm_rule == "all" else 2 * repeats > count
            note = f"flagged again in {repeats} of {count} reruns"
            if repeated:
                status, note = _against_noise(min(gaps), stat, spread, note)
            elif repeats:  # it came back, but not as often as the rule asks: an intermittent link
                status, note = "WARN", f"intermittent ({note}; rule: {spread.confirm_rule})"
            else:  # never again: one slow measurement on a busy host, not a link
                status, note = "PASS", f"not reproduced ({note}): noise, not a finding"
        status, note = timing_status(status, note, cpu_run, (flag.src, flag.dst) in planted)
        out.append(ConfirmedPair(flag, status, note))
    return out


def _against_noise(gap: float, stat: ClassStats, spread: SpreadRule, note: str) -> tuple[str, str]:
    """FAIL when a repeated flag's smallest gap is more than ``noise_k`` x its class's noise, else WARN."""
    noise = stat.noise_us
    if noise <= 0:
        return "FAIL", f"{note}; gap >= {_num(gap)} us per message (no noise measured)"
    if gap > spread.noise_k * noise:
        return "FAIL", f"{note}; gap >= {_num(gap)} us per message, {gap / noise:.1f}x the class's noise"
    return "WARN", (
        f"{note}; within the launch's noise: gap {_num(gap)} us per message is not above "
        f"{spread.noise_k:g}x the class's {_num(noise)} us spread between repeat windows"
    )


def _host(frame: pd.DataFrame, rank: int, side: str) -> str:
    rows = frame[frame[side] == rank]
    return str(rows.iloc[0].get(f"{side}_host") or "?") if not rows.empty else "?"


def _end(frame: pd.DataFrame, rank: int, side: str) -> str:
    """ "rank 1 (host h, GPU 1)" from a pair row's src_/dst_ columns."""
    rows = frame[frame[side] == rank]
    if rows.empty:
        return f"rank {rank}"
    record = rows.iloc[0]
    host = record.get(f"{side}_host") or "?"
    device = record.get(f"{side}_device")
    where = "CPU" if device is None or pd.isna(device) or int(device) < 0 else f"GPU {int(device)}"
    return f"rank {rank} (host {host}, {where})"


def cpu_pairs(frame: pd.DataFrame) -> bool:
    """Whether a pair frame's ranks are CPU processes (every end's device -1): its classes are not links."""
    if frame.empty or "src_device" not in frame.columns:
        return False
    devices = pd.to_numeric(frame["src_device"], errors="coerce").fillna(-1)
    return bool((devices < 0).all())


def class_words(link_class: str, cpu: bool) -> str:
    """How a link class is named: NVLink / scale-out between GPUs, what it really is between CPU ranks."""
    words = _CPU_CLASS_WORDS if cpu else CLASS_WORDS
    return words.get(link_class, CLASS_WORDS.get(link_class, link_class))


def pair_text(frame: pd.DataFrame, src: int, dst: int, link_class: str) -> str:
    """ "rank a (host, GPU) -> rank b (host, GPU), NVLink"; for CPU ranks on one host, "..., CPU pair in
    one emulated NVLink domain (loopback)"."""
    cpu = cpu_pairs(frame)
    words = class_words(link_class, cpu)
    if cpu:
        words += " (loopback)" if _host(frame, src, "src") == _host(frame, dst, "dst") else " (network)"
    return f"{_end(frame, src, 'src')} -> {_end(frame, dst, 'dst')}, {words}"


def _num(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def pair_elements(
    frame: pd.DataFrame,
    stats: Sequence[ClassStats],
    confirmed: Sequence[ConfirmedPair],
    rule: PairRule,
    cpu_run: bool,
) -> list[Element]:
    """The verdict's ``pairwise`` group: every byte checked, each class against its median (PASS, or one
    element per flagged pair), each class's slowest pair against the spec floor (SKIP on a CPU run)."""
    if frame.empty:
        return []
    elements = []
    wrong = int(pd.to_numeric(frame["wrong"], errors="coerce").fillna(0).sum())
    elements.append(
        Element(
            "pairwise",
            "pairwise #wrong",
            "FAIL" if wrong else "PASS",
            f"{wrong} wrong byte(s) in the last message of every window ({len(frame)} windows checked)",
            wrong,
            0,
            "bytes",
            "" if not wrong else _WRONG_PAIR_REMEDY,
        )
    )
    flagged = {item.flag.key: item for item in confirmed}
    for stat in stats:
        label = f"{stat.test} {stat.link_class}"
        words = f"{class_words(stat.link_class, cpu_pairs(frame))} {TEST_WORDS.get(stat.test, stat.test)}"
        if stat.skipped:
            elements.append(Element("pairwise", label, "SKIP", f"{words}: {stat.skipped}"))
            continue
        mine = [
            item
            for item in flagged.values()
            if (item.flag.test, item.flag.link_class) == (stat.test, stat.link_class)
        ]
        latency = stat.test == "latency"
        unit = "us" if latency else "GB/s"
        median = stat.median if latency else stat.median_GBps
        if all(item.status == "PASS" for item in mine):
            elements.append(
                Element(
                    "pairwise",
                    label,
                    "PASS",
                    f"{words}: {stat.pairs} pairs within the rule around the class median "
                    f"{_num(median)} {unit}",
                    round(median, 4),
                    None,
                    unit,
                )
            )
        for item in mine:
            flag = item.flag
            value = flag.time_us if latency else flag.size_bytes / (flag.time_us * 1e3)
            direction = "above" if latency else "below"
            elements.append(
                Element(
                    "pairwise",
                    f"{label} {flag.src}->{flag.dst}",
                    item.status,
                    f"{pair_text(frame, flag.src, flag.dst, flag.link_class)}: {TEST_WORDS.get(flag.test)} "
                    f"{_num(value)} {unit}, {flag.off_pct:.0f}% {direction} the class median "
                    f"{_num(median)} {unit}; {item.note}",
                    round(value, 4),
                    round(median, 4),
                    unit,
                    "" if item.status == "PASS" else _CPU_PAIR_REMEDY if cpu_run else _PAIR_REMEDY,
                )
            )
    elements += _floor_elements(frame, rule, cpu_run)
    return elements


def _floor_elements(frame: pd.DataFrame, rule: PairRule, cpu_run: bool) -> list[Element]:
    elements = []
    for link, floor in (("nvlink", rule.nvlink_floor), ("scaleout", rule.scaleout_floor)):
        for test in ("bandwidth", "bidir"):
            rows = frame[(frame["link_class"] == link) & (frame["test"] == test)]
            if rows.empty:
                continue
            name = f"{test} {link} vs spec"
            if cpu_run or floor is None or rows["spec_GBps"].isna().all():
                elements.append(Element("pairwise", name, "SKIP", CPU_SKIP if cpu_run else "no spec figure"))
                continue
            elements.append(_floor_element(frame, rows, name, floor))
    return elements


def _floor_element(frame: pd.DataFrame, rows: pd.DataFrame, name: str, floor: Floor) -> Element:
    worst = rows.loc[pd.to_numeric(rows["GBps"], errors="coerce").idxmin()]
    fraction = float(worst["GBps"]) / float(worst["spec_GBps"])
    status = "PASS"
    if fraction < floor.warn_fraction:
        status = "FAIL" if fraction < floor.fail_fraction else "WARN"
    limit = floor.fail_fraction if status == "FAIL" else floor.warn_fraction
    where = pair_text(frame, int(worst["src"]), int(worst["dst"]), str(worst["link_class"]))
    return Element(
        "pairwise",
        name,
        status,
        f"slowest pair {where}: {_num(float(worst['GBps']))} GB/s = {fraction:.2f} of "
        f"{_num(float(worst['spec_GBps']))} GB/s per direction (floor {limit:g})",
        round(fraction, 4),
        limit,
        "fraction of spec",
        "" if status == "PASS" else _PAIR_REMEDY,
    )


def bisect_element(elements: Sequence[Element]) -> Element | None:
    """Where an all-to-all case is slow (balanced, moe or spread FAIL/WARN), whether a single pair explains
    it: "contention, not a single link" when no pair is flagged. None without a pairwise test."""
    pairwise = [e for e in elements if e.group == "pairwise"]
    if not pairwise:
        return None
    slow = [e for e in elements if e.group in ("balanced", "moe", "spread") and e.status in ("FAIL", "WARN")]
    bad_pairs = [e for e in pairwise if e.status in ("FAIL", "WARN") and "->" in e.name]
    if not slow:
        return Element("pairwise", "bisect", "PASS", _NOTHING_TO_BISECT)
    if bad_pairs:
        names = ", ".join(e.name.rsplit(" ", 1)[-1] for e in bad_pairs[:6])
        return Element(
            "pairwise",
            "bisect",
            "WARN",
            f"{len(slow)} all-to-all check(s) below limits; slow pair(s) {names} can explain it: fix those "
            "links first",
            len(bad_pairs),
            0,
            "pairs",
            _PAIR_REMEDY,
        )
    return Element(
        "pairwise",
        "bisect",
        "WARN",
        f"{len(slow)} all-to-all check(s) below limits, but no single pair is slow: contention, not a single "
        "link (the fabric under all-to-all load, a switch, routing or the NCCL algorithm)",
        0,
        0,
        "pairs",
        _CONTENTION_REMEDY,
    )


def pair_matrix(frame: pd.DataFrame, test: str, world_size: int | None = None) -> pd.DataFrame:
    """The [src][dst] matrix of a test: GB/s (bandwidth, bidir) or us (latency); NaN where not measured
    (the diagonal)."""
    rows = frame[frame["test"] == test] if not frame.empty else frame
    size = world_size or (int(max(rows["src"].max(), rows["dst"].max())) + 1 if not rows.empty else 0)
    matrix = np.full((size, size), np.nan)
    column = "time_us" if test == "latency" else "GBps"
    for record in rows.to_dict("records"):
        matrix[int(record["src"]), int(record["dst"])] = float(record[column])
    labels = list(range(size))
    return pd.DataFrame(matrix, index=pd.Index(labels, name="src"), columns=pd.Index(labels, name="dst"))


def heatmap_figure(panels: Sequence[tuple[pd.DataFrame, str, str, Mapping[tuple[int, int], str]]]) -> Any:
    """[src][dst] heatmaps side by side (matplotlib object API), one per (matrix, title, unit, flagged
    pairs -> FAIL|WARN); flagged pairs outlined, values written in the cells up to 16 ranks (dark text on
    light cells)."""
    from matplotlib.figure import Figure

    size = max(len(matrix) for matrix, *_ in panels)
    figure = Figure(figsize=(min(5.2 * len(panels), 18), min(4.0 + 0.12 * size, 8)), layout="constrained")
    for index, (matrix, title, unit, flagged) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), index + 1)
        values = matrix.to_numpy(dtype=float)
        image = axes.imshow(values, cmap="viridis_r" if unit == "us" else "viridis", interpolation="nearest")
        figure.colorbar(image, ax=axes, label=unit, shrink=0.8)
        axes.set_xlabel("dst rank (receiver)")
        axes.set_ylabel("src rank (sender)")
        axes.set_title(title, fontsize=10)
        if size <= 16:
            axes.set_xticks(range(size))
            axes.set_yticks(range(size))
            _write_cells(axes, image, values)
        for (src, dst), status in flagged.items():
            axes.add_patch(_outline(src, dst, "#d00" if status == "FAIL" else "#f90"))
    return figure


def _write_cells(axes: Any, image: Any, values: np.ndarray) -> None:
    for src in range(values.shape[0]):
        for dst in range(values.shape[1]):
            value = values[src, dst]
            if np.isnan(value):
                continue
            red, green, blue, _ = image.cmap(image.norm(value))
            color = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.5 else "white"
            axes.text(dst, src, _num(float(value)), ha="center", va="center", fontsize=7, color=color)


def _outline(src: int, dst: int, color: str) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((dst - 0.5, src - 0.5), 1, 1, fill=False, edgecolor=color, linewidth=2.5)

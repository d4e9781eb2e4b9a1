"""Rank outliers: the robust rule that names a slow rank (median and MAD across ranks), and its confirmation.

Per case, each rank has one value of a metric where bigger is worse (the time from the iteration's common
start until the rank was ready to send, the time it waited for others, its own phase time: microseconds).
A rank is flagged when its excess over the median of the ranks is, all three at once,

- more than ``k_mads`` scaled MADs (scaled MAD = 1.4826 x the median absolute deviation, the standard
  deviation of normal data; a MAD of 0, every other rank alike, makes any excess pass this test),
- more than ``min_excess_pct`` % of the median (any excess when the median is 0), and
- more than ``min_excess_us`` microseconds (so jitter of a few us never flags a rank).

With fewer than ``min_ranks`` ranks (at least 3) a case is not judged: with two ranks each is the other's
outlier. In an all-to-all one slow rank makes every rank finish late, so feed this rule what differs
between ranks (arrival, wait), not the common end-to-end time.

Before a FAIL the flagged case is rerun (``SpreadRule.confirm_reruns`` times): ``confirm`` makes a flag FAIL
when it repeats in all reruns (``confirm_rule: all``) or in more than half of them (``majority``) AND its
smallest gap over those measurements is more than ``noise_k`` times the noise the launch measured itself
(``launch_noise``: how far the other ranks' values move between the measurements of the same case), else
WARN ("not reproduced", or "within the launch's noise"). With ``confirm_reruns: 0`` a flag fails at once.

A CPU run's times are the host's scheduling, not a fabric's: there a timing finding is WARN at most
(``timing_status``), except the fault planted with ``--inject-delay`` (the harness's own detection test),
which still has to be found and confirmed by the rule like any other and then FAILs as a real fault would.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from commbench.inputs.limits import SpreadRule
from commbench.plain import is_missing
from commbench.run.case import group_by_case, size_text

__all__ = ["size_text"]  # re-exported: the verdict's names use it

SCALED_MAD = 1.4826  # MAD x this = the standard deviation, for normally distributed values
CPU_TIMING_NOTE = "CPU run: its times are this host's scheduling, not a fabric's, so WARN at most"
PLANTED_NOTE = "the fault planted with --inject-delay, found by the rule: FAIL as a real one would be"


@dataclass(frozen=True)
class RankFlag:
    """One flagged rank: its value, the case's median and scaled MAD, and how far above the median it is."""

    rank: int
    value: float
    median: float
    scaled_mad: float
    excess: float  # value - median, in the metric's unit
    mads: float  # excess / scaled MAD (inf when the MAD is 0)
    excess_pct: float  # 100 x excess / |median| (inf when the median is 0)


@dataclass(frozen=True)
class CaseSpread:
    """The rule applied to one case's per-rank values: ``flags`` (empty: no outlier) or ``skipped`` (why
    the case was not judged)."""

    case: str
    metric: str
    unit: str
    ranks: int
    median: float
    scaled_mad: float
    flags: tuple[RankFlag, ...] = ()
    skipped: str = ""
    key: tuple[object, ...] = ()  # the case's Case.repeat_key (outliers_by_case): reruns are matched by it
    values: tuple[tuple[int, float], ...] = ()  # (rank, value) judged: launch_noise compares measurements

    def value_of(self, rank: int) -> float:
        """``rank``'s value in this measurement (NaN: it reported none)."""
        return next((value for known, value in self.values if known == rank), math.nan)


@dataclass(frozen=True)
class ConfirmedFlag:
    """A flag of the first measurement after its reruns: FAIL (repeated as the rule asks) or WARN."""

    flag: RankFlag
    status: str  # "FAIL" or "WARN"
    repeats: int  # reruns that flagged the same rank
    reruns: int
    note: str


@dataclass(frozen=True)
class SpreadOutcome:
    """One case's spread verdict: the first measurement and its confirmed flags."""

    spread: CaseSpread
    confirmed: tuple[ConfirmedFlag, ...] = ()

    @property
    def status(self) -> str:
        if self.spread.skipped:
            return "SKIP"
        statuses = {item.status for item in self.confirmed}
        return "FAIL" if "FAIL" in statuses else "WARN" if statuses else "PASS"


def find_outliers(
    values: Mapping[int, float] | Sequence[float],
    rule: SpreadRule,
    case: str = "",
    metric: str = "time",
    unit: str = "us",
) -> CaseSpread:
    """The rule (module docstring) over ``values`` (rank -> value, or a sequence indexed by rank; NaN and
    None = the rank reported nothing and is left out)."""
    pairs = values.items() if isinstance(values, Mapping) else enumerate(values)
    known = {int(rank): float(value) for rank, value in pairs if not is_missing(value)}
    if len(known) < rule.min_ranks:
        why = (
            f"{len(known)} rank(s) with a value: a median absolute deviation across fewer than "
            f"{rule.min_ranks} ranks means nothing, so no rank is judged"
        )
        return CaseSpread(case, metric, unit, len(known), math.nan, math.nan, skipped=why)
    array = np.array(list(known.values()), dtype=float)
    median = float(np.median(array))
    scaled_mad = SCALED_MAD * float(np.median(np.abs(array - median)))
    flags = []
    for rank, value in sorted(known.items()):
        excess = value - median
        if excess <= 0:
            continue
        mads = excess / scaled_mad if scaled_mad > 0 else math.inf
        pct = 100.0 * excess / abs(median) if median != 0 else math.inf
        if mads > rule.k_mads and pct > rule.min_excess_pct and excess > rule.min_excess_us:
            flags.append(RankFlag(rank, value, median, scaled_mad, excess, mads, pct))
    measured = tuple(sorted(known.items()))
    return CaseSpread(case, metric, unit, len(known), median, scaled_mad, tuple(flags), values=measured)


def outliers_by_case(
    rank_frame: pd.DataFrame, column: str, rule: SpreadRule, metric: str | None = None, unit: str = "us"
) -> list[CaseSpread]:
    """The rule per case over rank rows (``rank`` and ``column`` per row), in the order cases first appear.
    A case is a ``run.case.Case`` with its repeat: each measurement of a case is judged on its own (one value
    per rank), named by ``Case.label`` and keyed by ``Case.repeat_key``."""
    if rank_frame.empty or column not in rank_frame.columns or "rank" not in rank_frame.columns:
        return []
    out = []
    for case, rows in group_by_case(rank_frame, repeat=True):
        values = dict(
            zip(rows["rank"].astype(int), pd.to_numeric(rows[column], errors="coerce"), strict=True)
        )
        spread = find_outliers(values, rule, case=case.label, metric=metric or column, unit=unit)
        out.append(replace(spread, key=case.repeat_key))
    return out


def needs_rerun(spreads: Sequence[CaseSpread], rule: SpreadRule) -> list[CaseSpread]:
    """The cases whose flags must be confirmed by rerunning them (none when ``confirm_reruns`` is 0)."""
    return [spread for spread in spreads if spread.flags and rule.confirm_reruns > 0]


def launch_noise(measurements: Sequence[CaseSpread], rank: int) -> float:
    """The noise a launch measured itself around one case: the median, over the ranks other than ``rank``,
    of how far each one's value moved between the measurements of the case (max - min over the first pass
    and its reruns). 0 with fewer than two measurements: nothing to compare, so no noise is known."""
    per_rank: dict[int, list[float]] = {}
    for spread in measurements:
        for other, value in spread.values:
            if other != rank:
                per_rank.setdefault(other, []).append(value)
    ranges = [max(values) - min(values) for values in per_rank.values() if len(values) > 1]
    return float(np.median(ranges)) if ranges else 0.0


def timing_status(status: str, note: str, cpu_run: bool, planted: bool) -> tuple[str, str]:
    """A timing finding's (status, note) on this run (module docstring): on a CPU run a FAIL is a WARN,
    unless the finding is the fault ``--inject-delay`` planted."""
    if status != "FAIL" or not cpu_run:
        return status, note
    if planted:
        return status, f"{note}; {PLANTED_NOTE}"
    return "WARN", f"{note}; {CPU_TIMING_NOTE}"


def _against_noise(flag: RankFlag, measurements: Sequence[CaseSpread], rule: SpreadRule) -> tuple[bool, str]:
    """Whether the flag's smallest gap over the measurements that flagged it is more than ``noise_k``
    times the launch's noise, and the words for it."""
    gaps = [
        spread.value_of(flag.rank) - spread.median
        for spread in measurements
        if any(other.rank == flag.rank for other in spread.flags)
    ]
    gap = min(gaps) if gaps else flag.excess
    noise = launch_noise(measurements, flag.rank)
    unit = measurements[0].unit
    if noise <= 0:
        return True, f"gap >= {gap:.4g} {unit} (no noise between measurements)"
    if gap > rule.noise_k * noise:
        return True, f"gap >= {gap:.4g} {unit}, {gap / noise:.1f}x the launch's noise {noise:.4g} {unit}"
    return False, (
        f"within the launch's noise: gap {gap:.4g} {unit} is not above {rule.noise_k:g}x the {noise:.4g} "
        f"{unit} the other ranks moved between measurements"
    )


def confirm(
    first: CaseSpread,
    reruns: Sequence[CaseSpread],
    rule: SpreadRule,
    *,
    cpu_run: bool = False,
    planted: Collection[int] = (),
) -> SpreadOutcome:
    """The first measurement's flags judged by the reruns of the same case (module docstring). Fewer
    reruns than ``rule.confirm_reruns`` (a stopped run) are judged as they are; none at all leaves a
    flag at WARN "not confirmed", unless the rule asks for no rerun. ``cpu_run``: timing findings WARN
    at most, except on the ``planted`` ranks (``--inject-delay RANK:US``)."""
    confirmed = []
    judged = [spread for spread in reruns if not spread.skipped]
    for flag in first.flags:
        repeats = sum(any(other.rank == flag.rank for other in spread.flags) for spread in judged)
        count = len(judged)
        if rule.confirm_reruns == 0:
            status, note = "FAIL", "not rerun (spread.confirm_reruns is 0)"
        elif count == 0:
            status, note = "WARN", "not confirmed: the case was not rerun"
        else:
            repeated = repeats == count if rule.confirm_rule == "all" else 2 * repeats > count
            status = "FAIL" if repeated else "WARN"
            note = f"flagged again in {repeats} of {count} reruns"
            if not repeated:
                note = f"not reproduced ({note}; rule: {rule.confirm_rule})"
            else:
                above, words = _against_noise(flag, [first, *judged], rule)
                status, note = ("FAIL" if above else "WARN"), f"{note}; {words}"
        status, note = timing_status(status, note, cpu_run, flag.rank in planted)
        confirmed.append(ConfirmedFlag(flag, status, repeats, count, note))
    return SpreadOutcome(first, tuple(confirmed))

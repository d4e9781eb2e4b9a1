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
when it repeats in all reruns (``confirm_rule: all``) or in more than half of them (``majority``), else
WARN "not reproduced". With ``confirm_reruns: 0`` a flag fails at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from commbench.inputs.limits import SpreadRule
from commbench.plain import is_missing
from commbench.run.case import group_by_case, size_text

__all__ = ["size_text"]  # re-exported: the verdict's names use it

SCALED_MAD = 1.4826  # MAD x this = the standard deviation, for normally distributed values


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
    return CaseSpread(case, metric, unit, len(known), median, scaled_mad, tuple(flags))


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


def confirm(first: CaseSpread, reruns: Sequence[CaseSpread], rule: SpreadRule) -> SpreadOutcome:
    """The first measurement's flags judged by the reruns of the same case (module docstring). Fewer
    reruns than ``rule.confirm_reruns`` (a stopped run) are judged as they are; none at all leaves a
    flag at WARN "not confirmed", unless the rule asks for no rerun."""
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
        confirmed.append(ConfirmedFlag(flag, status, repeats, count, note))
    return SpreadOutcome(first, tuple(confirmed))

"""The rank outlier rule: flags exactly an injected rank, nothing on noisy healthy samples; confirmation."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from commbench.inputs.limits import SpreadRule, load_limits
from commbench.report.judge.outliers import (
    SCALED_MAD,
    CaseSpread,
    RankFlag,
    confirm,
    find_outliers,
    launch_noise,
    needs_rerun,
    outliers_by_case,
    timing_status,
)

GPU_RULE = load_limits("gb300-nvl72").spread  # k 5, > 25%, > 10 us
CPU_RULE = load_limits(None).spread  # k 5, > 200%, > 1000 us
SEEDS = range(200)


def _healthy(seed: int, sigma: float, scale: float) -> np.ndarray:
    """4-8 ranks of lognormal noise around ``scale``: a noisy but healthy case."""
    rng = np.random.default_rng(seed)
    return scale * rng.lognormal(0.0, sigma, int(rng.integers(4, 9)))


def test_flags_exactly_the_injected_rank_with_its_numbers():
    spread = find_outliers(
        [10, 11, 10, 12, 10, 55, 11, 10], GPU_RULE, case="balanced 1 MiB", metric="arrival"
    )
    assert [flag.rank for flag in spread.flags] == [5]
    flag = spread.flags[0]
    assert flag.value == 55 and flag.median == 10.5 and flag.excess == 44.5
    assert flag.scaled_mad == pytest.approx(SCALED_MAD * 0.5)
    assert flag.mads == pytest.approx(44.5 / (SCALED_MAD * 0.5))
    assert flag.excess_pct == pytest.approx(100 * 44.5 / 10.5)
    assert spread.ranks == 8 and not spread.skipped


@pytest.mark.parametrize("rank", range(8))
def test_an_injected_delay_is_found_on_any_rank(rank):
    values = [5000.0, 5400.0, 4800.0, 5100.0, 6200.0, 4700.0, 5300.0, 5050.0]  # CPU phase times, us
    values[rank] += 20_000  # --inject-delay RANK:20000
    assert [flag.rank for flag in find_outliers(values, CPU_RULE).flags] == [rank]


def test_cpu_rule_flags_nothing_on_noisy_healthy_ranks():
    # sigma 0.3 lognormal (values spread +-35%) over 4-8 ranks, 200 seeds: the CPU rule flags none.
    false_flags = sum(bool(find_outliers(_healthy(seed, 0.3, 5000.0), CPU_RULE).flags) for seed in SEEDS)
    assert false_flags / len(SEEDS) <= 0.01, false_flags


def test_gpu_rule_flags_nothing_on_gpu_like_noise_and_finds_a_45_percent_slow_rank():
    false_flags = sum(bool(find_outliers(_healthy(seed, 0.05, 100.0), GPU_RULE).flags) for seed in SEEDS)
    assert false_flags == 0
    found = 0
    for seed in SEEDS:
        values = _healthy(seed, 0.05, 100.0)
        slow = seed % len(values)
        values[slow] *= 1.45  # a rank whose links run 31% slow takes 1 / 0.69 = 1.45x the time
        found += [flag.rank for flag in find_outliers(values, GPU_RULE).flags] == [slow]
    assert found / len(SEEDS) >= 0.75, found


def test_the_gpu_rule_is_too_tight_for_cpu_noise():
    # Why the CPU run has its own rule: sigma 0.3 noise trips the GPU rule in a few percent of cases.
    false_flags = sum(bool(find_outliers(_healthy(seed, 0.3, 100.0), GPU_RULE).flags) for seed in SEEDS)
    assert false_flags > 2


def test_each_condition_of_the_rule_is_needed():
    same = [100.0] * 7
    assert find_outliers([*same, 130.0], GPU_RULE).flags  # MAD 0, +30%, +30 us: flagged
    assert not find_outliers([*same, 120.0], GPU_RULE).flags  # +20% < 25%
    assert not find_outliers([1.0] * 7 + [9.0], GPU_RULE).flags  # +800% but only 8 us (jitter floor 10)
    spread_out = [100.0, 140.0, 60.0, 120.0, 80.0, 150.0, 50.0, 175.0]  # +75 us but < 5 scaled MADs
    assert not find_outliers(spread_out, GPU_RULE).flags
    assert not find_outliers([*same, 40.0], GPU_RULE).flags  # smaller is better: never flagged
    flag = find_outliers([0.0] * 7 + [50.0], GPU_RULE).flags[0]  # median 0 (arrival lateness)
    assert math.isinf(flag.excess_pct) and math.isinf(flag.mads)


def test_two_ranks_are_not_judged_and_say_why():
    spread = find_outliers([10.0, 500.0], GPU_RULE, case="balanced 1 MiB")
    assert spread.skipped and not spread.flags
    assert "fewer than 3 ranks means nothing" in spread.skipped
    missing = find_outliers({0: 10.0, 1: None, 2: float("nan"), 3: 12.0}, GPU_RULE)
    assert missing.ranks == 2 and missing.skipped


def _flagged(rank: int | None, case: str = "c") -> CaseSpread:
    flags = () if rank is None else (RankFlag(rank, 55.0, 10.0, 1.0, 45.0, 45.0, 450.0),)
    return CaseSpread(case, "arrival", "us", 8, 10.0, 1.0, flags)


@pytest.mark.parametrize(
    ("rule", "reruns", "status", "note"),
    [
        (GPU_RULE, [5, 5], "FAIL", "flagged again in 2 of 2 reruns"),
        (GPU_RULE, [5, None], "WARN", "not reproduced (flagged again in 1 of 2 reruns; rule: all)"),
        (GPU_RULE, [3, 3], "WARN", "not reproduced (flagged again in 0 of 2 reruns"),
        (GPU_RULE, [], "WARN", "not confirmed: the case was not rerun"),
        (SpreadRule(confirm_reruns=3, confirm_rule="majority"), [5, 5, None], "FAIL", "2 of 3 reruns"),
        (SpreadRule(confirm_reruns=3, confirm_rule="majority"), [5, None, None], "WARN", "1 of 3 reruns"),
        (SpreadRule(confirm_reruns=2, confirm_rule="majority"), [5, None], "WARN", "1 of 2 reruns"),
        (SpreadRule(confirm_reruns=0), [], "FAIL", "not rerun (spread.confirm_reruns is 0)"),
    ],
)
def test_confirmation_by_reruns(rule, reruns, status, note):
    outcome = confirm(_flagged(5), [_flagged(rank) for rank in reruns], rule)
    assert [item.status for item in outcome.confirmed] == [status]
    assert note in outcome.confirmed[0].note
    assert outcome.status == status


def test_outcome_status_of_clean_and_skipped_cases():
    assert confirm(_flagged(None), [], GPU_RULE).status == "PASS"
    skipped = find_outliers([1.0, 2.0], GPU_RULE)
    assert confirm(skipped, [], GPU_RULE).status == "SKIP"
    assert needs_rerun([_flagged(5), _flagged(None), skipped], GPU_RULE) == [_flagged(5)]
    assert needs_rerun([_flagged(5)], SpreadRule(confirm_reruns=0)) == []


def test_outliers_by_case_over_rank_rows():
    rows = []
    for size, slow in ((1 << 20, 6), (16 << 20, None)):
        for rank in range(8):
            late = 12.0 + rank % 3 + (200.0 if rank == slow else 0.0)
            rows.append(
                {"pattern": "balanced", "phase": "alltoall", "size_bytes": size, "rank": rank, "late": late}
            )
    rows.append({"pattern": "balanced", "phase": "alltoall", "size_bytes": 1 << 20, "rank": 8, "late": None})
    spreads = outliers_by_case(pd.DataFrame(rows), "late", GPU_RULE, metric="arrival lateness")
    assert [s.case for s in spreads] == ["balanced 1 MiB", "balanced 16 MiB"]
    assert [f.rank for f in spreads[0].flags] == [6] and spreads[0].ranks == 8
    assert spreads[1].flags == () and spreads[0].metric == "arrival lateness"
    assert outliers_by_case(pd.DataFrame(rows), "absent", GPU_RULE) == []


def _measured(values: list[float], rule: SpreadRule = GPU_RULE) -> CaseSpread:
    return find_outliers(values, rule, case="c", metric="arrival")


def test_launch_noise_is_how_far_the_other_ranks_moved_between_measurements() -> None:
    first = _measured([10, 11, 10, 12, 10, 80, 11, 10])
    again = _measured([14, 11, 10, 18, 10, 80, 11, 10])  # ranks 0 and 3 moved by 4 and 6
    assert launch_noise([first, again], rank=5) == 0.0  # the median over the seven other ranks' ranges
    moved = _measured([30, 31, 30, 32, 30, 100, 31, 30])  # every other rank moved by 20
    assert launch_noise([first, moved], rank=5) == pytest.approx(20.0)
    assert launch_noise([first], rank=5) == 0.0  # one measurement: no noise known


def test_a_repeated_flag_fails_only_above_the_launch_noise() -> None:
    steady = [_measured([10, 11, 10, 12, 10, 80, 11, 10]) for _ in range(3)]
    outcome = confirm(steady[0], steady[1:], GPU_RULE)
    assert (
        outcome.status == "FAIL" and "flagged again in 2 of 2 reruns; gap >= 69" in outcome.confirmed[0].note
    )
    # The same 69 us gap in a launch whose healthy ranks themselves move by ~40 us between measurements.
    first = _measured([10, 11, 10, 12, 10, 80, 11, 10])
    noisy = [_measured([50, 51, 50, 52, 50, 125, 51, 50]), _measured([50, 51, 50, 52, 50, 125, 51, 50])]
    outcome = confirm(first, noisy, GPU_RULE)
    (item,) = outcome.confirmed
    assert item.status == "WARN" and "within the launch's noise" in item.note and item.repeats == 2


@pytest.mark.parametrize(("planted", "status"), [((), "WARN"), ((5,), "FAIL"), ((2,), "WARN")])
def test_a_cpu_run_timing_finding_is_a_warn_unless_planted(planted, status) -> None:
    steady = [_measured([5000, 5100, 5000, 5200, 5000, 30000, 5100, 5000], CPU_RULE) for _ in range(3)]
    outcome = confirm(steady[0], steady[1:], CPU_RULE, cpu_run=True, planted=planted)
    (item,) = outcome.confirmed
    assert item.status == status
    assert ("--inject-delay" in item.note) == (status == "FAIL")
    assert ("CPU run" in item.note) == (status == "WARN")
    # The same finding on a GPU run FAILs: the cap is the CPU run's, not the rule's.
    assert confirm(steady[0], steady[1:], CPU_RULE).status == "FAIL"


def test_timing_status_only_touches_a_cpu_run_fail() -> None:
    assert timing_status("WARN", "n", cpu_run=True, planted=False) == ("WARN", "n")
    assert timing_status("FAIL", "n", cpu_run=False, planted=False) == ("FAIL", "n")
    assert timing_status("FAIL", "n", cpu_run=True, planted=False)[0] == "WARN"

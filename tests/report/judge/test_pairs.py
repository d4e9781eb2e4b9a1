"""The pairwise link test judged: the class-median rule on synthetic pairs (no false flags under noise, the
slow pair named), confirmation by reruns, the spec floors, the bisect line and the [src][dst] matrix."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from commbench.inputs.limits import load_limits
from commbench.inputs.specs import load_spec, no_spec
from commbench.report.frame import pair_frame
from commbench.report.judge.pairs import (
    bisect_element,
    class_stats,
    confirm_pairs,
    find_slow_pairs,
    pair_elements,
    pair_matrix,
    rerun_rounds,
)
from commbench.report.judge.verdict import Element

SIZE = 1 << 20
CPU = load_limits(None)
GPU = load_limits("gb300-nvl72")
NVL72 = load_spec("gb300-nvl72")


def pairs(world: int, time_us: dict[tuple[str, int, int], float] | None = None, base: float = 1000.0,
          noise: float = 0.0, seed: int = 0, per_domain: int | None = None) -> pd.DataFrame:  # fmt: skip
    """Every ordered pair and test, times ``base`` x lognormal noise, some set by ``time_us``."""
    rng = np.random.default_rng(seed)
    rows = []
    for test in ("latency", "bandwidth", "bidir"):
        for src in range(world):
            for dst in range(world):
                if src == dst:
                    continue
                same = per_domain is None or src // per_domain == dst // per_domain
                time = base * (0.05 if test == "latency" else 1.0) * float(np.exp(rng.normal(0, noise)))
                time = (time_us or {}).get((test, src, dst), time)
                rows.append({
                    "test": test, "src": src, "dst": dst, "size_bytes": 8 if test == "latency" else SIZE,
                    "iters": 10, "time_us": time, "wrong": 0, "round": 0,
                    "link_class": "nvlink" if same else "scaleout", "src_host": f"h{src // 4}",
                    "src_device": src % 4, "src_domain": 0, "dst_host": f"h{dst // 4}", "dst_device": dst % 4,
                    "dst_domain": 0,
                })  # fmt: skip
    return pd.DataFrame(rows)


def judge(frame: pd.DataFrame, limits=CPU, spec=None):
    frame = pair_frame(frame, spec or no_spec("test"))
    stats = class_stats(frame, limits.pairwise)
    return frame, stats, find_slow_pairs(frame, stats, limits.pairwise)


def test_healthy_noisy_pairs_are_rarely_flagged_and_never_confirmed() -> None:
    # Lognormal sigma 0.3: gloo-like spread (0.4x-2.2x of the median seen on 2 cores); 8 ranks, 56 pairs.
    flagged = failed = 0
    for seed in range(200):
        _, stats, flags = judge(pairs(8, noise=0.3, seed=seed))
        reruns = (
            [judge(pairs(8, noise=0.3, seed=1000 * (seed + 1) + k))[0] for k in range(2)] if flags else []
        )
        confirmed = confirm_pairs(flags, stats, reruns, CPU.pairwise, CPU.spread)
        flagged += bool(flags)
        failed += any(item.status == "FAIL" for item in confirmed)
    assert flagged <= 10 and failed == 0


def test_one_slow_direction_is_flagged_alone_and_named() -> None:
    slow = {("bandwidth", 1, 2): 4000.0, ("latency", 1, 2): 5000.0}
    frame, stats, flags = judge(pairs(4, slow, noise=0.1))
    assert sorted(flag.key for flag in flags) == [("bandwidth", 1, 2), ("latency", 1, 2)]
    bandwidth = next(flag for flag in flags if flag.test == "bandwidth")
    assert bandwidth.off_pct == pytest.approx(75.0, abs=3)  # 1/4 of the class bandwidth
    confirmed = confirm_pairs(flags, stats, [frame, frame], CPU.pairwise, CPU.spread)
    elements = pair_elements(frame, stats, confirmed, CPU.pairwise, cpu_run=True)
    failed = [e for e in elements if e.status == "FAIL"]
    assert [e.name for e in failed] == ["latency nvlink 1->2", "bandwidth nvlink 1->2"]
    assert failed[1].message.startswith("rank 1 (host h0, GPU 1) -> rank 2 (host h0, GPU 2), NVLink: one-way")
    assert (
        "75% below the class median" in failed[1].message and "flagged again in 2 of 2" in failed[1].message
    )


def test_a_flag_that_never_repeats_passes_and_one_that_sometimes_does_warns() -> None:
    frame, stats, flags = judge(pairs(4, {("bandwidth", 3, 0): 5000.0}))
    healthy = pair_frame(pairs(4), no_spec("test"))
    confirmed = confirm_pairs(flags, stats, [healthy, healthy], CPU.pairwise, CPU.spread)
    assert [(c.status, c.note) for c in confirmed] == [
        ("PASS", "not reproduced (flagged again in 0 of 2 reruns): noise, not a finding")
    ]
    statuses = {e.name: e.status for e in pair_elements(frame, stats, confirmed, CPU.pairwise, cpu_run=True)}
    assert statuses["bandwidth nvlink"] == "PASS" and statuses["bandwidth nvlink 3->0"] == "PASS"
    confirmed = confirm_pairs(flags, stats, [frame, healthy], CPU.pairwise, CPU.spread)
    assert [(c.status, c.note) for c in confirmed] == [
        ("WARN", "intermittent (flagged again in 1 of 2 reruns; rule: all)")
    ]
    assert rerun_rounds(flags) == [[(0, 3)]]


def test_classes_are_judged_apart_and_small_classes_skip() -> None:
    # 2 domains of 2: 4 NVLink ordered pairs, 8 scale-out; the scale-out pairs are slower as a class.
    slow_class = {("bandwidth", a, b): 3000.0 for a in range(4) for b in range(4) if a // 2 != b // 2}
    frame, stats, flags = judge(pairs(4, slow_class, per_domain=2))
    assert not flags
    by_class = {(s.test, s.link_class): s for s in stats}
    assert by_class[("bandwidth", "scaleout")].median == pytest.approx(3000.0)
    assert not by_class[("bandwidth", "nvlink")].skipped  # 4 pairs >= min_pairs 3
    frame, stats, _ = judge(pairs(2))
    assert all(s.skipped for s in stats)


def test_the_slowest_pair_is_judged_against_the_spec_floor_on_gpu() -> None:
    # 1 MiB in 2.5 us = 419 GB/s = 0.47 of 900: below the FAIL floor 0.5; the rest at 0.93.
    times = {("bandwidth", a, b): SIZE / 838.0 / 1e3 for a in range(4) for b in range(4) if a != b}
    times[("bandwidth", 0, 3)] = SIZE / 419.0 / 1e3
    frame, stats, flags = judge(pairs(4, times), GPU, NVL72)
    elements = pair_elements(frame, stats, [], GPU.pairwise, cpu_run=False)
    floor = next(e for e in elements if e.name == "bandwidth nvlink vs spec")
    assert (
        floor.status == "FAIL" and floor.limit == 0.5 and "rank 0 (host h0, GPU 0) -> rank 3" in floor.message
    )
    cpu_elements = pair_elements(*judge(pairs(4))[:2], [], CPU.pairwise, cpu_run=True)
    assert {e.status for e in cpu_elements if e.name.endswith("vs spec")} == {"SKIP"}


def test_bisect_says_contention_when_no_pair_is_slow() -> None:
    slow_case = Element("balanced", "balanced 1 GiB busbw", "FAIL", "below floor")
    pair_ok = Element("pairwise", "bandwidth nvlink", "PASS", "fine")
    contention = bisect_element([slow_case, pair_ok])
    assert (
        contention is not None
        and contention.status == "WARN"
        and "contention, not a single link" in contention.message
    )
    pair_bad = Element("pairwise", "bandwidth nvlink 1->2", "FAIL", "slow")
    explained = bisect_element([slow_case, pair_ok, pair_bad])
    assert explained is not None and "1->2 can explain it" in explained.message
    assert bisect_element([pair_ok]).status == "PASS"
    assert bisect_element([slow_case]) is None


def test_the_matrix_is_indexed_src_then_dst() -> None:
    frame = pair_frame(pairs(3, {("bandwidth", 2, 0): 2000.0}), no_spec("test"))
    matrix = pair_matrix(frame, "bandwidth")
    assert matrix.shape == (3, 3) and np.isnan(matrix.iat[1, 1])
    assert matrix.iat[2, 0] == pytest.approx(SIZE / 2000.0 / 1e3) and matrix.iat[0, 2] == pytest.approx(
        SIZE / 1e6
    )


def _with_windows(frame: pd.DataFrame, spread_us: float) -> pd.DataFrame:
    """The pairs' repeat windows ``spread_us`` apart per message (time_us_min/max around time_us)."""
    return frame.assign(
        time_us_min=frame["time_us"] - spread_us / 2, time_us_max=frame["time_us"] + spread_us / 2
    )


def test_a_repeated_slow_pair_fails_only_above_its_class_noise() -> None:
    slow = {("bandwidth", 1, 2): 4000.0}  # 3000 us per message above the 1000 us class median
    for spread_us, status in ((100.0, "FAIL"), (2000.0, "WARN")):
        frame, stats, flags = judge(_with_windows(pairs(4, slow), spread_us))
        (stat,) = [s for s in stats if (s.test, s.link_class) == ("bandwidth", "nvlink")]
        assert stat.noise_us == pytest.approx(spread_us)
        (item,) = confirm_pairs(flags, stats, [frame, frame], CPU.pairwise, CPU.spread)
        assert item.status == status, item.note
        assert ("within the launch's noise" in item.note) == (status == "WARN")


@pytest.mark.parametrize(("planted", "status"), [((), "WARN"), (((1, 2),), "FAIL"), (((2, 1),), "WARN")])
def test_a_cpu_run_slow_pair_is_a_warn_unless_it_is_the_planted_direction(planted, status) -> None:
    frame, stats, flags = judge(pairs(4, {("bandwidth", 1, 2): 4000.0}))
    (item,) = confirm_pairs(
        flags, stats, [frame, frame], CPU.pairwise, CPU.spread, cpu_run=True, planted=planted
    )
    assert item.status == status
    assert ("--inject-delay" in item.note) == (status == "FAIL")

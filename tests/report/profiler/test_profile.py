"""The profiler's report on synthetic tables: step statistics (max across ranks names the rank), the
straggler rule (last share, lateness against the others' median), and the Chrome trace's structure."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from commbench.report.profiler.profile import chrome_trace, step_stats, straggler_stats

CASE = {"pattern": "deepseek-v3", "skew": "zipf:1.2", "phase": "dispatch", "size_bytes": None, "window": 0}


def steps_frame() -> pd.DataFrame:
    rows = []
    for rank in range(4):
        for iteration in range(10):
            pack = 10.0 + rank  # rank 3 packs longest
            transfer = 100.0 + (50.0 if rank == 1 else 0.0)
            other = 5.0
            phase = pack + transfer + other
            values = {"pack": pack, "payload transfer": transfer, "other": other, "phase": phase}
            for step, us in {**values, "transfer": transfer}.items():
                rows.append({**CASE, "rank": rank, "iteration": iteration, "step": step, "us": us})
    return pd.DataFrame(rows)


def test_step_statistics_name_the_slowest_rank_and_shares_add_up() -> None:
    stats = step_stats(steps_frame()).set_index("step")
    assert stats.loc["pack", "max_rank_us"] == 13.0 and stats.loc["pack", "slowest_rank"] == 3
    assert stats.loc["payload transfer", "slowest_rank"] == 1
    assert (
        stats.loc["payload transfer", "p50_us"] == 100.0 and stats.loc["payload transfer", "p99_us"] == 150.0
    )
    parts = stats.loc[["pack", "payload transfer", "other"], "share_pct"].sum()
    assert parts == pytest.approx(100.0)
    assert stats.loc["phase", "share_pct"] == pytest.approx(100.0)


def arrivals(late_rank: int, delay_us: float, jitter_us: float = 50.0, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for iteration in range(20):
        entered = rng.uniform(0, jitter_us, size=4)
        entered[late_rank] += delay_us
        entered -= entered.min()
        for rank in range(4):
            rows.append({**CASE, "rank": rank, "iteration": iteration, "entered_us": entered[rank],
                         "left_us": entered.max() + 100.0, "waited_us": entered.max() - entered[rank],
                         "uncertainty_us": 0.0 if rank == 0 else 20.0})  # fmt: skip
    return pd.DataFrame(rows)


def test_the_late_rank_is_last_every_time_with_its_lateness() -> None:
    stats = straggler_stats(arrivals(2, 5000.0)).set_index("rank")
    assert stats.loc[2, "last_pct"] == 100.0
    assert stats.loc[2, "lateness_mean_us"] == pytest.approx(5000.0, abs=60.0)
    assert (stats.drop(index=2)["last_pct"] == 0.0).all()
    assert stats.loc[2, "waited_p50_us"] == 0.0 and (stats.drop(index=2)["waited_p50_us"] > 4900).all()
    assert stats.loc[1, "clock_uncertainty_us"] == 20.0


def test_without_a_late_rank_no_rank_is_always_last() -> None:
    stats = straggler_stats(arrivals(0, 0.0, jitter_us=50.0, seed=3))
    assert stats["last_pct"].max() < 60.0 and stats["lateness_mean_us"].abs().max() < 60.0


def test_the_trace_has_a_process_per_rank_and_a_track_per_step() -> None:
    spans = [
        {"rank": rank, "track": track, "name": track, "start": 100.0 + rank * 1e-3 + offset, "duration": 2e-4,
         "args": {"iteration": 0}}
        for rank in range(3) for track, offset in (("phase", 0.0), ("pack", 1e-5), ("payload transfer", 5e-5))
    ]  # fmt: skip
    events = chrome_trace(spans, {0: "host a, GPU 0"})["traceEvents"]
    assert all({"name", "ph", "ts", "pid", "tid"} <= set(event) for event in events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (host a, GPU 0)", 1: "rank 1", 2: "rank 2"}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 9 and min(e["ts"] for e in complete) == 0.0
    assert {e["dur"] for e in complete} == {200.0}
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert len(tracks) == 9  # three tracks in each of three processes

"""commbench profile on 4 gloo ranks: the step table (steps inside each phase), the straggler named with an
injected delay (>= 90% of iterations last, lateness within 20% of the delay), a valid Chrome trace with one
process per rank, shmem-emu's own steps and per-peer arrivals, and bad combinations refused."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from commbench.cli import cli
from commbench.report.profiler.profile import straggler_stats
from tests.launches import launch

PROFILE = ["profile", "--world-size", "4", "--skew", "zipf:1.2", "--tokens", "256", "--warmup", "2"]
PROFILE += ["--iters", "10"]
# Large beside the barrier-exit skew of ranks sharing 2 busy cores (a few ms; 14 ms seen under heavy load,
# beside the 20% the lateness is held to).
DELAY_US = 200000.0


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    args = [*PROFILE, "--backend", "gloo", "--trace", "--inject-delay", f"2:{DELAY_US:g}"]
    return launch(args, tmp_path_factory.mktemp("profile"), codes=(1,)).out  # the straggler fails it


def test_each_phase_is_split_into_its_steps(profiled: Path) -> None:
    steps = pd.read_csv(profiled / "profile.csv")
    by_phase = {phase: set(rows["step"]) for phase, rows in steps.groupby("phase")}
    assert by_phase["dispatch"] >= {
        "count exchange",
        "pack",
        "payload transfer",
        "other",
        "phase",
        "transfer",
    }
    assert by_phase["combine"] >= {"send-back", "weighted reduce", "other", "phase", "transfer"}
    assert set(steps["rank"]) == {0, 1, 2, 3} and set(steps["iteration"]) == set(range(10))
    wide = steps.pivot_table(index=["phase", "rank", "iteration"], columns="step", values="us")
    parts = wide.drop(columns=["phase", "transfer"]).sum(axis=1)
    # The steps and "other" add up to the phase time; the named steps never exceed it.
    assert (abs(parts - wide["phase"]) <= 1e-3 * wide["phase"] + 1.0).all()
    assert (
        wide.drop(columns=["phase", "transfer", "other"]).sum(axis=1) <= wide["phase"] * 1.001 + 1.0
    ).all()
    summary = (profiled / "summary.md").read_text()
    assert "## Profile: where the time goes" in summary and "## Who arrives late" in summary


def test_the_injected_straggler_is_named_with_its_lateness(profiled: Path) -> None:
    stats = straggler_stats(pd.read_csv(profiled / "arrivals.csv"))
    for case, rows in stats.groupby("case"):
        worst = rows.sort_values("last_pct", ascending=False).iloc[0]
        assert worst["rank"] == 2 and worst["last_pct"] >= 90.0, case
        assert abs(worst["lateness_p50_us"] - DELAY_US) <= 0.2 * DELAY_US, (case, worst.to_dict())
        others = rows[rows["rank"] != 2]
        assert (others["last_pct"] <= 10.0).all()


def test_the_trace_is_chrome_trace_format_with_a_process_per_rank(profiled: Path) -> None:
    trace = json.loads((profiled / "trace.json").read_text())
    events = trace["traceEvents"]
    assert all({"name", "ph", "ts", "pid", "tid"} <= set(event) for event in events)
    assert {event["pid"] for event in events} == {0, 1, 2, 3}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {name.split(" (")[0] for name in names} == {"rank 0", "rank 1", "rank 2", "rank 3"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {"payload transfer", "send-back", "deepseek-v3 dispatch"} <= {e["name"] for e in spans}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    page = (profiled / "report.html").read_text()
    assert "Per rank: p50 of each step per iteration (stacked)" in page


def test_shmem_emu_has_its_own_steps_and_per_peer_arrivals(tmp_path: Path) -> None:
    out = launch([*PROFILE, "--backend", "shmem-emu"], tmp_path, "emu", codes=(0, 1)).out
    steps = set(pd.read_csv(out / "profile.csv")["step"])
    assert {"put issue", "signal wait", "pack", "weighted reduce"} <= steps
    peers = pd.read_csv(out / "peers.csv")
    assert (
        set(peers["dst"]) == {0, 1, 2, 3}
        and set(peers["src"]) <= {0, 1, 2, 3}
        and (peers["seen_us"] >= 0).all()
    )
    assert "Per-peer arrivals" in (out / "summary.md").read_text()


def test_profile_with_window_timing_is_refused(tmp_path: Path) -> None:
    args = [*PROFILE, "--backend", "gloo", "--timing", "window", "--out", str(tmp_path / "x")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "drop --timing window" in result.stderr
    assert not (tmp_path / "x").exists()

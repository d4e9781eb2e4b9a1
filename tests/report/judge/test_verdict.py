"""The verdict: every status path, every exit code, the CPU run, and verdict.json's schema round trip."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

from commbench.errors import CommError, StoppedError, UsageError, VerificationError
from commbench.inputs.limits import load_limits
from commbench.inputs.specs import load_spec
from commbench.report.frame import results_frame
from commbench.report.judge.outliers import confirm, find_outliers
from commbench.report.judge.verdict import (
    SCHEMA,
    Element,
    RunStatus,
    build_verdict,
    console_line,
    read_verdict_json,
    run_status_from_error,
    verdict_dict,
    verdict_from_dict,
    write_verdict_json,
)
from tests.report.rows import row_from_matrix

GB300 = load_spec("gb300-nvl72")
RANKS = 8


def _balanced(size: int, busbw_GBps: float | None = None, time_us: float | None = None, **extra):
    """A balanced row of ``size`` bytes per rank at ``busbw_GBps`` (or taking ``time_us``)."""
    matrix = np.full((RANKS, RANKS), size // RANKS)
    link_bytes = size // RANKS * (RANKS - 1)
    time_us = time_us if time_us is not None else link_bytes / (busbw_GBps * 1e3)
    return row_from_matrix(matrix, time_us, pattern="balanced", phase="alltoall", size_bytes=size, **extra)


def _moe(phase: str, per_peer: int, busbw_GBps: float, **extra):
    matrix = np.full((RANKS, RANKS), per_peer)
    time_us = per_peer * (RANKS - 1) / (busbw_GBps * 1e3)
    return row_from_matrix(matrix, time_us, pattern="deepseek-v3", phase=phase, **extra)


def _healthy_rows():
    return [
        _balanced(1 << 20, time_us=20.0),
        _balanced(64 << 20, busbw_GBps=400.0),
        _balanced(1 << 30, busbw_GBps=640.0),
        _balanced(4 << 30, busbw_GBps=660.0),
        _moe("dispatch", 16 << 20, 450.0),
        _moe("combine", 16 << 20, 470.0),
    ]


def _verdict(rows, spec=GB300, run=None, spreads=(), limits=None, **kwargs):
    limits = limits or load_limits(spec.name if spec else None)
    frame = results_frame(rows, spec or GB300)
    return build_verdict(frame, limits, spec, "detected: 4 x NVIDIA GB300", run, spreads, **kwargs)


def _by_name(verdict):
    return {(e.group, e.name): e for e in verdict.elements}


def test_a_healthy_rack_passes_with_exit_0():
    verdict = _verdict(_healthy_rows())
    assert verdict.status == "PASS" and verdict.exit_code == 0
    assert verdict.counts() == {"PASS": 9, "WARN": 0, "FAIL": 0, "SKIP": 0}
    assert verdict.reason == "all 9 judged checks passed"
    elements = _by_name(verdict)
    huge = elements[("balanced", "balanced 4 GiB")]
    assert huge.message == "balanced 4 GiB busbw 660 GB/s >= 0.65 x 900 GB/s"
    assert (huge.measured, huge.limit, huge.unit) == (660.0, 585.0, "GB/s")
    small = elements[("balanced", "balanced 1 MiB")]
    assert small.unit == "us" and small.measured == 20.0
    assert small.limit == pytest.approx(40 + 0.6 * 7 + 917504 / 9e5, abs=1e-3)  # + link bytes at 900 GB/s
    assert elements[("moe", "deepseek-v3 dispatch")].status == "PASS"


def test_below_the_warn_floor_warns_with_exit_0():
    verdict = _verdict([*_healthy_rows()[:3], _balanced(4 << 30, busbw_GBps=560.0)])
    assert verdict.status == "WARN" and verdict.exit_code == 0
    assert verdict.reason == "balanced 4 GiB busbw 560 GB/s < 0.65 x 900 GB/s"
    assert "nvidia-smi nvlink -s" in _by_name(verdict)[("balanced", "balanced 4 GiB")].remedy


def test_below_the_fail_floor_fails_with_exit_1_and_names_the_case():
    rows = [*_healthy_rows(), _balanced(16 << 30, busbw_GBps=410.0), _moe("combine", 32 << 20, 100.0)]
    verdict = _verdict(rows)
    assert verdict.status == "FAIL" and verdict.exit_code == 1
    assert verdict.reason == "balanced 16 GiB busbw 410 GB/s < 0.6 x 900 GB/s (+1 more FAIL)"
    failed = _by_name(verdict)[("balanced", "balanced 16 GiB")]
    assert failed.limit == 540.0 and failed.remedy
    assert _by_name(verdict)[("moe", "deepseek-v3 combine #2")].message.endswith("< 0.2 x 900 GB/s")
    line = console_line(verdict, "out/rack1")
    assert line == (
        "commbench verdict: FAIL (2 FAIL, 0 WARN, 9 PASS, 0 SKIP) - balanced 16 GiB busbw 410 GB/s < 0.6 x "
        "900 GB/s (+1 more FAIL); report: out/rack1"
    )


def test_balanced_rows_are_judged_on_nccl_tests_mean_time_moe_rows_on_p50():
    # A balanced row whose mean time (nccl-tests' time) is 20% above its p50: judged on the mean.
    row = _balanced(4 << 30, busbw_GBps=600.0)
    row["time_us_mean"] = row["time_us_p50"] * 1.2  # busbw from the mean: 500 GB/s < 0.6 x 900
    element = _by_name(_verdict([row]))[("balanced", "balanced 4 GiB")]
    assert element.status == "FAIL" and element.measured == 500.0
    small = _balanced(1 << 20, time_us=20.0)
    small["time_us_mean"] = 150.0
    assert _by_name(_verdict([small]))[("balanced", "balanced 1 MiB")].measured == 150.0
    moe = _moe("combine", 16 << 20, 450.0)
    moe["time_us_mean"] = moe["time_us_p50"] * 3  # an MoE row's figures come from p50
    assert _by_name(_verdict([moe]))[("moe", "deepseek-v3 combine")].status == "PASS"


def test_a_slow_small_all_to_all_fails_its_latency_ceiling():
    verdict = _verdict([_balanced(512 << 10, time_us=130.0)])
    element = _by_name(verdict)[("balanced", "balanced 512 KiB")]
    assert element.status == "FAIL" and element.limit == pytest.approx(80 + 4.2 + 458752 / 9e5, abs=1e-3)
    assert "latency ceiling for 8 ranks" in element.message


def test_a_limit_override_changes_the_verdict():
    rows = [_balanced(16 << 30, busbw_GBps=580.0)]
    assert _verdict(rows).status == "WARN"
    loose = load_limits("gb300-nvl72", overrides=["balanced.huge.busbw_warn_fraction=0.62"])
    assert _verdict(rows, limits=loose).status == "PASS"


def test_small_moe_phases_and_emulated_rows_are_skipped_not_judged():
    rows = [_moe("dispatch", 1 << 16, 1.0), _balanced(1 << 30, busbw_GBps=1.0, emulated=True, backend="sim")]
    verdict = _verdict(rows)
    elements = _by_name(verdict)
    assert elements[("moe", "deepseek-v3 dispatch")].status == "SKIP"
    assert "< moe.min_bytes 16 MiB" in elements[("moe", "deepseek-v3 dispatch")].message
    assert elements[("balanced", "balanced 1 GiB")].message.startswith("sim is emulated")
    assert verdict.status == "PASS"


def test_a_cpu_run_judges_only_what_can_be_judged():
    rows = [*_healthy_rows(), _balanced(4 << 30, busbw_GBps=0.5)]  # 0.06% of an NVLink: not a finding
    verdict = _verdict(rows, spec=None)
    assert verdict.status == "PASS" and verdict.exit_code == 0
    assert verdict.spec_name is None and verdict.spec_GBps is None
    bandwidth = [e for e in verdict.elements if e.group in ("balanced", "moe")]
    assert bandwidth and all(e.status == "SKIP" and "CPU run: no GPU spec" in e.message for e in bandwidth)
    judged = {e.group for e in verdict.elements if e.status == "PASS"}
    assert judged == {"run", "data", "harness"}
    assert verdict.reason == "all 3 judged checks passed; CPU run: no GPU spec, bandwidth not judged"


def test_wrong_data_fails_with_exit_3_and_an_element_naming_the_case():
    rows = [*_healthy_rows()[:2], _balanced(16 << 20, busbw_GBps=300.0, wrong=4096)]
    verdict = _verdict(rows, run=run_status_from_error(VerificationError("alltoall #wrong=4096")))
    assert verdict.status == "FAIL" and verdict.exit_code == 3
    element = _by_name(verdict)[("data", "balanced 16 MiB #wrong")]
    assert element.status == "FAIL" and element.measured == 4096 and element.limit == 0
    assert "ECC" in element.remedy and verdict.reason.startswith("balanced 16 MiB #wrong 4096")
    # The stop reason alone (rows lost) still gives a FAIL element and exit 3.
    lost = _verdict([], run=RunStatus("wrong_data", "dispatch #wrong=7"))
    assert lost.exit_code == 3 and _by_name(lost)[("data", "#wrong")].status == "FAIL"


@pytest.mark.parametrize(
    ("error", "state"),
    [
        (CommError("job 'balanced' alltoall: collective timed out after 300 s on rank 3"), "timed_out"),
        (CommError("rank 5 died (exit code -9) during job 'balanced'"), "rank_died"),
    ],
)
def test_a_dead_rank_or_a_timeout_fails_with_exit_4(error, state):
    verdict = _verdict(_healthy_rows()[:2], run=run_status_from_error(error))
    assert verdict.run.state == state
    assert verdict.status == "FAIL" and verdict.exit_code == 4
    completion = _by_name(verdict)[("run", "completion")]
    assert completion.status == "FAIL" and str(error) in completion.message
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" in completion.remedy


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stopped_run_is_incomplete_with_the_signal_exit_code(signum, code):
    verdict = _verdict(_healthy_rows()[:2], run=run_status_from_error(StoppedError(signum)))
    assert verdict.status == "INCOMPLETE" and verdict.exit_code == code
    assert verdict.reason == f"interrupted: stopped by {signal.Signals(signum).name}"
    assert _by_name(verdict)[("run", "completion")].status == "SKIP"
    assert run_status_from_error(KeyboardInterrupt()).signum == 2


def test_could_not_run_is_incomplete_with_exit_2():
    verdict = _verdict([], run=run_status_from_error(UsageError("nvshmem is not installed; pip install ...")))
    assert verdict.status == "INCOMPLETE" and verdict.exit_code == 2
    assert verdict.reason == "could not run: nvshmem is not installed; pip install ..."
    unexpected = run_status_from_error(RuntimeError("boom"))
    assert unexpected.state == "incomplete" and "RuntimeError: boom" in unexpected.reason
    assert run_status_from_error(None) == RunStatus()


def test_extra_elements_join_the_verdict():
    extra = Element("baseline", "balanced 1 GiB vs baseline", "WARN", "busbw 7% below the baseline median")
    verdict = _verdict(_healthy_rows(), extra=[extra])
    assert verdict.status == "WARN" and verdict.elements[-1] == extra and verdict.exit_code == 0


def test_a_broken_timing_fails_the_harness_check():
    verdict = _verdict([_balanced(1 << 30, time_us=0.0)])
    harness = _by_name(verdict)[("harness", "timings")]
    assert harness.status == "FAIL" and "not finite, positive and ordered" in harness.message


def test_a_confirmed_slow_rank_fails_naming_host_and_gpu():
    rule = load_limits("gb300-nvl72").spread
    first = find_outliers([10, 11, 10, 12, 10, 55, 11, 10], rule, case="balanced 1 GiB", metric="arrival")
    confirmed = confirm(first, [first, first], rule)
    unconfirmed = confirm(first, [first, find_outliers([10.0] * 8, rule)], rule)
    verdict = _verdict(_healthy_rows(), spreads=[confirmed], rank_names={5: "host h2, GPU 1"})
    assert verdict.status == "FAIL" and verdict.exit_code == 1
    element = _by_name(verdict)[("spread", "balanced 1 GiB arrival rank 5")]
    assert element.message.startswith("rank 5 (host h2, GPU 1) arrival 55.0 us vs median 10.5 us (+424%,")
    assert "flagged again in 2 of 2 reruns" in element.message and "sendrecv_perf" in element.remedy
    warned = _verdict(_healthy_rows(), spreads=[unconfirmed])
    assert warned.status == "WARN" and warned.exit_code == 0 and "not reproduced" in warned.reason
    two = confirm(find_outliers([1.0, 9.0], rule, case="c"), [], rule)
    assert _by_name(_verdict(_healthy_rows(), spreads=[two]))[("spread", "c time")].status == "SKIP"


def test_verdict_json_round_trip_and_schema(tmp_path):
    rule = load_limits("gb300-nvl72").spread
    spread = confirm(find_outliers([10, 11, 10, 12, 10, 55, 11, 10], rule, case="c"), [], rule)
    verdict = _verdict([*_healthy_rows(), _balanced(16 << 30, busbw_GBps=410.0)], spreads=[spread])
    path = write_verdict_json(tmp_path, verdict)
    assert path.name == "verdict.json" and sorted(p.name for p in tmp_path.iterdir()) == ["verdict.json"]
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA == "commbench.verdict/1"
    assert set(data) == {
        "schema",
        "status",
        "exit_code",
        "reason",
        "counts",
        "run",
        "spec",
        "limits",
        "elements",
    }
    assert data["spec"] == {
        "name": "gb300-nvl72",
        "how_chosen": "detected: 4 x NVIDIA GB300",
        "nvlink_GBps_per_direction": 900.0,
    }
    assert (
        data["counts"]["FAIL"] == 1 and data["limits"]["values"]["balanced.huge.busbw_fail_fraction"] == 0.6
    )
    assert set(data["elements"][0]) == {
        "group",
        "name",
        "status",
        "message",
        "measured",
        "limit",
        "unit",
        "remedy",
    }
    assert read_verdict_json(path) == verdict
    assert verdict_from_dict(verdict_dict(verdict)) == verdict


def test_an_incomplete_cpu_verdict_round_trips_too(tmp_path):
    verdict = _verdict(_healthy_rows()[:1], spec=None, run=RunStatus("interrupted", "stopped by SIGINT", 2))
    assert read_verdict_json(write_verdict_json(tmp_path, verdict)) == verdict


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"schema": "commbench.verdict/2"}, "schema 'commbench.verdict/2' is not commbench.verdict/1"),
        ([1, 2], "schema 'list' is not"),
        ({"schema": SCHEMA, "status": "PASS"}, "damaged verdict"),
    ],
)
def test_another_schema_or_a_damaged_file_is_refused(data, match):
    with pytest.raises(UsageError, match=match):
        verdict_from_dict(data)


def test_a_verdict_file_that_is_not_json_is_refused(tmp_path):
    path = tmp_path / "verdict.json"
    path.write_text("{not json")
    with pytest.raises(UsageError, match="cannot be read as JSON"):
        read_verdict_json(path)
    bad = verdict_dict(_verdict(_healthy_rows()))
    bad["status"] = "GREAT"
    with pytest.raises(UsageError, match="unknown status"):
        verdict_from_dict(bad)

"""The CLI: input validation before any launch, one-line errors, help texts, and an end-to-end gloo run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

from commbench.cli import cli
from commbench.cli.inputs import balanced_sizes
from commbench.cli.launch import default_out_dir
from commbench.errors import UsageError
from commbench.run.config_meta import meta_values
from tests.launches import (
    BALANCED_SIZES,
    SMALL_MODEL,
    Launch,
    copy_of,
    launch,
    not_failed_by_data_or_completion,
)

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
REPORT_FILES = (
    "meta.json",
    "results.csv",
    "ranks.csv",
    "results.parquet",
    "results.json",
    "summary.md",
    "report.html",
)


@pytest.fixture(autouse=True)
def outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COMMBENCH_DEBUG", raising=False)


@pytest.fixture
def small_model(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL_MODEL)
    return path


def invoke(args: list[str]):
    return CliRunner().invoke(cli, args)


def assert_usage_error(result, *fragments: str) -> None:
    """Exit 2, exactly one stderr line starting 'commbench: error:', no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("commbench: error: ")
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]


# ---------------------------------------------------------------------------------------------------------
# Bad input: exit 2, one line, nothing written


def test_unknown_preset(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke(["run", "--model", "no-such-model", "--world-size", "2", "--out", str(out)])
    assert_usage_error(result, "no-such-model", "deepseek-v3")
    assert not out.exists()


def test_unknown_skew(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke(["run", "--skew", "lognormal:3", "--world-size", "2", "--out", str(out)])
    assert_usage_error(result, "lognormal:3", "zipf:S")
    assert not out.exists()


def test_topk_above_experts_in_custom_yaml(tmp_path: Path) -> None:
    model = tmp_path / "bad.yaml"
    model.write_text(SMALL_MODEL.replace("topk: 2", "topk: 9"))
    out = tmp_path / "out"
    result = invoke(["run", "--model", str(model), "--world-size", "2", "--out", str(out)])
    assert_usage_error(result, "topk 9")
    assert not out.exists()


def test_tokens_zero(tmp_path: Path, small_model: Path) -> None:
    out = tmp_path / "out"
    result = invoke(
        ["run", "--model", str(small_model), "--tokens", "0", "--world-size", "2", "--out", str(out)]
    )
    assert_usage_error(result, "--tokens")
    assert not out.exists()


def test_world_size_not_dividing_experts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = invoke(["run", "--model", "deepseek-v3", "--world-size", "3", "--out", str(out)])
    assert_usage_error(result, "world size 3", "256 experts")
    assert not out.exists()
    result = invoke(["pattern", "--model", "deepseek-v3", "--world-size", "3", "--tokens", "8"])
    assert_usage_error(result, "world size 3")


def test_missing_world_size_outside_torchrun(small_model: Path) -> None:
    assert_usage_error(invoke(["run", "--model", str(small_model)]), "--world-size")
    assert_usage_error(invoke(["suite"]), "--world-size")


@pytest.mark.parametrize("kind", ["missing", "garbage", "wrong-shape"])
def test_unreadable_or_malformed_trace(tmp_path: Path, small_model: Path, kind: str) -> None:
    trace = tmp_path / "trace.npz"
    if kind == "garbage":
        trace.write_bytes(b"this is not a zip archive")
    elif kind == "wrong-shape":
        np.savez(trace, topk_ids=np.zeros((16, 3), dtype=np.int64))  # the model has top-2
    out = tmp_path / "out"
    args = ["run", "--model", str(small_model), "--skew", f"trace:{trace}", "--world-size", "2"]
    result = invoke([*args, "--out", str(out)])
    assert_usage_error(result, "trace")
    assert not out.exists()


def test_existing_out_is_refused_and_untouched(tmp_path: Path, small_model: Path) -> None:
    out = tmp_path / "previous-run"
    out.mkdir()
    (out / "results.csv").write_text("precious\n")
    result = invoke(
        ["run", "--model", str(small_model), "--world-size", "2", "--backend", "gloo", "--out", str(out)]
    )
    assert_usage_error(result, "not empty")
    assert [p.name for p in out.iterdir()] == ["results.csv"]
    assert (out / "results.csv").read_text() == "precious\n"


def test_click_usage_errors_are_one_line() -> None:
    assert_usage_error(invoke(["run", "--no-such-option"]), "--no-such-option")
    assert_usage_error(invoke(["run", "--backend", "carrier-pigeon", "--world-size", "2"]), "--backend")
    assert_usage_error(invoke(["no-such-command"]), "no-such-command")
    assert_usage_error(invoke(["run", "--pattern", "balanced", "--min-bytes", "lots", "--world-size", "2"]))


@pytest.mark.parametrize(
    ("spec_yaml", "fragments"),
    [
        (None, ["unknown spec 'nvl1000'", "gb300-nvl72"]),
        ("name: x\ngpus_per_domain: 8\n", ["missing key(s)", "nvlink_GBps_per_direction"]),
        ("name: x\ngpus_per_domain: [8\n", ["bad YAML"]),
        (
            "name: x\ngpus_per_domain: 8\nnvlink_GBps_per_direction: -1\nnic_Gbps_per_direction: 400\n",
            ["nvlink_GBps_per_direction must be positive"],
        ),
    ],
)
def test_bad_spec_is_one_line_before_launch(
    tmp_path: Path, spec_yaml: str | None, fragments: list[str]
) -> None:
    spec = "nvl1000"
    if spec_yaml is not None:
        path = tmp_path / "spec.yaml"
        path.write_text(spec_yaml)
        spec = str(path)
    out = tmp_path / "out"
    for command in (["run", "--world-size", "2"], ["suite", "--world-size", "2", "--quick"]):
        result = invoke([*command, "--backend", "mock", "--spec", spec, "--out", str(out)])
        assert_usage_error(result, *fragments)
        assert not out.exists()


def test_layout_overrides_must_nest(tmp_path: Path) -> None:
    args = ["run", "--world-size", "4", "--ranks-per-domain", "3", "--ranks-per-host", "2"]
    assert_usage_error(invoke([*args, "--out", str(tmp_path / "o")]), "not a multiple of --ranks-per-host")


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the message on a machine without GPUs")
def test_nvshmem_on_cpu_gives_the_backends_own_message(tmp_path: Path) -> None:
    result = invoke(["run", "--world-size", "2", "--backend", "nvshmem", "--out", str(tmp_path / "o")])
    assert_usage_error(result, "--backend nvshmem", "shmem-emu")


def test_balanced_size_errors(tmp_path: Path) -> None:
    out = tmp_path / "out"
    base = ["run", "--pattern", "balanced", "--world-size", "4", "--out", str(out)]
    assert_usage_error(invoke([*base, "--min-bytes", "4K", "--max-bytes", "1K"]), "--min-bytes")
    assert_usage_error(invoke([*base, "--step-factor", "1"]), "--step-factor")
    assert_usage_error(invoke([*base, "--min-bytes", "1", "--max-bytes", "2"]), "world size")
    assert not out.exists()


@pytest.mark.parametrize(
    ("backend", "option", "fragment"),
    [
        ("shmem-emu", "num_blocks=abc", "no option(s) num_blocks"),
        ("shmem-emu", "chunk_rows=4,abc", "chunk_rows='abc' is not an integer"),  # the 2nd setting is bad
        ("shmem-emu", "signal=chunk,bogus", "signal='bogus' is unknown"),
        ("shmem-emu", "chunk_rows=", "empty value"),
        ("mock", "link_GBps=1,0", "link_GBps=0.0 must be > 0"),
        ("sim", "nvlink_efficiency=0.5,abc", "is not a number"),
        ("gloo", "num_blocks=8", "backend gloo takes no options"),
    ],
)
def test_bad_backend_option_values_fail_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, option: str, fragment: str
) -> None:
    import commbench.run.dist

    def no_launch(*args, **kwargs):
        raise AssertionError("launched despite a bad --backend-option")

    monkeypatch.setattr(commbench.run.dist, "launch", no_launch)
    out = tmp_path / "out"
    args = ["run", "--world-size", "2", "--backend", backend, "--backend-option", option, "--out", str(out)]
    assert_usage_error(invoke(args), fragment)
    assert not out.exists()


def test_report_of_missing_folder(tmp_path: Path) -> None:
    assert_usage_error(invoke(["report", str(tmp_path / "nothing")]), "results.csv")


def test_unexpected_errors_are_one_line_with_debug_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import commbench.report

    def boom(*_args: object) -> None:
        raise RuntimeError("first line\nsecond line of a rank's traceback")

    monkeypatch.setattr(commbench.report, "render_report", boom)
    result = invoke(["report", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "commbench: error: unexpected RuntimeError: first line (set COMMBENCH_DEBUG=1 for the traceback)"
    ]


# ---------------------------------------------------------------------------------------------------------
# Helpers


def test_balanced_sizes_follow_nccl_tests_semantics() -> None:
    assert balanced_sizes(1024, 16384, 2.0, 4) == [1024, 2048, 4096, 8192, 16384]
    assert balanced_sizes(1000, 1000, 2.0, 3) == [999]  # rounded down to a multiple of the world size
    assert balanced_sizes(1 << 10, 1 << 20, 4.0, 8) == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    with pytest.raises(UsageError):
        balanced_sizes(1024, 2048, 1.0, 2)


def test_default_out_dir_never_reuses_a_folder(tmp_path: Path) -> None:
    first = default_out_dir(tmp_path)
    assert first.parent == tmp_path and first.name.endswith("Z")
    first.mkdir()
    second = default_out_dir(tmp_path)
    assert second != first and not second.exists()


# ---------------------------------------------------------------------------------------------------------
# Help texts


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ([], ["run", "suite", "pattern", "report", "GB = 1e9 bytes"]),
        (
            ["run"],
            [
                "Tokens per rank",
                "in tokens",
                "bytes each rank sends",
                "Seconds",
                "[default: 4096",
                "ranks",
                "gb300-nvl72, hgx-b200, hgx-h100",
                "Default: chosen from the GPUs",
                "--ranks-per-domain",
                "--imbalance-cost",
            ],
        ),
        (
            ["suite"],
            [
                "1 KiB .. 16 MiB",
                "512 tokens per rank",
                "Seconds",
                "in ranks",
                "gb200-nvl72",
                "Default: on in suite",
            ],
        ),
        (["pattern"], ["Tokens per rank", "[default: uniform]", "JSON"]),
        (["report"], ["results.csv"]),
    ],
)
def test_help_texts_state_units_and_defaults(command: list[str], expected: list[str]) -> None:
    result = CliRunner().invoke(cli, [*command, "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for fragment in expected:
        assert fragment in text, fragment


# ---------------------------------------------------------------------------------------------------------
# pattern (no processes)


def test_pattern_statistics_and_json(small_model: Path) -> None:
    args = [
        "pattern",
        "--model",
        str(small_model),
        "--world-size",
        "2",
        "--tokens",
        "32",
        "--skew",
        "zipf:1.2",
    ]
    text = invoke(args)
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert any(line.split()[:3] == ["phase", "total(B)", "self(B)"] for line in lines)
    assert "imbalance statistics:" in text.output and "expert_maxvio:" in text.output
    assert "top destination ranks" in text.output

    result = invoke([*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert isinstance(data, dict)
    assert data["world"] == 2 and data["send_mode"] == "token" and data["skew"] == "zipf:1.2"
    dispatch = np.array(data["dispatch_bytes"])
    assert dispatch.shape == (2, 2)
    # Top-2 of 8 experts over 2 ranks in token mode: every token goes to 1 or 2 ranks, 128 B per row.
    assert 32 * 2 * 128 <= dispatch.sum() <= 2 * 32 * 2 * 128
    np.testing.assert_array_equal(np.array(data["combine_bytes"]), dispatch.T)
    # The text table shows the same totals: total, self, link bytes of dispatch.
    dispatch_line = next(line.split() for line in lines if line.startswith("dispatch "))
    expected = [dispatch.sum(), np.trace(dispatch), dispatch.sum() - np.trace(dispatch)]
    assert [int(v) for v in dispatch_line[1:4]] == expected


# ---------------------------------------------------------------------------------------------------------
# End to end: real processes on gloo (the session's shared MoE run, tests/launches.py; the sweep, once here)


def test_end_to_end_run_writes_every_file_and_prints_the_tables(moe_run: Launch) -> None:
    out, verdict = moe_run.out, moe_run.verdict()
    not_failed_by_data_or_completion(verdict)
    assert moe_run.returncode == verdict.exit_code
    for name in REPORT_FILES:
        assert (out / name).is_file(), name
    assert "# MoE phases:" in moe_run.stdout and "Avg bus bandwidth" not in moe_run.stdout
    assert moe_run.last_line().endswith(f"report: {out}")  # the verdict line, last
    assert "[1/2] small zipf:1.2 dispatch" in moe_run.stderr and "[2/2]" in moe_run.stderr


def test_end_to_end_rows_carry_the_layout_the_spec_and_the_skew_cost(moe_run: Launch) -> None:
    out = moe_run.out
    results = pd.read_csv(out / "results.csv")
    assert results["phase"].tolist() == ["dispatch", "combine"]
    assert (results["wrong"] == 0).all()
    assert (results["backend"] == "gloo").all()
    # Two domains of one rank each: every link byte is scale-out, compared with gb200's 400 Gb/s NIC.
    assert (results["nvlink_bytes"] == 0).all() and (results["scaleout_bytes"] == results["link_bytes"]).all()
    assert (results["scaleout_spec_GBps"] == 50.0).all() and (results["nvlink_spec_GBps"] == 900.0).all()
    assert (results["spec_name"] == "gb200-nvl72").all() and (results["layout_source"] == "override").all()
    assert (results["skew_cost"] > 0).all() and (results["uniform_ref_time_us_p50"] > 0).all()
    reference = results["uniform_ref_time_us_p50"]
    np.testing.assert_allclose(results["skew_cost"], results["time_us_p50"] / reference)
    ranks = pd.read_csv(out / "ranks.csv")
    assert len(ranks) == 4  # 2 ranks x 2 phases
    assert ranks["domain"].tolist() == [0, 1, 0, 1]
    assert (ranks["scaleout_sent_bytes"] == ranks["sent_bytes"] - ranks["self_bytes"]).all()
    assert json.loads((out / "results.json").read_text())["results"][0]["wrong"] == 0


def test_end_to_end_meta_and_summary(moe_run: Launch) -> None:
    out = moe_run.out
    meta = json.loads((out / "meta.json").read_text())
    assert meta_values(meta)["world_size"] == 2 and meta["env"]["versions"]["torch"]
    assert meta["spec"]["nic_GBps_per_direction"] == 50.0 and meta["system_spec"]["name"] == "gb200-nvl72"
    assert meta["topology"]["domain_of_rank"] == [0, 1] and meta["topology"]["method"] == "override"
    summary = (out / "summary.md").read_text()
    assert "## By link class" in summary and "## What skew costs" in summary
    assert "Topology: 2 ranks in emulated NVLink domains of 2 x 1 ranks" in summary  # gloo: CPU ranks


def test_report_renders_the_pages_again_from_results_csv(moe_run: Launch, tmp_path: Path) -> None:
    out = copy_of(moe_run, tmp_path / "run")
    for name in ("results.parquet", "results.json", "summary.md", "report.html"):
        (out / name).unlink()
    again = invoke(["report", str(out)])
    assert again.exit_code == 0, again.output
    assert "# MoE phases:" in again.stdout and "# Total #wrong         : 0" in again.stdout
    for name in REPORT_FILES:
        assert (out / name).is_file(), name
    assert "## What skew costs" in (out / "summary.md").read_text()  # re-rendered from results.csv


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """2 x 2 knob settings of the put/signal protocol (CPU emulator) in one launch, each dispatch + combine
    verified."""
    root = tmp_path_factory.mktemp("sweep")
    (root / "small.yaml").write_text(SMALL_MODEL)
    args = ["run", "--model", str(root / "small.yaml"), "--tokens", "32", "--backend", "shmem-emu"]
    args += ["--world-size", "2", "--backend-option", "chunk_rows=4,16", "--backend-option"]
    args += ["signal=chunk,segment", "--backend-option", "signal_op=add", "--warmup", "1", "--iters", "2"]
    return launch(args, root, "sweep", codes=(0, 1))


def test_backend_option_sweep_runs_every_setting_in_one_launch(sweep: Launch) -> None:
    not_failed_by_data_or_completion(sweep.verdict())
    assert "4 knob settings (chunk_rows=4,16 x signal=chunk,segment)" in sweep.stderr
    assert "[1/8] small uniform dispatch [chunk_rows=4 signal=chunk]:" in sweep.stderr
    assert "[8/8] small uniform combine [chunk_rows=16 signal=segment]:" in sweep.stderr
    results = pd.read_csv(sweep.out / "results.csv")
    assert results["phase"].tolist() == ["dispatch", "combine"] * 4
    assert (results["wrong"] == 0).all() and (results["signal_op"] == "add").all()
    assert results["chunk_rows"].tolist() == [4, 4, 4, 4, 16, 16, 16, 16]
    assert results["signal"].tolist() == ["chunk", "chunk", "segment", "segment"] * 2
    assert results["knobs"].nunique() == 4
    assert results["knobs"][0] == "chunk_rows=4 signal=chunk signal_op=add counts=host"
    assert set(pd.read_csv(sweep.out / "ranks.csv")["knobs"]) == set(results["knobs"])
    meta = json.loads((sweep.out / "meta.json").read_text())
    assert meta_values(meta)["backend_options"] == {
        "signal_op": "add",
        "chunk_rows": [4, 16],
        "signal": ["chunk", "segment"],
    }
    assert meta_values(meta)["knob_settings"] == 4


def test_backend_option_sweep_tables_show_the_knobs_that_vary(sweep: Launch) -> None:
    # Tables show the knobs that vary (not signal_op): stdout's last column, summary's after the backend.
    header = next(line for line in sweep.stdout.splitlines() if line.startswith("# pattern"))
    assert header.split()[-1] == "knobs"
    assert sweep.stdout.count("chunk_rows=16 signal=segment") == 2
    summary = (sweep.out / "summary.md").read_text()
    assert "| knobs " in summary and summary.count("| chunk_rows=4 signal=segment ") >= 2
    assert "signal_op=add" not in summary.split("## Results")[1].split("## Environment")[0]


# ---------------------------------------------------------------------------------------------------------
# The CLI -> harness -> report wiring in-process: ranks as threads, mock backend (no processes)


@pytest.fixture
def thread_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    import commbench.run.dist
    from commbench.run.threads import run_threads

    def launch(world_size, entry, args=(), backend="auto", timeout_s=300.0):
        return run_threads(world_size, entry, args, timeout_s)

    monkeypatch.setattr(commbench.run.dist, "launch", launch)


def test_balanced_with_corruption_exits_3_and_keeps_report(
    tmp_path: Path, thread_ranks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four thread ranks: every rank raises after the last gather; rank 0 keeps its rows (mock barrier race).
    # The mock moves no data and is not verified; here it is, as if it moved its (fresh) rows.
    from commbench.backends.mock import MockBackend

    monkeypatch.setattr(MockBackend, "moves_data", True)
    monkeypatch.setattr(MockBackend, "poison_receive_buffers", lambda self: None)
    out = tmp_path / "run"
    args = ["run", "--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "4K", "--backend", "mock"]
    args += ["--world-size", "4", "--warmup", "1", "--iters", "2", "--out", str(out), "--corrupt", "dispatch"]
    result = invoke(args)
    assert result.exit_code == 3, result.output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("commbench: error:")]
    assert len(error_lines) == 1 and "verification failed" in error_lines[0]
    assert "Traceback" not in result.output
    results = pd.read_csv(out / "results.csv")
    assert results["size_bytes"].tolist() == [1024, 2048, 4096]
    assert (results["wrong"] > 0).all()
    for name in REPORT_FILES:  # the partial report is still rendered
        assert (out / name).is_file(), name
    assert "Total #wrong" in result.stdout and "DATA MISMATCH" in result.stdout
    # The verdict of wrong data (as on gloo: tests/cli/test_acceptance.py): FAIL, exit 3, a data element.
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["status"] == "FAIL" and verdict["exit_code"] == 3
    assert any(e["group"] == "data" and e["status"] == "FAIL" for e in verdict["elements"])
    assert (out / "junit.xml").is_file() and result.stdout.strip().splitlines()[-1].startswith(
        "commbench verdict: FAIL"
    )


def test_suite_runs_every_case_in_one_launch(tmp_path: Path, thread_ranks: None) -> None:
    out = tmp_path / "suite"
    args = ["suite", "--world-size", "4", "--backend", "mock", "--quick", "--tokens", "16", "--iters", "2"]
    result = invoke([*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    results = pd.read_csv(out / "results.csv")
    balanced = results[results["phase"] == "alltoall"]
    assert balanced["size_bytes"].tolist() == [1024, 4096, 16384, 65536, 262144, 1048576]
    moe = results[results["phase"] != "alltoall"]
    skews = ["uniform", "uniform", "zipf:1.2", "zipf:1.2", "hot:8:0.3", "hot:8:0.3", "uniform", "uniform"]
    assert moe["skew"].tolist() == skews
    assert moe["phase"].tolist() == ["dispatch", "combine"] * 4
    # Then the model's decode case: 128 tokens per rank in selection mode, whatever --tokens says.
    assert moe["pattern"].tolist() == ["deepseek-v3"] * 6 + ["deepseek-v3 decode"] * 2
    assert moe["tokens_per_rank"].tolist() == [16] * 6 + [128] * 2
    assert moe["send_mode"].tolist() == ["token"] * 6 + ["selection"] * 2
    # The mock moves no data: #wrong n/a (an empty cell), check "n/a".
    checks = pd.read_csv(out / "results.csv", keep_default_na=False)["check"]
    assert results["wrong"].isna().all() and (checks == "n/a").all()
    total = len(results)
    assert f"[{total}/{total}] deepseek-v3 decode uniform combine" in result.stderr
    summary = (out / "summary.md").read_text()
    assert "### balanced" in summary and "### deepseek-v3" in summary
    assert "Emulated (a model, an emulator or CPU ranks)" in summary  # mock timings are labelled
    assert meta_values(json.loads((out / "meta.json").read_text()))["suite"] == "quick"
    # Imbalance cost is on by default in the suite: every MoE row has a positive skew cost.
    assert (moe["skew_cost"] > 0).all() and (moe["uniform_ref_time_us_p50"] > 0).all()
    assert balanced["skew_cost"].isna().all()
    assert "## What skew costs" in summary and "## By link class" in summary
    assert "found by host" in summary  # one process: one host, one NVLink domain


# ---------------------------------------------------------------------------------------------------------
# --timing (window as nccl-tests, or per iteration) and the meta args of the console header


@pytest.mark.parametrize("command", ["run", "suite"])
def test_check_every_with_window_timing_is_refused(tmp_path: Path, command: str) -> None:
    out = tmp_path / "x"
    args = [command, "--world-size", "2", "--backend", "mock", "--check", "every", "--timing", "window"]
    result = invoke([*args, "--out", str(out)])
    assert_usage_error(result, "--check every needs --timing iteration")
    assert not out.exists()
    result = invoke([*args[:5], "--timing", "fast", "--out", str(out)])
    assert_usage_error(result, "'fast' is not one of 'window', 'iteration'")
    assert not out.exists()


def test_timing_defaults_per_kind_and_meta_args(tmp_path: Path, thread_ranks: None, small_model: Path):
    def run(name: str, *extra: str) -> tuple[pd.DataFrame, dict]:
        out = tmp_path / name
        args = ["run", "--world-size", "2", "--backend", "mock", "--warmup", "0", "--iters", "3", *extra]
        result = invoke([*args, "--out", str(out)])
        assert result.exit_code == 0, result.output
        return pd.read_csv(out / "results.csv"), meta_values(json.loads((out / "meta.json").read_text()))

    balanced = ["--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "2K"]
    rows, args = run("balanced", *balanced)
    assert rows["timing"].tolist() == ["window", "window"]
    assert (rows["time_us_min"] == rows["time_us_p99"]).all()  # one sample: window / iters
    header = ("min_bytes", "max_bytes", "step_factor", "warmup", "iters", "check", "timing")
    assert {key: args[key] for key in header} == {
        "min_bytes": 1024,
        "max_bytes": 2048,
        "step_factor": 2.0,
        "warmup": 0,
        "iters": 3,
        "check": "checksum",
        "timing": None,  # each kind's default
    }
    rows, args = run("balanced-iteration", *balanced, "--timing", "iteration")
    assert rows["timing"].tolist() == ["iteration"] * 2 and args["timing"] == "iteration"
    rows, args = run("balanced-every", *balanced, "--check", "every")  # every needs per-iteration timing
    assert rows["timing"].tolist() == ["iteration"] * 2 and args["check"] == "every"
    rows, args = run("moe", "--model", str(small_model), "--tokens", "16")
    assert rows["timing"].tolist() == ["iteration"] * 2 and "sizes" not in args
    rows, args = run("moe-window", "--model", str(small_model), "--tokens", "16", "--timing", "window")
    assert rows["timing"].tolist() == ["window"] * 2 and args["timing"] == "window"


def test_gloo_window_timing_detects_a_corrupted_output(corrupt_run: Launch) -> None:
    # The shared BALANCED run: window timing (the default of a balanced sweep), 5 timed iterations.
    assert corrupt_run.returncode == 3, corrupt_run.stderr[-2000:]
    assert "#wrong=1 bytes in the last of 5 back-to-back timed iterations" in corrupt_run.stderr
    results = pd.read_csv(corrupt_run.out / "results.csv")
    assert results[["timing", "check", "wrong"]].values.tolist() == [["window", "window-last", 1]] * len(
        BALANCED_SIZES
    )


def test_pattern_routes_on_one_cpu_thread_unless_omp_num_threads_says(
    small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = torch.get_num_threads()
    args = ["pattern", "--model", str(small_model), "--world-size", "2", "--tokens", "8"]
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
        assert invoke(args).exit_code == 0 and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert invoke(args).exit_code == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)

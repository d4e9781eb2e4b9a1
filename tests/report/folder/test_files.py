"""report.files and report.html: the report folder written during a run and re-rendered from disk."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest

from commbench.errors import UsageError
from commbench.inputs.specs import load_spec
from commbench.report import (
    CONVENTIONS,
    RANK_DERIVED_COLUMNS,
    ReportWriter,
    render_report,
    results_frame,
    results_json,
)
from tests.report.rows import all_rank_rows, balanced_row, skewed_rows
from tests.report.test_frame import link_class_row

GB300 = load_spec("gb300-nvl72")
HGX = load_spec("hgx-h100")
PAGES = ("results.parquet", "results.json", "summary.md", "report.html")


def test_writer_refuses_non_empty_dir_and_touches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.csv").write_text("precious\n")
    with pytest.raises(UsageError, match="not empty"):
        ReportWriter(out, {"args": {}}, GB300)
    assert sorted(p.name for p in out.iterdir()) == ["results.csv"]
    assert (out / "results.csv").read_text() == "precious\n"
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match="not a folder"):
        ReportWriter(afile, {}, GB300)


def test_meta_json_keeps_the_spec_and_the_system_spec(tmp_path: Path) -> None:
    ReportWriter(tmp_path / "run", {"args": {"world_size": 4}}, HGX)
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["args"] == {"world_size": 4}
    assert meta["spec"] == {
        "name": "hgx-h100",
        "per_gpu_GBps_per_direction": 450.0,
        "gpus_per_domain": 8,
        "aggregate_GBps_bidirectional": 7200.0,
        "nic_GBps_per_direction": 50.0,
    }
    assert meta["system_spec"] == {**asdict(HGX), "description_line": HGX.describe()}


def test_writer_appends_incrementally_and_finalizes(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "run"
    writer = ReportWriter(
        out, {"args": {"world_size": 4}, "env": {"hostname": "h", "versions": {"nccl": None}}}
    )
    assert json.loads((out / "meta.json").read_text())["spec"]["name"] == "gb300-nvl72"  # the default spec

    first = [balanced_row(4, 4096, 10.0)]
    writer.add(first, all_rank_rows(first))
    saved = pd.read_csv(out / "results.csv")
    assert len(saved) == 1 and saved.iloc[0]["busbw_GBps"] == pytest.approx(4096 * 3 / 4 / 10e-6 / 1e9)
    ranks = pd.read_csv(out / "ranks.csv")
    assert len(ranks) == 4 and set(RANK_DERIVED_COLUMNS) <= set(ranks.columns)
    assert ranks.iloc[0]["link_send_GBps"] == pytest.approx(3 * 1024 / 10e-6 / 1e9)

    # A later phase with an extra (knob) column: the file is rewritten with the wider header, no row lost.
    second = skewed_rows(num_blocks=24)
    writer.add(second, all_rank_rows(second))
    saved = pd.read_csv(out / "results.csv")
    assert len(saved) == 3
    assert list(saved.columns).count("pattern") == 1
    assert math.isnan(saved.iloc[0]["num_blocks"]) and saved.iloc[2]["num_blocks"] == 24
    assert len(pd.read_csv(out / "ranks.csv")) == 12
    writer.add([], [])

    frame = writer.finalize()
    assert len(frame) == 3
    for name in PAGES:
        assert (out / name).stat().st_size > 0
    assert not list(out.glob("*.tmp"))
    parquet = pd.read_parquet(out / "results.parquet")
    assert parquet["busbw_GBps"].tolist() == pytest.approx(frame["busbw_GBps"].tolist())

    data = json.loads((out / "results.json").read_text())
    assert data["conventions"] == CONVENTIONS
    assert data["args"] == [] and data["env"] == []  # nccl-tests' command line and variables: none recorded
    assert data["commbench_options"] == {"world_size": 4}
    assert data["commbench_env"]["hostname"] == "h"
    assert len(data["results"]) == 3
    first_result = data["results"][0]
    assert first_result["size"] == 4096 and first_result["time"] == 10.0
    assert first_result["bus_bw"] == pytest.approx(frame.iloc[0]["busbw_mean_GBps"])
    assert first_result["alg_bw"] == pytest.approx(frame.iloc[0]["algbw_mean_GBps"])
    assert first_result["wrong"] == 0
    # Over the balanced row alone (the MoE phases are not nccl-tests' sweep).
    assert data["average_bus_bandwidth"]["bandwidth"] == pytest.approx(frame.iloc[0]["busbw_mean_GBps"])

    summary = (out / "summary.md").read_text()
    assert CONVENTIONS in summary
    assert "Spec: gb300-nvl72: NVLink 900 GB/s per GPU per direction (1800 GB/s bidirectional)" in summary
    assert "### balanced" in summary and "### toy" in summary
    assert "| backend |" in summary
    html_text = (out / "report.html").read_text()
    assert "data:image/png;base64," in html_text
    assert html_text.count("<img") >= 3  # balanced sweep, per-GPU vs spec, per-rank bytes
    assert "Conventions" in html_text and '<td class="num">4096 (4 KiB)</td>' in html_text


def test_results_json_uses_nccl_tests_mean_time_and_footer() -> None:
    rows = [
        balanced_row(4, 4096, 10.0, time_us_mean=16.0, check="checksum"),
        *skewed_rows(time_us_mean=150.0),
    ]
    meta = {"args": {"min_bytes": 4096, "max_bytes": 4096, "iters": 20, "warmup": 5}}
    data = results_json(results_frame(rows, GB300), meta, GB300)
    balanced, dispatch = data["results"][0], data["results"][1]
    assert balanced["time"] == balanced["out_of_place"]["time"] == 16.0  # the mean, not p50 (10 us)
    assert balanced["bus_bw"] == pytest.approx(4096 * 3 / 4 / 16e-6 / 1e9)
    assert balanced["time_us_p50"] == 10.0 and balanced["busbw_GBps"] == pytest.approx(
        4096 * 3 / 4 / 10e-6 / 1e9
    )
    # nccl-tests writes root as its printf "%6i" text.
    assert (balanced["count"], balanced["type"], balanced["redop"], balanced["root"]) == (
        1024,
        "uint8",
        "none",
        "    -1",
    )
    assert dispatch["time"] == 150.0 and "count" not in dispatch
    assert dispatch["experiment_name"] == "toy dispatch" and balanced["experiment_name"] == ""
    assert data["average_bus_bandwidth"] == {
        "bandwidth": pytest.approx(balanced["bus_bw"]),
        "okay": "unchecked",
    }
    assert data["out_of_bounds"] == {"count": 0, "okay": "true"}
    config = data["config"]
    assert (config["minimum_bytes"], config["iterations"], config["warmup_iters"]) == (4096, 20, 5)
    assert config["timing"] == ["iteration"] and config["check"] == ["checksum"] and config["validation"] == 1
    moe_only = results_json(results_frame(skewed_rows(), GB300), {}, GB300)
    # nccl-tests writes a NaN figure as the text "nan".
    assert moe_only["config"] is None and moe_only["average_bus_bandwidth"]["bandwidth"] == "nan"
    assert moe_only["out_of_bounds"] == {"count": None, "okay": None}


def test_conventions_say_which_time_every_figure_uses() -> None:
    for words in (
        "timing column",
        "window (as nccl-tests)",
        "iteration = a",
        "the mean (time_us_mean",
        "from p50",
        "window-last",
        "balanced all-to-all rows only",
    ):
        assert words in CONVENTIONS, words


def test_pages_say_how_rows_were_timed(tmp_path: Path) -> None:
    rows = [balanced_row(4, 4096, 10.0, timing="window"), *skewed_rows(timing="iteration")]
    writer = ReportWriter(tmp_path / "run", {"args": {}}, GB300)
    writer.add(rows, all_rank_rows(rows))
    writer.finalize()
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "Timing: window (as nccl-tests" in summary and "; iteration (a barrier" in summary
    # The rows mix modes: every table says which (in its title, each table being uniform).
    assert "### balanced (timing: window)" in summary and "(timing: iteration)" in summary
    assert "Avg bus bandwidth (balanced all-to-all only, busbw from the mean time):" in summary
    assert "Balanced all-to-all tables: time = the mean" in summary
    html_text = (tmp_path / "run" / "report.html").read_text()
    assert "Timing: window (as nccl-tests" in html_text and "balanced (timing: window)</h3>" in html_text


def test_results_json_reads_like_nccl_tests_json() -> None:
    # nccl-tests -J nests each row's figures under out_of_place {time, alg_bw, bus_bw, nwrong}.
    rows = [balanced_row(4, 4096, 10.0), {**balanced_row(4, 8192, 16.0), "wrong": 3}]
    data = results_json(results_frame(rows, GB300), {"args": {}}, GB300)
    assert data["spec"]["per_gpu_GBps_per_direction"] == 900.0
    for result, wrong in zip(data["results"], (0, 3), strict=True):
        nested = result["out_of_place"]
        assert set(nested) == {"time", "alg_bw", "bus_bw", "nwrong"}
        assert nested["nwrong"] == result["wrong"] == wrong
        assert nested["time"] == result["time"] and nested["bus_bw"] == result["bus_bw"]
        assert nested["alg_bw"] == pytest.approx(result["size"] / (result["time"] * 1e3))
        assert result["in_place"] is None
        assert result["knobs"] == "" and result["skew"] is None  # NaN and dicts never reach the JSON


def _run_folder(tmp_path: Path, rows: list[dict], spec=HGX) -> tuple[Path, pd.DataFrame]:
    out = tmp_path / "run"
    writer = ReportWriter(out, {"args": {"tokens": 64}}, spec)
    writer.add(rows, all_rank_rows(rows))
    return out, writer.finalize()


def _saved_pages(out: Path) -> dict[str, object]:
    return {
        "parquet": pd.read_parquet(out / "results.parquet"),
        **{name: (out / name).read_text() for name in PAGES[1:]},
    }


def test_render_report_rewrites_the_same_pages(tmp_path: Path) -> None:
    sweep = [{"chunk_rows": 4, "signal": "chunk"}, {"chunk_rows": 8, "signal": "chunk"}]
    rows = [balanced_row(4, 4096, 10.0, knobs=knobs) for knobs in sweep] + skewed_rows(knobs=sweep[0])
    out, original = _run_folder(tmp_path, rows)
    before = _saved_pages(out)
    data_files = {name: (out / name).read_bytes() for name in ("results.csv", "ranks.csv", "meta.json")}
    for name in PAGES:
        (out / name).unlink()

    again = render_report(out)
    after = _saved_pages(out)
    pd.testing.assert_frame_equal(after.pop("parquet"), before.pop("parquet"))
    assert after == before  # results.json, summary.md, report.html: the run's own, byte for byte
    assert {name: (out / name).read_bytes() for name in data_files} == data_files
    assert (again["spec_name"] == "hgx-h100").all()  # the spec comes back from meta.json
    assert again["knobs"].tolist() == [
        "chunk_rows=4 signal=chunk",
        "chunk_rows=8 signal=chunk",
        *["chunk_rows=4 signal=chunk"] * 2,
    ]
    assert "| chunk_rows=8 |" in before["summary.md"]  # a sweep's setting, derived from the dicts in memory
    assert json.loads(before["results.json"])["results"][0]["knobs"] == "chunk_rows=4 signal=chunk"
    assert original["busbw_GBps"].tolist() == pytest.approx(again["busbw_GBps"].tolist(), rel=1e-15)


def test_render_report_of_a_folder_with_only_the_spec_figures(tmp_path: Path) -> None:
    out, original = _run_folder(tmp_path, [balanced_row(4, 4096, 10.0)])
    meta = json.loads((out / "meta.json").read_text())
    del meta["system_spec"]  # as folders of older versions
    (out / "meta.json").write_text(json.dumps(meta))
    again = render_report(out)
    for column in ("spec_name", "spec_GBps", "agg_spec_GBps", "nvlink_spec_GBps", "scaleout_spec_GBps"):
        assert again.iloc[0][column] == original.iloc[0][column], column
    del meta["spec"]
    (out / "meta.json").write_text(json.dumps(meta))
    assert render_report(out).iloc[0]["spec_name"] == "gb300-nvl72"


def test_render_report_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="results.csv"):
        render_report(tmp_path)
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UsageError, match="lack column"):
        render_report(tmp_path)
    out, _ = _run_folder(tmp_path, [balanced_row(4, 4096, 10.0)])
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "system_spec": {**meta["system_spec"], "gpus_per_domain": -8}}))
    with pytest.raises(UsageError, match="meta.json: gpus_per_domain must be positive"):
        render_report(out)
    meta_path.write_text("{not json")
    with pytest.raises(UsageError, match="cannot read"):
        render_report(out)


def test_summary_has_link_class_and_skew_cost_tables(tmp_path: Path) -> None:
    out = tmp_path / "run"
    meta = {"topology": {"description": "4 ranks in NVLink domains of 2 x 2 ranks; found by override"}}
    writer = ReportWriter(out, meta, GB300)
    row = {
        **link_class_row(1000.0),
        "uniform_ref_size_bytes": 28_000_000,
        "uniform_ref_total_bytes": 112_000_000,
        "uniform_ref_time_us_p50": 500.0,
    }
    writer.add([row])
    writer.finalize()
    summary = (out / "summary.md").read_text()
    assert "Topology: 4 ranks in NVLink domains of 2 x 2 ranks; found by override." in summary
    assert "## By link class" in summary and "NIC 100 GB/s" in summary
    header = next(line for line in summary.splitlines() if "NVLink/GPU(GB/s)" in line)
    for name in ("algbw self incl.(GB/s)", "link bw self excl.(GB/s)", "%NIC spec", "scale-out neck"):
        assert name in header
    assert " 3 send |" in summary  # the scale-out bottleneck: rank 3 sending
    assert "## What skew costs" in summary and "|         2.00 |" in summary
    assert "never compared with a bidirectional spec" in " ".join(CONVENTIONS.split())
    html_text = (out / "report.html").read_text()
    assert "By link class" in html_text and "What skew costs" in html_text

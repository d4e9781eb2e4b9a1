"""``commbench report DIR`` refuses a folder whose files are cut or malformed (one line naming the file,
exit 2, nothing in the folder changed); a good folder re-renders without touching its data files."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from commbench.cli import cli
from commbench.inputs.specs import load_spec
from commbench.report import ReportWriter
from tests.report.folder_checks import folder_digest
from tests.report.rows import all_rank_rows, balanced_row, skewed_rows

HGX = load_spec("hgx-h100")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    writer = ReportWriter(out, {"args": {"tokens": 64}, "env": {"hostname": "h", "devices": []}}, HGX)
    rows = [balanced_row(4, 4096, 10.0, check="n/a"), *skewed_rows()]
    writer.add(rows, all_rank_rows(rows))  # meta.json and the CSVs: what `commbench report` reads
    return out


def _report(out: Path):
    return CliRunner().invoke(cli, ["report", str(out)])


def _assert_refused(out: Path, *fragments: str) -> None:
    before = folder_digest(out)
    result = _report(out)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commbench: error: "), result.stderr
    assert "Traceback" not in result.output and not lines[0].startswith("commbench: error: unexpected ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert folder_digest(out) == before  # nothing in the folder changed


def _set_meta(out: Path, change: Callable[[dict], object]) -> None:
    meta = json.loads((out / "meta.json").read_text())
    replaced = change(meta)
    (out / "meta.json").write_text(json.dumps(meta if replaced is None else replaced))


def _set_cell(out: Path, name: str, column: str, value: str, row: int = 0) -> None:
    records = list(csv.reader(io.StringIO((out / name).read_text(), newline="")))
    records[row + 1][records[0].index(column)] = value
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(records)
    (out / name).write_text(buffer.getvalue())


META_CASES = {
    "a list": (lambda out: (out / "meta.json").write_text("[1, 2]"), ["meta.json", "not a JSON object"]),
    "not UTF-8": (lambda out: (out / "meta.json").write_bytes(b'{"args": "\xff"}'), ["meta.json", "UTF-8"]),
    "not JSON": (lambda out: (out / "meta.json").write_text('{"args": {'), ["meta.json", "not valid JSON"]),
    "cut": (
        lambda out: (out / "meta.json").write_bytes((out / "meta.json").read_bytes()[:-40]),
        ["meta.json", "not valid JSON"],
    ),
    "nested too deep": (lambda out: (out / "meta.json").write_text("[" * 100_000), ["meta.json"]),
    "a 5000-digit number": (lambda out: (out / "meta.json").write_text("1" * 5000), ["meta.json"]),
    "env a number": (lambda out: _set_meta(out, lambda m: m.update(env=5)), ["env must be a JSON object"]),
    "args a list": (lambda out: _set_meta(out, lambda m: m.update(args=[1])), ["args must be a JSON object"]),
    "versions text": (
        lambda out: _set_meta(out, lambda m: m["env"].update(versions="x")),
        ["env.versions must be"],
    ),
    "devices of numbers": (
        lambda out: _set_meta(out, lambda m: m["env"].update(devices=[1])),
        ["env.devices must be a list of JSON objects"],
    ),
    "argv of numbers": (lambda out: _set_meta(out, lambda m: m.update(argv=[1])), ["argv must be a list"]),
    "system_spec a list": (
        lambda out: _set_meta(out, lambda m: m.update(system_spec=[1])),
        ["system_spec must be a JSON object"],
    ),
    "spec a number": (lambda out: _set_meta(out, lambda m: m.update(spec=5)), ["spec must be"]),
    "topology description a number": (
        lambda out: _set_meta(out, lambda m: m.update(topology={"description": 5})),
        ["topology.description must be text"],
    ),
    "unknown status": (
        lambda out: _set_meta(out, lambda m: m.update(status="done")),
        ["status must be one of complete, incomplete"],
    ),
    "a folder": (lambda out: ((out / "meta.json").unlink(), (out / "meta.json").mkdir()), ["is a folder"]),
}


@pytest.mark.parametrize("case", META_CASES, ids=list(META_CASES))
def test_bad_meta_json_is_refused(folder: Path, case: str) -> None:
    damage, fragments = META_CASES[case]
    damage(folder)
    _assert_refused(folder, *fragments)


CSV_CASES = {
    "results cut mid-row": (
        lambda out: (out / "results.csv").write_bytes((out / "results.csv").read_bytes()[:-30]),
        ["results.csv", "last row is cut"],
    ),
    "ranks cut mid-row": (
        lambda out: (out / "ranks.csv").write_bytes((out / "ranks.csv").read_bytes()[:-1]),
        ["ranks.csv", "last row is cut"],
    ),
    "a row with fields missing": (
        lambda out: (out / "results.csv").write_text(
            "\n".join((out / "results.csv").read_text().splitlines()[:2] + ["balanced,alltoall,gloo"]) + "\n"
        ),
        ["results.csv", "line 3 has 3 fields"],
    ),
    "an unclosed quote": (
        lambda out: (out / "results.csv").write_text((out / "results.csv").read_text() + '"balanced\n'),
        ["results.csv"],
    ),
    "empty": (lambda out: (out / "results.csv").write_text(""), ["results.csv", "is empty"]),
    "not UTF-8": (lambda out: (out / "ranks.csv").write_bytes(b"\xff\xfe"), ["ranks.csv", "UTF-8"]),
    "a required column missing": (
        lambda out: (
            pd.read_csv(out / "results.csv")
            .drop(columns=["time_us_p50"])
            .to_csv(out / "results.csv", index=False)
        ),
        ["results.csv", "lack column(s) time_us_p50"],
    ),
    "ranks without rank": (
        lambda out: (
            pd.read_csv(out / "ranks.csv").drop(columns=["rank"]).to_csv(out / "ranks.csv", index=False)
        ),
        ["ranks.csv", "lack column(s) rank"],
    ),
    "text time": (
        lambda out: _set_cell(out, "results.csv", "time_us_p50", "fast"),
        ["results.csv", "line 2, column time_us_p50: 'fast' is not a number"],
    ),
    "text size": (
        lambda out: _set_cell(out, "results.csv", "size_bytes", "big", row=1),
        ["results.csv", "line 3, column size_bytes: 'big' is not a whole number"],
    ),
    "text world size": (
        lambda out: _set_cell(out, "results.csv", "world_size", "abc"),
        ["column world_size"],
    ),
    "text wrong": (lambda out: _set_cell(out, "results.csv", "wrong", "x"), ["column wrong"]),
    "fractional bytes": (lambda out: _set_cell(out, "results.csv", "total_bytes", "2.5"), ["total_bytes"]),
    "infinite time": (lambda out: _set_cell(out, "results.csv", "time_us_p50", "inf"), ["time_us_p50"]),
    "huge world size": (lambda out: _set_cell(out, "results.csv", "world_size", "1e300"), ["world_size"]),
    "text rank": (lambda out: _set_cell(out, "ranks.csv", "rank", "x"), ["ranks.csv", "column rank"]),
    "text sent bytes": (lambda out: _set_cell(out, "ranks.csv", "sent_bytes", "x"), ["column sent_bytes"]),
    "no pattern": (lambda out: _set_cell(out, "results.csv", "pattern", ""), ["line 2 has no pattern"]),
    "emulated not a flag": (lambda out: _set_cell(out, "results.csv", "emulated", "banana"), ["emulated"]),
    "a repeated column": (
        lambda out: (out / "results.csv").write_text(
            (out / "results.csv").read_text().replace("time_us_p99", "time_us_p50", 1)
        ),
        ["results.csv", "repeats a column name"],
    ),
    "no results.csv": (lambda out: (out / "results.csv").unlink(), ["results.csv", "not found"]),
}


@pytest.mark.parametrize("case", CSV_CASES, ids=list(CSV_CASES))
def test_cut_or_malformed_csv_is_refused(folder: Path, case: str) -> None:
    damage, fragments = CSV_CASES[case]
    damage(folder)
    _assert_refused(folder, *fragments)


def test_every_file_is_read_bounded(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import commbench.report.folder.reading as reading

    # The real bounds (32 MiB, 256 MiB) scaled down: the refusal reads one byte past the bound, no more.
    monkeypatch.setattr(reading, "MAX_META_BYTES", (folder / "meta.json").stat().st_size - 1)
    _assert_refused(folder, "meta.json", "larger than")
    monkeypatch.setattr(reading, "MAX_META_BYTES", 1 << 20)
    monkeypatch.setattr(reading, "MAX_CSV_BYTES", (folder / "results.csv").stat().st_size - 1)
    _assert_refused(folder, "results.csv", "larger than")


def test_rerendering_a_good_folder_keeps_its_data_files(folder: Path) -> None:
    data = {name: (folder / name).read_bytes() for name in ("meta.json", "results.csv", "ranks.csv")}
    assert _report(folder).exit_code == 0
    pages = {name: (folder / name).read_text() for name in ("results.json", "summary.md", "report.html")}
    for _ in range(2):
        result = _report(folder)
        assert result.exit_code == 0, result.output
    assert {name: (folder / name).read_bytes() for name in data} == data
    # Each re-render writes the same pages.
    assert {name: (folder / name).read_text() for name in pages} == pages
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_text_cells_read_back_as_written(folder: Path) -> None:
    from commbench.report import read_report

    _set_cell(folder, "results.csv", "pattern", "1e3")
    _, results, ranks = read_report(folder)
    assert results["pattern"].tolist()[0] == "1e3" and results["check"].tolist()[0] == "n/a"
    assert results["skew"].isna().tolist() == [True, False, False]  # the balanced row has no skew
    assert results["knobs"].tolist() == ["", "", ""] and results["wrong"].tolist() == [0, 0, 0]
    assert len(ranks) == 12


def test_a_folder_with_the_earlier_column_names_reads_and_renders(tmp_path: Path) -> None:
    """Folders written before the renames (the repeat index was "window", the imbalance-cost reference
    "balanced_*") read back under the new names, so their repeats, skew cost and verdict come out alike."""
    from commbench.report import read_report

    out = tmp_path / "old"
    reference = {"uniform_ref_total_bytes": 1_000_000, "uniform_ref_time_us_p50": 50.0}
    rows = [balanced_row(4, 4096, 10.0 + r, repeat=r) for r in (0, 1)]
    rows += [{**row, **reference} for row in skewed_rows(repeat=1)]
    rank_rows = [{**rank_row, "repeat": 0} for rank_row in all_rank_rows(rows)]
    ReportWriter(out, {"args": {}, "env": {}}, HGX).add(rows, rank_rows)
    renames = {"repeat": "window", "uniform_ref_total_bytes": "balanced_total_bytes"}
    renames["uniform_ref_time_us_p50"] = "balanced_time_us_p50"
    for name in ("results.csv", "ranks.csv"):
        text = (out / name).read_text().split("\n", 1)
        header = ",".join(renames.get(column, column) for column in text[0].split(","))
        assert header != text[0]
        (out / name).write_text(f"{header}\n{text[1]}")
    _, results, ranks = read_report(out)
    assert results["repeat"].tolist() == [0, 1, 1, 1] and "window" not in results.columns
    assert results["uniform_ref_time_us_p50"].tolist()[2:] == [50.0, 50.0]
    assert not {"balanced_time_us_p50", "balanced_total_bytes"} & set(results.columns)
    assert "repeat" in ranks.columns and "window" not in ranks.columns
    result = _report(out)
    assert result.exit_code == 0, result.output
    summary = (out / "summary.md").read_text()
    assert "Range over repeats" in summary and "uniform ref p50(us)" in summary


def test_a_model_digest_of_digits_reads_back_as_text(tmp_path: Path) -> None:
    from commbench.report import read_report
    from commbench.run.case import Case

    out = tmp_path / "run"
    rows = [
        {**row, "model_digest": digest}
        for row, digest in zip(skewed_rows(), ("123456789012", "12e345678901"), strict=True)
    ]
    ReportWriter(out, {"args": {}, "env": {}}, HGX).add(rows)
    _, results, _ = read_report(out)
    assert results["model_digest"].tolist() == ["123456789012", "12e345678901"]
    assert [Case.from_row(row) for row in results.to_dict("records")] == [Case.from_row(row) for row in rows]

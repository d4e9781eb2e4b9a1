"""Checks that a report folder holds only whole, readable files (for fault and signal tests)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path
from xml.etree import ElementTree

import pandas as pd

from commbench.report import read_meta, read_rows
from commbench.report.folder.claim import MARKER
from commbench.report.folder.reading import RANK_COLUMNS, RESULT_COLUMNS, read_table
from commbench.report.judge.verdict import read_verdict_json

KNOWN_FILES = {
    MARKER,
    "meta.json",
    "verdict.json",
    "junit.xml",
    "results.csv",
    "ranks.csv",
    "pairs.csv",
    "health.csv",
    "results.parquet",
    "results.json",
    "summary.md",
    "report.html",
}


def assert_whole_csv(path: Path) -> list[list[str]]:
    """Every row of the CSV whole (ends with a line break, the header's number of fields); its records."""
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n"), f"{path.name}: last row cut"
    records = list(csv.reader(io.StringIO(text, newline=""), strict=True))
    assert records and all(len(record) == len(records[0]) for record in records), f"{path.name}: cut row"
    return records


def assert_folder_readable(folder: Path) -> set[str]:
    """Every file in ``folder`` is one commbench writes and parses whole; returns the names present. A folder
    that does not exist passes (nothing was left)."""
    if not folder.exists():
        return set()
    names = {path.name for path in folder.iterdir()}
    assert names <= KNOWN_FILES, f"unexpected files (temporary leftovers?): {sorted(names - KNOWN_FILES)}"
    if MARKER in names:
        assert (folder / MARKER).read_text().strip(), "empty claim marker"
    if "meta.json" in names:
        assert isinstance(json.loads((folder / "meta.json").read_text()), dict)
        read_meta(folder / "meta.json")
    for name, required in (("results.csv", RESULT_COLUMNS), ("ranks.csv", RANK_COLUMNS)):
        if name in names:
            assert_whole_csv(folder / name)
            read_rows(folder / name, required)
    for name, columns in (("pairs.csv", ("test", "src", "dst", "time_us")), ("health.csv", ("rank", "host"))):
        if name in names:
            assert_whole_csv(folder / name)
            read_table(folder / name, columns)
    if "results.json" in names:
        json.loads((folder / "results.json").read_text())
    if "verdict.json" in names:
        read_verdict_json(folder / "verdict.json")
    if "junit.xml" in names:
        assert ElementTree.parse(folder / "junit.xml").getroot().tag == "testsuites"
    if "results.parquet" in names:
        pd.read_parquet(folder / "results.parquet")
    if "summary.md" in names:
        assert (folder / "summary.md").read_text(encoding="utf-8").startswith("# commbench report")
    if "report.html" in names:
        assert (folder / "report.html").read_text(encoding="utf-8").endswith("</html>\n")
    return names


def folder_digest(folder: Path) -> dict[str, str]:
    """name -> sha256 of every file in ``folder`` ("folder" for a folder), to show that nothing changed."""
    return {
        path.name: "folder" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
    }

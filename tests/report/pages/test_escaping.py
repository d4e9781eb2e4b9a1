"""No text a user controls reaches report.html as markup, and none breaks a summary.md table row.

Every field a user can set on the way into a folder (a model name, a skew text, backend knob values, the
command line and meta.json, every CSV cell read back, verdict messages) is set to text holding markup, quotes,
an ampersand, a closing heading, a table separator and a line break; the folder is rendered at the end of
the run and again from its files (``commbench report DIR``), and both pages are checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd

from commbench.inputs.specs import load_spec
from commbench.report import ReportWriter, render_folder
from commbench.report.judge.pairs import PAIRS_FILE
from commbench.report.judge.verdict import Element, Verdict
from commbench.report.profiler.profile import ARRIVALS_FILE, PEERS_FILE, PROFILE_FILE
from tests.report.rows import all_rank_rows, balanced_row, skewed_rows

EVIL = '<script>alert(1)</script> "q" & </h4> a|b'
EVIL_LINES = EVIL + "\nline two"  # a line break where a text column may hold one
HGX = load_spec("hgx-h100")
HEALTH_FILE = "health.csv"


def _evil(label: str) -> str:
    return f"{label} {EVIL}"


def _meta(model_file: Path) -> dict[str, Any]:
    return {
        "argv": ["commbench", "run", "--skew", EVIL],
        "command": _evil("command"),
        "args": {"model": str(model_file), "skew": EVIL_LINES, "backend_option": [f"opt={EVIL}"]},
        "env": {
            "command": _evil("env command"),
            "hostname": _evil("host"),
            "platform": _evil("platform"),
            "time_utc": _evil("time"),
            "versions": {_evil("lib"): _evil("version")},
            "devices": [{"index": 0, "name": _evil("device")}],
            "nvml": {"driver_version": _evil("driver")},
            "env_vars": {"NCCL_ALGO": EVIL_LINES},
        },
        "topology": {"description": _evil("topology"), "method": _evil("method")},
    }


def _rows(name: str) -> list[dict[str, Any]]:
    """A balanced sweep and an MoE case of model ``name``, two knob settings (so the knobs column shows),
    every text column holding markup."""
    text = {
        "skew": EVIL_LINES,
        "send_mode": _evil("mode"),
        "backend": _evil("backend"),
        "backend_name": _evil("backend name"),
        "layout_source": _evil("layout"),
        "dispatch_dtype": _evil("dtype"),
        "check": _evil("check"),
        "timing": _evil("timing"),
    }
    rows = [balanced_row(4, 4096, 10.0, knobs={"chunk": EVIL}, backend=_evil("backend"))]
    for setting in (EVIL, "plain"):
        for window in (0, 1):  # two windows: the spread section
            knobs = {"chunk": setting, "mode": EVIL_LINES}
            for row in skewed_rows(100.0 + window, knobs=knobs, window=window, balanced_time_us_p50=50.0):
                rows.append({**row, **text, "pattern": name})
    return rows


def _profile_rows(name: str) -> dict[str, list[dict[str, Any]]]:
    case = {"pattern": name, "skew": EVIL_LINES, "phase": "dispatch", "size_bytes": 4096, "knobs": EVIL}
    steps = [
        {**case, "rank": rank, "iteration": 0, "step": step, "us": us}
        for rank in range(2)
        for step, us in (("phase", 10.0), (_evil("step"), 4.0), ("other", 6.0))
    ]
    arrivals = [
        {**case, "rank": rank, "iteration": 0, "entered_us": 1.0 + rank, "left_us": 9.0, "waited_us": 0.5,
         "uncertainty_us": 0.1}
        for rank in range(2)
    ]  # fmt: skip
    peers = [
        {**case, "src": src, "dst": dst, "iteration": 0, "seen_us": 2.0 + src}
        for src in range(2)
        for dst in range(2)
    ]
    return {PROFILE_FILE: steps, ARRIVALS_FILE: arrivals, PEERS_FILE: peers}


def _pairs_rows() -> list[dict[str, Any]]:
    return [
        {"test": test, "src": src, "dst": dst, "size_bytes": 8 if test == "latency" else 1 << 20,
         "time_us": 10.0 + src, "link_class": _evil("class"), "src_host": _evil("host")}
        for test in ("bandwidth", "latency")
        for src in range(2)
        for dst in range(2)
        if src != dst
    ]  # fmt: skip


def _health_rows() -> list[dict[str, Any]]:
    return [
        {"rank": rank, "host": _evil("host"), "device": rank, "bus_id": _evil("bus"),
         "nvlink_active": _evil("links"), "driver_version": _evil("driver"), "xid_events": _evil("xid"),
         "ecc_current": _evil("ecc"), "persistence": _evil("persistence")}
        for rank in range(2)
    ]  # fmt: skip


def _judge(frame: pd.DataFrame, ranks: pd.DataFrame, meta: dict[str, Any]) -> Verdict:
    elements = (
        Element(_evil("group"), _evil("check"), "FAIL", _evil("message"), _evil("measured"), remedy=EVIL),
        Element("pairwise", f"bandwidth {EVIL} 0->1", "WARN", EVIL_LINES),
        Element(_evil("group"), _evil("skipped"), "SKIP", EVIL_LINES),
    )
    return Verdict("FAIL", 1, _evil("reason"), elements, spec_name=_evil("spec"), spec_how=EVIL,
                   limits={"source": _evil("limits")})  # fmt: skip


def _folder(tmp_path: Path) -> Path:
    model_file = tmp_path / "model.yaml"
    name = _evil("model")
    model_file.write_text(
        f"name: {name!r}\nhidden: 4096\nnum_experts: 16\ntopk: 4\nmoe_intermediate: 1024\n", encoding="utf-8"
    )
    out = tmp_path / "run"
    writer = ReportWriter(out, _meta(model_file), HGX)
    rows = _rows(name)
    writer.add(rows, all_rank_rows(rows))  # their text columns (pattern, skew, knobs) are the rows'
    for table, table_rows in _profile_rows(name).items():
        writer.append_table(table, table_rows)
    writer.set_table(PAIRS_FILE, _pairs_rows())
    writer.set_table(HEALTH_FILE, _health_rows())
    writer.finalize(judge=_judge)
    return out


def _assert_no_markup(page: str) -> None:
    assert "<script" not in page.lower()
    assert EVIL not in page and "a|b" in page  # the text is there, escaped
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &quot;q&quot; &amp; &lt;/h4&gt;" in page
    assert page.count("<h4>") == page.count("</h4>")  # no closing tag but the page's own
    assert "<h4>" in page  # the per-peer matrices' headings (the model name, the skew) are there


def _tables(markdown: str) -> list[list[str]]:
    tables, current = [], []
    for line in markdown.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables + ([current] if current else [])


def _assert_tables_keep_their_columns(markdown: str) -> None:
    separator = re.compile(r"(?<!\\)\|")
    tables = _tables(markdown)
    assert len(tables) >= 10  # verdict, results, link classes, skew cost, windows, budget, profile, peers...
    for table in tables:
        counts = {len(separator.findall(line)) for line in table}
        assert len(counts) == 1, table
        assert table[1].replace("|", "").replace("-", "").replace(":", "").strip() == ""
    assert "\\|" in markdown and "line two" in markdown


def test_no_user_text_reaches_the_page_as_markup(tmp_path: Path) -> None:
    out = _folder(tmp_path)
    for render in ("run", "re-render"):
        if render == "re-render":
            render_folder(out)
        page = (out / "report.html").read_text(encoding="utf-8")
        _assert_no_markup(page)
        summary = (out / "summary.md").read_text(encoding="utf-8")
        _assert_tables_keep_their_columns(summary)
        # The fields reached the pages at all (a field left out would pass the checks above).
        for label in ("model", "host", "driver", "command", "topology", "reason", "message", "class",
                      "xid", "step", "limits", "version"):  # fmt: skip
            assert f"{label} &lt;script&gt;" in page, (render, label)
            assert f"{label} <script>" in summary, (render, label)

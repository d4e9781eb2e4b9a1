"""Report stage: result rows (bytes, times) -> bandwidth frame -> tables, files and pages of a report folder.

Modules, in the order data flows through them: ``frame`` (the only bytes -> GB/s code, ``CONVENTIONS``),
``knobs`` (knob settings: dicts in memory, text in files), ``modes`` (timing and check modes in words),
``tables`` (the one table printer and the report's tables), ``console`` (stdout: the balanced all-to-all
in nccl-tests' layout, then the MoE table), ``html`` (summary.md, report.html, plots), ``folder`` (the
output folder claimed exclusively, atomic files, whole CSV rows), ``reading`` (a saved folder read back
checked), ``files`` (report folder, CSV/parquet/JSON, ``ReportWriter``, ``render_report``). This package
re-exports their public names.
"""

from __future__ import annotations

from commbench.report.folder.claim import (
    OutDirClaim,
    OutDirTaken,
    ReportWriteError,
    check_claim,
    claim_out_dir,
    write_atomic,
)
from commbench.report.folder.reading import read_meta, read_report, read_rows
from commbench.report.folder.writer import (
    ReportWriter,
    file_records,
    mark_incomplete,
    render_report,
    results_json,
    saved_verdict,
    spec_figures,
    spec_from_meta,
    spec_meta,
)
from commbench.report.frame import (
    CONVENTIONS,
    DERIVED_COLUMNS,
    RANK_DERIVED_COLUMNS,
    average_bus_bandwidth,
    balanced_rows,
    gbps,
    rank_frame,
    results_frame,
)
from commbench.report.knobs import (
    KNOB_SETTING_COLUMN,
    knob_setting,
    parse_knobs,
    varying_knobs,
    with_knob_setting,
)
from commbench.report.pages.console import results_table
from commbench.report.pages.html import incomplete_note, incomplete_reason, report_html, summary_markdown
from commbench.report.pages.tables import format_bandwidth

__all__ = [
    "CONVENTIONS",
    "DERIVED_COLUMNS",
    "KNOB_SETTING_COLUMN",
    "RANK_DERIVED_COLUMNS",
    "OutDirClaim",
    "OutDirTaken",
    "ReportWriteError",
    "ReportWriter",
    "average_bus_bandwidth",
    "balanced_rows",
    "check_claim",
    "claim_out_dir",
    "file_records",
    "format_bandwidth",
    "gbps",
    "incomplete_note",
    "incomplete_reason",
    "knob_setting",
    "mark_incomplete",
    "parse_knobs",
    "rank_frame",
    "read_meta",
    "read_report",
    "read_rows",
    "render_report",
    "saved_verdict",
    "report_html",
    "results_frame",
    "results_json",
    "results_table",
    "spec_figures",
    "spec_from_meta",
    "spec_meta",
    "summary_markdown",
    "varying_knobs",
    "with_knob_setting",
    "write_atomic",
]

"""Report stage: result rows (bytes, times) -> bandwidth frame -> tables, files and pages of a report folder.

At the top: ``frame`` (the only bytes -> GB/s code, ``CONVENTIONS``) and ``knobs`` (knob settings: dicts in
memory, text in files). ``folder/``: the folder claimed exclusively with atomic files and whole CSV rows
(``claim``), read back typed and checked (``reading.read_folder``), written as phases finish and rendered
(``writer``: ``ReportWriter``, ``render_folder``, the one path from a folder's files to its pages).
``pages/``: the page as data (``sections.report_sections``: a list of ``render.Section``), the one renderer
to Markdown and HTML (``render``), the one table printer (``tables``), plots (``html``), the verdict
(``verdict_view``) and stdout in nccl-tests' layout (``console``). ``judge/``, ``analysis/``,
``profiler/``, ``interop/``: each analysis returns its table or section as data. This package re-exports
the public names callers use.
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
from commbench.report.folder.reading import ReportFolder, read_folder, read_meta, read_report, read_rows
from commbench.report.folder.writer import (
    ReportWriter,
    file_records,
    mark_incomplete,
    render_folder,
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
from commbench.report.pages.render import (
    Bullets,
    Code,
    Fields,
    Figure,
    FigureRow,
    Section,
    Text,
    html_page,
    markdown_page,
)
from commbench.report.pages.sections import (
    incomplete_note,
    incomplete_reason,
    report_html,
    report_sections,
    summary_markdown,
)
from commbench.report.pages.tables import Table, format_bandwidth

__all__ = [
    "CONVENTIONS",
    "DERIVED_COLUMNS",
    "KNOB_SETTING_COLUMN",
    "RANK_DERIVED_COLUMNS",
    "Bullets",
    "Code",
    "Fields",
    "Figure",
    "FigureRow",
    "OutDirClaim",
    "OutDirTaken",
    "ReportWriteError",
    "ReportFolder",
    "ReportWriter",
    "Section",
    "Table",
    "Text",
    "average_bus_bandwidth",
    "balanced_rows",
    "check_claim",
    "claim_out_dir",
    "file_records",
    "format_bandwidth",
    "gbps",
    "html_page",
    "incomplete_note",
    "incomplete_reason",
    "knob_setting",
    "markdown_page",
    "mark_incomplete",
    "parse_knobs",
    "rank_frame",
    "read_folder",
    "read_meta",
    "read_report",
    "read_rows",
    "render_folder",
    "render_report",
    "saved_verdict",
    "report_html",
    "report_sections",
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

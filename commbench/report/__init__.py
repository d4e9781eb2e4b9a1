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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Where each public name lives: imported on first use (PEP 562), so a rank that writes no report (every
# rank but 0) imports neither pandas nor matplotlib through a module of this package it does use.
_WHERE = {
    "OutDirClaim": "commbench.report.folder.claim",
    "OutDirTaken": "commbench.report.folder.claim",
    "ReportWriteError": "commbench.report.folder.claim",
    "check_claim": "commbench.report.folder.claim",
    "claim_out_dir": "commbench.report.folder.claim",
    "write_atomic": "commbench.report.folder.claim",
    "ReportFolder": "commbench.report.folder.reading",
    "read_folder": "commbench.report.folder.reading",
    "read_meta": "commbench.report.folder.reading",
    "read_report": "commbench.report.folder.reading",
    "read_rows": "commbench.report.folder.reading",
    "ReportWriter": "commbench.report.folder.writer",
    "file_records": "commbench.report.folder.writer",
    "mark_incomplete": "commbench.report.folder.writer",
    "render_folder": "commbench.report.folder.writer",
    "render_report": "commbench.report.folder.writer",
    "results_json": "commbench.report.folder.writer",
    "saved_verdict": "commbench.report.folder.writer",
    "spec_figures": "commbench.report.folder.writer",
    "spec_from_meta": "commbench.report.folder.writer",
    "spec_meta": "commbench.report.folder.writer",
    "CONVENTIONS": "commbench.report.frame",
    "DERIVED_COLUMNS": "commbench.report.frame",
    "RANK_DERIVED_COLUMNS": "commbench.report.frame",
    "average_bus_bandwidth": "commbench.report.frame",
    "balanced_rows": "commbench.report.frame",
    "gbps": "commbench.report.frame",
    "rank_frame": "commbench.report.frame",
    "results_frame": "commbench.report.frame",
    "KNOB_SETTING_COLUMN": "commbench.report.knobs",
    "knob_setting": "commbench.report.knobs",
    "parse_knobs": "commbench.report.knobs",
    "varying_knobs": "commbench.report.knobs",
    "with_knob_setting": "commbench.report.knobs",
    "results_table": "commbench.report.pages.console",
    "Bullets": "commbench.report.pages.render",
    "Code": "commbench.report.pages.render",
    "Fields": "commbench.report.pages.render",
    "Figure": "commbench.report.pages.render",
    "FigureRow": "commbench.report.pages.render",
    "Section": "commbench.report.pages.render",
    "Text": "commbench.report.pages.render",
    "html_page": "commbench.report.pages.render",
    "markdown_page": "commbench.report.pages.render",
    "incomplete_note": "commbench.report.pages.sections",
    "incomplete_reason": "commbench.report.pages.sections",
    "report_html": "commbench.report.pages.sections",
    "report_sections": "commbench.report.pages.sections",
    "summary_markdown": "commbench.report.pages.sections",
    "Table": "commbench.report.pages.tables",
    "format_bandwidth": "commbench.report.pages.tables",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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

"""Docs that restate code must not drift from it."""

from pathlib import Path

from commbench.report import CONVENTIONS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_conventions_page_carries_the_report_conventions_verbatim():
    page = (DOCS / "conventions.md").read_text()
    body = CONVENTIONS.split("\n", 1)[1].strip()
    assert body in page, "docs/conventions.md is out of date: paste commbench.report.CONVENTIONS into it"

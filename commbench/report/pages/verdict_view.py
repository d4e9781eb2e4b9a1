"""The verdict as the top of summary.md and report.html: overall status, reason, spec, and every check that
did not pass (then the passed ones, counted by group)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from commbench.report.judge.verdict import Element, Verdict
from commbench.report.pages.render import Block, Section, Text
from commbench.report.pages.tables import Table

_HEADERS = ["status", "group", "check", "measured", "limit", "message", "remedy"]
_ORDER = {"FAIL": 0, "WARN": 1, "SKIP": 2, "PASS": 3}
NO_VERDICT = (
    "No verdict: this folder has no verdict.json (written by an older version, or by a ReportWriter given no "
    "judge); nothing here was judged."
)


def _cell(value: Any, unit: str = "") -> str:
    if value is None or value == "":
        return "-"
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{text} {unit}".strip() if isinstance(value, (int, float)) else text


def _rows(elements: list[Element]) -> list[list[str]]:
    """FAIL and WARN one per row; SKIPs with the same group and reason folded into one row (a CPU run skips
    every bandwidth check for the same reason)."""
    ordered = sorted(elements, key=lambda element: _ORDER.get(element.status, 9))
    rows, skipped = [], Counter()
    names: dict[tuple[str, str], str] = {}
    for e in ordered:
        if e.status == "SKIP":
            reason = e.message.replace(e.name, "each case") if e.name else e.message
            skipped[(e.group, reason)] += 1
            names.setdefault((e.group, reason), e.name)
            continue
        rows.append(
            [e.status, e.group, e.name, _cell(e.measured, e.unit), _cell(e.limit), e.message, e.remedy or "-"]
        )
    for (group, reason), count in skipped.items():
        name = names[(group, reason)] if count == 1 else f"{count} checks"
        rows.append(["SKIP", group, name, "-", "-", reason, "-"])
    return rows


def _spec_line(verdict: Verdict) -> str:
    name = verdict.spec_name or "none"
    how = f" ({verdict.spec_how})" if verdict.spec_how else ""
    return f"Spec judged against: {name}{how}."


def _passed_line(verdict: Verdict) -> str:
    passed = Counter(e.group for e in verdict.elements if e.status == "PASS")
    if not passed:
        return "No check passed."
    return "Passed: " + ", ".join(f"{count} {group}" for group, count in passed.items()) + "."


def verdict_section(verdict: Verdict | None) -> Section:
    """The page's opening section: the verdict, its reason and tally, the spec and limits judged against,
    every check that did not pass, and the passed ones counted."""
    if verdict is None:
        return Section("Verdict: none", (Text(NO_VERDICT),), css="verdict")
    counts = verdict.counts()
    tally = ", ".join(f"{counts[status]} {status}" for status in ("FAIL", "WARN", "PASS", "SKIP"))
    css = "verdict stopped" if verdict.status == "INCOMPLETE" else f"verdict {verdict.status}"
    blocks: list[Block] = [
        Text(f" ({tally}; exit code {verdict.exit_code})", strong=str(verdict.reason)),
        Text(_spec_line(verdict)),
        Text(f"Limits: {verdict.limits.get('source', '-')}."),
    ]
    shown = [e for e in verdict.elements if e.status != "PASS"]
    if shown:
        blocks.append(Table(_HEADERS, _rows(shown), text_columns=set(range(7))))
    blocks.append(Text(_passed_line(verdict)))
    return Section(f"Verdict: {verdict.status}", tuple(blocks), css=css)

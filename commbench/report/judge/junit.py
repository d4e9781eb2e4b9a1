"""junit.xml of a verdict: one testsuite per check group, one testcase per element, as CI systems read it.

The shape Jenkins, GitLab and most JUnit readers accept::

    <testsuites name="commbench" tests failures errors skipped time>
      <testsuite name="commbench.balanced" tests failures errors skipped time>
        <testcase classname="commbench.balanced" name="balanced 16 MiB" time="0">
          <failure message="..." type="FAIL">details and remedy</failure>   (a FAIL element)
          <skipped message="..."/>                                         (a SKIP element)
          <system-out>WARN: ...</system-out>                                (a WARN element)
        </testcase>

JUnit has no "warning" result: a WARN element is a PASSED testcase whose ``<system-out>`` starts with
"WARN:" (so a CI job stays green on WARN, as the exit code 0 says), and every PASS element carries its
message in ``<system-out>`` too. ``errors`` is always 0: a run that could not finish is reported by the
``run`` group's completion testcase (a failure or a skip), not as a test error. ``time`` is 0: the checks
judge measurements, they take no time of their own. Characters XML 1.0 cannot hold (control characters) are
replaced by "?" so that every reader can parse the file.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from commbench.report.folder.claim import write_atomic
from commbench.report.judge.verdict import GROUPS, Element, Verdict

JUNIT_FILE = "junit.xml"
SUITES_NAME = "commbench"
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml(text: str) -> str:
    """``text`` with the characters XML 1.0 does not allow replaced by "?"."""
    return _NOT_XML.sub("?", text)


def _counts(elements: Sequence[Element]) -> dict[str, str]:
    return {
        "tests": str(len(elements)),
        "failures": str(sum(e.status == "FAIL" for e in elements)),
        "errors": "0",
        "skipped": str(sum(e.status == "SKIP" for e in elements)),
        "time": "0",
    }


def _details(element: Element) -> str:
    lines = [element.message]
    if element.measured is not None:
        lines.append(f"measured: {element.measured} {element.unit}".rstrip())
    if element.limit is not None:
        lines.append(f"limit: {element.limit} {element.unit}".rstrip())
    if element.remedy:
        lines.append(f"remedy: {element.remedy}")
    return "\n".join(lines)


def junit_tree(verdict: Verdict) -> ET.Element:
    """The <testsuites> element of ``verdict`` (groups in GROUPS order, then any other group)."""
    groups = list(GROUPS) + sorted({e.group for e in verdict.elements} - set(GROUPS))
    root = ET.Element("testsuites", {"name": SUITES_NAME, **_counts(verdict.elements)})
    for group in groups:
        elements = [e for e in verdict.elements if e.group == group]
        if not elements:
            continue
        suite_name = f"{SUITES_NAME}.{group}"
        suite = ET.SubElement(root, "testsuite", {"name": suite_name, **_counts(elements)})
        for element in elements:
            case = ET.SubElement(
                suite, "testcase", {"classname": suite_name, "name": _xml(element.name), "time": "0"}
            )
            if element.status == "FAIL":
                failure = ET.SubElement(case, "failure", {"message": _xml(element.message), "type": "FAIL"})
                failure.text = _xml(_details(element))
            elif element.status == "SKIP":
                ET.SubElement(case, "skipped", {"message": _xml(element.message)})
            else:
                out = ET.SubElement(case, "system-out")
                out.text = _xml(f"{element.status}: {_details(element)}")
    return root


def junit_xml(verdict: Verdict) -> str:
    """junit.xml's text (UTF-8 declaration, indented)."""
    root = junit_tree(verdict)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(out_dir: str | Path, verdict: Verdict) -> Path:
    """junit.xml in ``out_dir``, written atomically; its path."""
    path = Path(out_dir) / JUNIT_FILE
    write_atomic(path, junit_xml(verdict))
    return path

"""junit.xml: parses back with the counts of the verdict, in the shape Jenkins and GitLab read."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from commbench.report.judge.junit import junit_xml, write_junit
from commbench.report.judge.verdict import Element, RunStatus, Verdict

# What the common JUnit schema (Jenkins junit-10.xsd, GitLab's parser) allows under a testcase.
TESTCASE_CHILDREN = {"failure", "error", "skipped", "system-out", "system-err"}
COUNTS = ("tests", "failures", "errors", "skipped")


def _verdict() -> Verdict:
    elements = (
        Element("run", "completion", "PASS", "the run finished (3 result row(s))", 3, "0 timeouts"),
        Element("data", "#wrong", "PASS", "#wrong 0 in 3 checked row(s)", 0, 0),
        Element("balanced", "balanced 1 MiB", "PASS", "balanced 1 MiB time 20 us <= 45 us", 20.0, 45.2, "us"),
        Element(
            "balanced", "balanced 16 GiB", "FAIL", "balanced 16 GiB busbw 410 GB/s < 0.6 x 900 GB/s", 410.0,
            540.0, "GB/s", "check `nvidia-smi nvlink -s` & <links>",
        ),
        Element("balanced", "balanced 4 GiB", "WARN", "balanced 4 GiB busbw 560 GB/s < 0.65 x 900", 560.0),
        Element("moe", "deepseek-v3 dispatch", "SKIP", "CPU run: no GPU spec: not judged"),
        Element("spread", "c arrival rank 5", "FAIL", "rank 5 (host h2, GPU 1) arrival\x00 55 us", 55.0),
    )  # fmt: skip
    return Verdict("FAIL", 1, "balanced 16 GiB busbw 410 GB/s < 0.6 x 900 GB/s (+1 more FAIL)", elements)


def _check_shape(root: ET.Element) -> None:
    """The common JUnit shape: <testsuites> of <testsuite>s of <testcase>s, counts that add up."""
    assert root.tag == "testsuites"
    totals = dict.fromkeys(COUNTS, 0)
    for suite in root:
        assert suite.tag == "testsuite" and suite.get("name")
        cases = list(suite)
        assert all(case.tag == "testcase" and case.get("name") and case.get("classname") for case in cases)
        found = {
            "tests": len(cases),
            "failures": sum(case.find("failure") is not None for case in cases),
            "errors": sum(case.find("error") is not None for case in cases),
            "skipped": sum(case.find("skipped") is not None for case in cases),
        }
        for case in cases:
            children = [child.tag for child in case]
            assert set(children) <= TESTCASE_CHILDREN
            assert sum(tag in ("failure", "error", "skipped") for tag in children) <= 1
            failure = case.find("failure")
            assert failure is None or failure.get("message")
        for key in COUNTS:
            assert int(suite.get(key)) == found[key], (suite.get("name"), key)
            totals[key] += found[key]
        assert float(suite.get("time")) >= 0
    for key in COUNTS:
        assert int(root.get(key)) == totals[key]


def test_junit_parses_back_with_the_verdicts_counts(tmp_path):
    path = write_junit(tmp_path, _verdict())
    assert path.name == "junit.xml" and [p.name for p in tmp_path.iterdir()] == ["junit.xml"]
    root = ET.parse(path).getroot()
    _check_shape(root)
    assert {key: root.get(key) for key in COUNTS} == {
        "tests": "7",
        "failures": "2",
        "errors": "0",
        "skipped": "1",
    }
    assert [suite.get("name") for suite in root] == [
        "commbench.run",
        "commbench.data",
        "commbench.balanced",
        "commbench.moe",
        "commbench.spread",
    ]


def test_each_status_maps_to_its_junit_form():
    root = ET.fromstring(junit_xml(_verdict()))
    cases = {case.get("name"): case for case in root.iter("testcase")}
    failure = cases["balanced 16 GiB"].find("failure")
    assert failure.get("message") == "balanced 16 GiB busbw 410 GB/s < 0.6 x 900 GB/s"
    assert (
        "remedy: check `nvidia-smi nvlink -s` & <links>" in failure.text
        and "limit: 540.0 GB/s" in failure.text
    )
    assert cases["deepseek-v3 dispatch"].find("skipped").get("message") == "CPU run: no GPU spec: not judged"
    warn = cases["balanced 4 GiB"]  # WARN: a passed testcase that says WARN
    assert warn.find("failure") is None and warn.find("skipped") is None
    assert warn.find("system-out").text.startswith("WARN: balanced 4 GiB busbw 560 GB/s")
    assert cases["completion"].find("system-out").text.startswith("PASS: the run finished")
    assert cases["balanced 1 MiB"].get("classname") == "commbench.balanced"


def test_characters_xml_cannot_hold_are_replaced():
    text = junit_xml(_verdict())
    assert "\x00" not in text
    message = ET.fromstring(text).find(".//testcase[@name='c arrival rank 5']/failure").get("message")
    assert message == "rank 5 (host h2, GPU 1) arrival? 55 us"


@pytest.mark.parametrize("state", ["interrupted", "could_not_run"])
def test_an_incomplete_run_still_writes_a_valid_file(state):
    elements = (Element("run", "completion", "SKIP", f"not judged: {state}"),)
    verdict = Verdict("INCOMPLETE", 2, state, elements, RunStatus(state, "stopped"))
    root = ET.fromstring(junit_xml(verdict))
    _check_shape(root)
    assert root.get("skipped") == "1" and root.get("failures") == "0"

"""Backends from other packages: a fake dispatcher package installed into a temporary venv is discovered
through the ``commbench.backends`` entry point, listed, and runs verified on gloo through the plug-in path; a
broken plug-in, one that is not a Backend and one taking a built-in's name are listed with the reason."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

import commbench
from commbench.report.judge.verdict import read_verdict_json
from tests.launches import not_failed_by_data_or_completion

PLUGIN_SOURCES = Path(__file__).parent / "fakes" / "plugin"
REPO = Path(commbench.__file__).resolve().parents[1]
# distribution -> (version, module files, entry points of the group)
DISTRIBUTIONS = {
    "fake-dispatcher": (
        "0.1",
        ["fake_dispatcher.py"],
        {
            "fakeep": "fake_dispatcher:FakeBackend",
            "notabackend": "fake_dispatcher:NOT_A_BACKEND",
            "gloo": "fake_dispatcher:FakeBackend",
        },
    ),
    "broken-dispatcher": ("2.0", ["broken_dispatcher.py"], {"broken": "broken_dispatcher:BrokenBackend"}),
    # A second package registering a name already taken: the first in (name, package) order keeps it.
    "shadow-dispatcher": ("3.0", [], {"fakeep": "fake_dispatcher:FakeBackend"}),
}


def _install(site_packages: Path, name: str, version: str, files: list[str], points: dict[str, str]) -> None:
    """What pip leaves behind: the modules and a .dist-info with METADATA and entry_points.txt."""
    for file in files:
        (site_packages / file).write_text((PLUGIN_SOURCES / file).read_text())
    info = site_packages / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{key} = {value}\n" for key, value in points.items())
    (info / "entry_points.txt").write_text(f"[commbench.backends]\n{lines}")
    (info / "RECORD").write_text("")


@pytest.fixture(scope="module")
def plugin_python(tmp_path_factory) -> Path:
    """A venv (system site-packages, no network) that sees this interpreter's packages and commbench, with the
    fake plug-in distributions in its own site-packages."""
    root = tmp_path_factory.mktemp("plugin-venv")
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(root)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    site_packages = Path(purelib)
    # This interpreter's site-packages (torch, numpy, ...; processed as a site dir) and the checkout.
    (site_packages / "commbench_parent.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n{REPO}\n"
    )
    for name, (version, files, points) in DISTRIBUTIONS.items():
        _install(site_packages, name, version, files, points)
    return python


def _commbench(python: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "commbench", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_the_plugins_are_listed_with_their_package_and_availability(plugin_python):
    listed = _commbench(plugin_python, "backends", "--json")
    assert listed.returncode == 0, listed.stderr
    entries = json.loads(listed.stdout)["backends"]
    by_name: dict[str, list[dict]] = {}
    for entry in entries:
        by_name.setdefault(entry["name"], []).append(entry)
    fakeep, shadow = by_name["fakeep"]
    assert shadow["source"] == "shadow-dispatcher 3.0" and not shadow["available"]
    assert "already registered by fake-dispatcher 0.1" in shadow["reason"]
    assert fakeep["available"] and fakeep["source"] == "fake-dispatcher 0.1" and fakeep["moves_data"]
    assert [knob["name"] for knob in fakeep["knobs"]] == ["fake_sms"]
    (broken,) = by_name["broken"]
    assert not broken["available"] and broken["source"] == "broken-dispatcher 2.0"
    assert "No module named 'commbench_no_such_dependency'" in broken["reason"]
    (not_a_backend,) = by_name["notabackend"]
    assert (
        not not_a_backend["available"]
        and "fake_dispatcher:NOT_A_BACKEND: it names a function, not a subclass" in not_a_backend["reason"]
    )
    builtin, refused = by_name["gloo"]
    assert builtin["source"] == "built-in" and builtin["available"]
    assert refused["source"] == "fake-dispatcher 0.1" and not refused["available"]
    assert "is a built-in backend's; the built-in is used" in refused["reason"]
    table = _commbench(plugin_python, "backends")
    assert table.returncode == 0
    line = next(row for row in table.stdout.splitlines() if row.startswith("fakeep "))
    assert "fake-dispatcher 0.1" in line and "fake_sms" in line


def test_a_plugin_runs_verified_on_gloo_with_its_knobs_in_the_rows(plugin_python, tmp_path):
    out = tmp_path / "report"
    ran = _commbench(
        plugin_python,
        "run",
        "--backend",
        "fakeep",
        "--world-size",
        "4",
        "--model",
        "deepseek-v3",
        "--tokens",
        "64",
        "--skew",
        "zipf:1.2",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--backend-option",
        "fake_sms=16",
        "--out",
        str(out),
    )
    assert ran.returncode in (0, 1), ran.stdout + ran.stderr  # 1: a busy host's straggler (timing only)
    not_failed_by_data_or_completion(read_verdict_json(out / "verdict.json"))
    with open(out / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {row["phase"] for row in rows} >= {"dispatch", "combine"}
    for row in rows:
        assert row["backend"] == "fakeep" and row["wrong"] == "0" and row["check"] == "checksum"
        assert row["fake_sms"] == "16" and row["fake_dispatcher_version"] == "0.1"
        assert "fake_sms=16" in row["knobs"]


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        (
            "broken",
            "from package broken-dispatcher 2.0 cannot be used: importing broken_dispatcher:BrokenBackend",
        ),
        ("notabackend", "from package fake-dispatcher 0.1 cannot be used"),
    ],
)
def test_choosing_a_plugin_that_cannot_load_is_one_line_and_exit_2(plugin_python, tmp_path, name, fragment):
    out = tmp_path / "nothing"
    ran = _commbench(
        plugin_python, "run", "--backend", name, "--world-size", "2", "--out", str(out), timeout=120
    )
    assert ran.returncode == 2, ran.stdout + ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in ran.stderr
    assert not out.exists()


def test_unknown_names_are_refused_and_builtin_names_stay():
    from commbench.backends import BACKENDS, BUILTIN_BACKENDS, get_backend
    from commbench.errors import UsageError

    assert list(BACKENDS)[: len(BUILTIN_BACKENDS)] == list(BUILTIN_BACKENDS)
    with pytest.raises(UsageError, match="unknown backend 'nope'; choose one of: auto, nccl, gloo"):
        get_backend("nope")


def test_this_interpreter_without_the_plugins_lists_none():
    listed = subprocess.run(
        [sys.executable, "-m", "commbench", "backends", "--json"], capture_output=True, text=True, timeout=300
    )
    names = [entry["name"] for entry in json.loads(listed.stdout)["backends"]]
    assert "fakeep" not in names and names[:2] == ["nccl", "gloo"] and "deep-ep" in names

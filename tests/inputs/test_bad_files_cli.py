"""Bad files given to the CLI (--model FILE, --spec FILE, --skew trace:FILE): one stderr line, exit 2, no
traceback, nothing written, for every class of bad file, before anything is launched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from commbench.cli import cli
from tests.inputs.test_userfiles import alias_bomb

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
MODEL = "hidden: 64\nnum_experts: 8\ntopk: 2\n"
SPEC = "name: test\ngpus_per_domain: 8\nnvlink_GBps_per_direction: 450\nnic_Gbps_per_direction: 400\n"
MAX_MESSAGE = 400  # a refusal quotes at most a short piece of any value
# specs.py's own checks quote a whole (single) value: bounded by the loader's MAX_SCALAR_CHARS (512) only.
MAX_SPEC_MESSAGE = 400 + 512


@pytest.fixture(autouse=True)
def outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COMMBENCH_DEBUG", raising=False)


def assert_refused(args: list[str], *fragments: str, longest: int = MAX_MESSAGE) -> str:
    """Exit 2, exactly one short stderr line 'commbench: error: ...' holding ``fragments``, no traceback."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commbench: error: "), result.stderr
    assert "Traceback" not in result.output and len(lines[0]) < longest, lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


# Each class of bad model or spec file: (file content, words the one line must hold).
BAD_YAML = {
    "alias-bomb": (alias_bomb(key="hidden"), ["more than", "line"]),
    "over-1MiB": ("hidden: 64\n" + "#" * (1 << 20), ["larger than 1 MiB"]),
    "python-tag": (
        "hidden: !!python/object/apply:os.getcwd []\n",
        ["!!python/object/apply:os.getcwd", "remove"],
    ),
    "not-utf8": ("hidden: 64\nname: mod\xe8le\n".encode("latin-1"), ["not UTF-8", "0xe8"]),
    "control-char": ("hidden: 64\x00\n", ["U+0000"]),
    "400-digit-int": ("hidden: 1" + "0" * 400 + "\n", ["hidden", "out of range"]),
    "5000-digit-int": ("hidden: 1" + "0" * 5000 + "\n", ["hidden", "out of range"]),
    "empty": ("", ["is empty"]),
    "top-level-list": ("- hidden: 64\n", ["expected a mapping", "a list"]),
    "duplicate-key": ("hidden: 64\nhidden: 128\n", ["hidden", "twice"]),
    "deep-nesting": ("hidden: " + "[" * 5000 + "]" * 5000 + "\n", ["nested more than"]),
}

BAD_MODEL_VALUES = {
    "nan": ("hidden: .nan\nnum_experts: 8\ntopk: 2\n", ["hidden must be a positive integer", "nan"]),
    "inf": ("hidden: .inf\nnum_experts: 8\ntopk: 2\n", ["hidden must be a positive integer", "inf"]),
    "float-overflow": ("hidden: 1.0e+400\nnum_experts: 8\ntopk: 2\n", ["hidden must be a positive integer"]),
    "1e400-text": ("hidden: 1e400\nnum_experts: 8\ntopk: 2\n", ["hidden must be a positive integer", "text"]),
    "bool": ("hidden: true\nnum_experts: 8\ntopk: 2\n", ["hidden must be a positive integer", "boolean"]),
    "hidden-1e20": ("hidden: 100000000000000000000\nnum_experts: 8\ntopk: 2\n", ["hidden", "out of range"]),
    "hidden-2^40": (f"hidden: {1 << 40}\nnum_experts: 8\ntopk: 2\n", ["hidden", "above the limit 1048576"]),
    "experts-10^12": (
        "hidden: 64\nnum_experts: 1000000000000\ntopk: 2\n",
        ["num_experts", "above the limit"],
    ),
    "topk-over-experts": ("hidden: 64\nnum_experts: 8\ntopk: 9\n", ["topk 9 exceeds num_experts 8"]),
    "list-value": ("hidden: [64]\nnum_experts: 8\ntopk: 2\n", ["hidden must be a single value"]),
    "long-name": (MODEL + f"name: {'x' * 500}\n", ["name", "printable characters"]),
}


@pytest.mark.parametrize("case", sorted({**BAD_YAML, **BAD_MODEL_VALUES}))
def test_bad_model_file(tmp_path: Path, case: str) -> None:
    content, words = {**BAD_YAML, **BAD_MODEL_VALUES}[case]
    model = write(tmp_path / "model.yaml", content)
    assert_refused(
        ["pattern", "--model", str(model), "--world-size", "2", "--tokens", "8"], str(model), *words
    )


def test_bad_model_file_leaves_no_report_folder(tmp_path: Path) -> None:
    model = write(tmp_path / "model.yaml", alias_bomb(key="hidden"))
    out = tmp_path / "out"
    assert_refused(
        ["run", "--model", str(model), "--world-size", "2", "--backend", "mock", "--out", str(out)]
    )
    assert not out.exists()


def test_yaml_tag_never_runs_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    model = write(tmp_path / "model.yaml", f"hidden: !!python/object/apply:os.mkdir ['{marker}']\n")
    assert_refused(["pattern", "--model", str(model), "--world-size", "2"], "not accepted")
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["folder", "device", "missing"])
def test_model_path_that_is_not_a_file(tmp_path: Path, kind: str) -> None:
    path = {"folder": str(tmp_path) + "/", "device": os.devnull, "missing": str(tmp_path / "none.yaml")}[kind]
    words = {"folder": "is a folder", "device": "not a regular file", "missing": "not found"}[kind]
    assert_refused(["pattern", "--model", path, "--world-size", "2"], words)


def test_alias_bomb_cli_ends_quickly_in_a_subprocess(tmp_path: Path) -> None:
    """The unbounded version hung with memory growing; the bound makes it a plain exit 2 (a generous
    timeout only guards the test suite against a hang, it measures nothing)."""
    model = write(tmp_path / "bomb.yaml", alias_bomb(levels=30, key="hidden"))  # 10^30 strings
    done = subprocess.run(
        [sys.executable, "-m", "commbench", "pattern", "--model", str(model), "--world-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and k != "COMMBENCH_DEBUG"},
    )
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "more than" in lines[0] and len(lines[0]) < MAX_MESSAGE


# --- spec files: run and suite (--spec), simulate (--spec) -------------------------------------------------

BAD_SPEC_VALUES = {
    "nan": (SPEC.replace("450", ".nan"), ["nvlink_GBps_per_direction must be positive"]),
    "inf": (SPEC.replace("450", ".inf"), ["nvlink_GBps_per_direction must be positive"]),
    "400-digit-int": (SPEC.replace("450", "4" + "0" * 400), ["nvlink_GBps_per_direction", "out of range"]),
    "bool": (SPEC.replace("450", "true"), ["nvlink_GBps_per_direction must be a number"]),
    "long-text-number": (
        SPEC.replace("450", "9" * 500 + "x"),
        ["nvlink_GBps_per_direction must be a number"],
    ),
    "over-long-text": (
        SPEC.replace("450", "9" * 1000 + "x"),
        ["nvlink_GBps_per_direction", "longer than 512"],
    ),
}


@pytest.mark.parametrize("case", sorted({**BAD_YAML, **BAD_SPEC_VALUES}))
def test_bad_spec_file(tmp_path: Path, case: str) -> None:
    content, words = {**BAD_YAML, **BAD_SPEC_VALUES}[case]
    if case == "python-tag":
        content = SPEC.replace("450", "!!python/object/apply:os.getcwd []")
    spec = write(tmp_path / "spec.yaml", content)
    words = [word.replace("hidden", "nvlink_GBps_per_direction") for word in words if word != "hidden"]
    out = tmp_path / "out"
    for command in (["run", "--world-size", "2"], ["suite", "--world-size", "2", "--quick"]):
        args = [*command, "--backend", "mock", "--spec", str(spec), "--out", str(out)]
        assert_refused(args, *words, longest=MAX_SPEC_MESSAGE)
        assert not out.exists()
    assert_refused(["simulate", "--spec", str(spec), "--ranks", "8"], *words, longest=MAX_SPEC_MESSAGE)


def test_spec_path_that_is_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "specs.yaml"
    folder.mkdir()
    out = tmp_path / "out"
    assert_refused(["run", "--world-size", "2", "--spec", str(folder), "--out", str(out)], "is a folder")
    assert not out.exists()


# --- traces (--skew trace:PATH) -----------------------------------------------------------------------------


class _RunsOnUnpickle:
    """Unpickling this creates ``marker``: proof that a pickle was executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_trace_pickle_is_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    trace = tmp_path / "trace.npz"
    ids = np.empty((2, 2), dtype=object)
    ids[:] = _RunsOnUnpickle(str(marker))
    np.savez(trace, topk_ids=ids)
    model = write(tmp_path / "model.yaml", MODEL)
    args = [
        "pattern",
        "--model",
        str(model),
        "--skew",
        f"trace:{trace}",
        "--world-size",
        "2",
        "--tokens",
        "8",
    ]
    assert_refused(args, "pickled object arrays")
    assert not marker.exists()


@pytest.mark.parametrize(
    "ids, words",
    [
        (np.array([[0.0, np.nan], [1.0, 2.0]]), ["must be integer expert ids", "float64"]),
        (np.array([[0, 1], [2, 8]]), ["span 0..8", "experts 0..7"]),
        (np.array([[0, 1], [2, 2**63 + 5]], dtype=np.uint64), ["experts 0..7"]),
        (np.zeros((4, 3), dtype=np.int64), ["shape [4, 3]", "[tokens, 2]"]),
    ],
    ids=["nan", "out-of-range", "uint64-huge", "wrong-shape"],
)
def test_bad_trace(tmp_path: Path, ids: np.ndarray, words: list[str]) -> None:
    trace = tmp_path / "trace.npz"
    np.savez(trace, topk_ids=ids)
    model = write(tmp_path / "model.yaml", MODEL)
    out = tmp_path / "out"
    common = ["--model", str(model), "--skew", f"trace:{trace}", "--world-size", "2", "--tokens", "8"]
    assert_refused(["pattern", *common], str(trace), *words)
    assert_refused(["run", *common, "--backend", "mock", "--out", str(out)], *words)
    assert not out.exists()

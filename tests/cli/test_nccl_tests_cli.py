"""``--nccl-tests-matrix`` on ``commbench pattern`` and ``commbench run``: both files written, both commands
printed, the run still verified; an existing file, a balanced sweep or a refused launch leave nothing."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from commbench.cli import cli
from commbench.report.interop.nccl_tests_export import moved_bytes, read_matrix_file
from tests.launches import SMALL_MODEL, Launch

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COMMBENCH_DEBUG", raising=False)


@pytest.fixture
def small_model(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL_MODEL)
    return path


def pattern_args(model: Path, *extra: str) -> list[str]:
    return [
        "pattern",
        "--model",
        str(model),
        "--world-size",
        "4",
        "--tokens",
        "32",
        "--skew",
        "zipf:1.2",
        *extra,
    ]


def commands_in(text: str) -> dict[str, list[str]]:
    """The printed alltoallv_perf commands by the file each names, split as a shell would."""
    found = {}
    for line in text.splitlines():
        if "alltoallv_perf" in line and line.strip().startswith("mpirun"):
            argv = shlex.split(line)
            found[argv[4].split("=", 1)[1]] = argv
    return found


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name, 5) + 1]


def assert_one_line_refusal(result, fragment: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commbench: error: ") and fragment in lines[0], (
        result.stderr
    )


def test_pattern_writes_both_files_and_prints_both_commands(tmp_path: Path, small_model: Path) -> None:
    target = tmp_path / "moe.txt"
    result = CliRunner().invoke(cli, pattern_args(small_model, "--nccl-tests-matrix", str(target)))
    assert result.exit_code == 0, result.output
    combine = tmp_path / "moe.combine.txt"
    commands = commands_in(result.stdout)
    assert set(commands) == {str(target), str(combine)}
    assert "imbalance statistics:" in result.stdout  # the usual output is still there

    as_json = CliRunner().invoke(cli, pattern_args(small_model, "--json"))
    data = json.loads(as_json.stdout)
    for path, key in ((target, "dispatch_bytes"), (combine, "combine_bytes")):
        expected = np.array(data[key])
        moved = moved_bytes(read_matrix_file(path), 4)
        np.testing.assert_array_equal(moved, expected)  # the same routing, bytes nccl-tests moves
        size = str(max(expected.sum(0).max(), expected.sum(1).max()))
        argv = commands[str(path)]
        assert argv[:4] == ["mpirun", "-np", "4", "env"] and argv[5] == "./build/alltoallv_perf"
        assert flag(argv, "-b") == flag(argv, "-e") == size and flag(argv, "-d") == "uint8"
        assert "-n" not in argv[5:]  # no iterations known: nccl-tests' defaults


def test_pattern_json_stays_json_with_the_export(tmp_path: Path, small_model: Path) -> None:
    target = tmp_path / "m"
    result = CliRunner().invoke(cli, pattern_args(small_model, "--json", "--nccl-tests-matrix", str(target)))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["world"] == 4
    assert set(commands_in(result.stderr)) == {str(target), str(tmp_path / "m.combine")}


@pytest.mark.parametrize("existing", ["m.txt", "m.combine.txt"])
def test_an_existing_file_is_refused_and_untouched(tmp_path: Path, small_model: Path, existing: str) -> None:
    (tmp_path / existing).write_text("not yours\n")
    target = str(tmp_path / "m.txt")
    result = CliRunner().invoke(cli, pattern_args(small_model, "--nccl-tests-matrix", target))
    assert_one_line_refusal(result, "already exists")
    out = tmp_path / "run"
    args = ["run", "--model", str(small_model), "--world-size", "4", "--tokens", "32", "--backend", "gloo"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out), "--nccl-tests-matrix", target])
    assert_one_line_refusal(result, "already exists")
    assert (tmp_path / existing).read_text() == "not yours\n"
    assert sorted(path.name for path in tmp_path.glob("m*")) == [existing] and not out.exists()


def test_run_refuses_a_balanced_sweep_and_a_missing_folder(tmp_path: Path, small_model: Path) -> None:
    out = tmp_path / "run"
    base = ["run", "--world-size", "4", "--backend", "gloo", "--out", str(out)]
    result = CliRunner().invoke(
        cli, [*base, "--pattern", "balanced", "--nccl-tests-matrix", str(tmp_path / "b")]
    )
    assert_one_line_refusal(result, "alltoall_perf")
    missing = str(tmp_path / "no" / "m.txt")
    result = CliRunner().invoke(cli, [*base, "--model", str(small_model), "--nccl-tests-matrix", missing])
    assert_one_line_refusal(result, "does not exist")
    assert not out.exists() and not list(tmp_path.glob("b*"))


def test_a_launch_refused_after_the_export_removes_the_files(tmp_path: Path, small_model: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "results.csv").write_text("someone else's\n")  # --out must be new or empty: refused at launch
    args = ["run", "--model", str(small_model), "--world-size", "4", "--tokens", "32", "--backend", "gloo"]
    result = CliRunner().invoke(
        cli, [*args, "--out", str(out), "--nccl-tests-matrix", str(tmp_path / "m.txt")]
    )
    assert result.exit_code == 2, result.output
    assert not list(tmp_path.glob("m*.txt"))
    assert (out / "results.csv").read_text() == "someone else's\n"


def test_run_on_gloo_writes_the_files_and_still_runs_verified(moe_run: Launch) -> None:
    # The session's shared MoE run (tests/launches.py): --nccl-tests-matrix <its folder>/moe.txt.
    target, combine = moe_run.cwd / "moe.txt", moe_run.cwd / "moe.combine.txt"
    commands = commands_in(moe_run.stderr)
    assert set(commands) == {str(target), str(combine)}
    results = pd.read_csv(moe_run.out / "results.csv").set_index("phase")
    assert (results["wrong"] == 0).all()
    for phase, path in (("dispatch", target), ("combine", combine)):
        argv = commands[str(path)]
        assert argv[:4] == ["mpirun", "-np", "2", "env"]
        assert flag(argv, "-n") == "3" and flag(argv, "-w") == "1"  # the run's --iters / --warmup
        moved = moved_bytes(read_matrix_file(path), 2)
        # The run moved the pattern the file holds: nccl-tests' size column equals the run's size(B).
        size = max(moved.sum(0).max(), moved.sum(1).max())
        assert int(flag(argv, "-b")) == size == results.loc[phase, "size_bytes"]
        assert moved.sum() == results.loc[phase, "total_bytes"]

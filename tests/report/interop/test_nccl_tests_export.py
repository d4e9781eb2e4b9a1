"""The nccl-tests alltoallv_perf export: the traffic-matrix file as nccl-tests parses it, the bytes it moves
read back against the pattern (16-byte rounding), the command line, and malformed files refused."""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest

from commbench.cli.inputs import build_routing_config
from commbench.errors import UsageError
from commbench.report.interop import nccl_tests_export as export
from commbench.run.config import MoeConfig
from commbench.traffic.pattern import Pattern, balanced_pattern, build_pattern


def small_pattern(tmp_path: Path, hidden: int, world: int = 4, tokens: int = 64) -> Pattern:
    """A routed pattern of a small BF16 model: rows of 2 x hidden bytes (hidden 36: 72 B, not a multiple
    of 16; hidden 64: 128 B, a multiple)."""
    model = tmp_path / f"small-{hidden}.yaml"
    model.write_text(f"name: small\nhidden: {hidden}\nnum_experts: 8\ntopk: 2\ndispatch_dtype: bf16\n")
    inputs = MoeConfig(str(model), "zipf:1.2", tokens)
    return build_pattern(build_routing_config(inputs, world, dry_run=False), "token")


def written(tmp_path: Path, pattern: Pattern, **kwargs: int) -> list[export.PhaseExport]:
    exports = export.plan_export(pattern, tmp_path / "matrix.txt", **kwargs)
    export.write_export(exports)
    return exports


def nccl_tests_reading(text: str) -> np.ndarray:
    """The file read the way alltoallv.cu reads it, written out here independently: rows end at a newline
    after a value, values are whitespace-separated numbers cut to integers and rounded down to 16 bytes."""
    rows = [line.split() for line in text.split("\n") if line.split()]
    return np.array([[int(float(value)) & ~15 for value in row] for row in rows], dtype=np.int64)


# ---------------------------------------------------------------------------------------------------------
# The file and the round trip


def test_file_holds_the_pattern_bytes_a_row_per_sending_rank(tmp_path: Path) -> None:
    pattern = small_pattern(tmp_path, hidden=36)
    dispatch, combine = written(tmp_path, pattern)
    assert dispatch.path == tmp_path / "matrix.txt" and combine.path == tmp_path / "matrix.combine.txt"
    for phase_export, matrix in ((dispatch, pattern.dispatch_bytes), (combine, pattern.combine_bytes)):
        lines = phase_export.path.read_text().splitlines()
        assert len(lines) == pattern.world_size  # row i = what rank i sends
        assert [[int(value) for value in line.split(" ")] for line in lines] == matrix.tolist()
    # Combine is the expert side answering: the transpose of dispatch's rows, in combine's row size.
    assert not np.array_equal(pattern.dispatch_bytes, pattern.dispatch_bytes.T)  # skewed: order matters


@pytest.mark.parametrize("hidden", [36, 64])
def test_round_trip_bytes_equal_the_pattern_within_the_16_byte_rounding(tmp_path: Path, hidden: int) -> None:
    pattern = small_pattern(tmp_path, hidden=hidden)
    matrices = (pattern.dispatch_bytes, pattern.combine_bytes)
    for phase_export, matrix in zip(written(tmp_path, pattern), matrices, strict=True):
        moved = export.moved_bytes(export.read_matrix_file(phase_export.path), pattern.world_size)
        np.testing.assert_array_equal(moved, nccl_tests_reading(phase_export.path.read_text()))
        np.testing.assert_array_equal(moved, phase_export.moved)
        lost = matrix - moved
        assert (moved % 16 == 0).all() and lost.min() >= 0 and lost.max() <= 15
        if hidden == 64:  # 128-byte rows: nothing to round
            np.testing.assert_array_equal(moved, matrix)
            assert phase_export.size_bytes == max(matrix.sum(0).max(), matrix.sum(1).max())
        else:  # 72-byte rows: an odd number of rows loses 8 bytes
            assert lost.any()
        # -e is exactly what nccl-tests requires: the busiest rank's max(sent, received) of moved bytes.
        assert phase_export.size_bytes == max(moved.sum(0).max(), moved.sum(1).max())


def test_moved_bytes_truncate_then_round_down_and_use_the_first_ranks() -> None:
    values = np.array([[100.7, 15.0, 31.0], [16.0, 0.0, 47.9], [1e6, 2.0, 3.0]])
    np.testing.assert_array_equal(export.moved_bytes(values), [[96, 0, 16], [16, 0, 32], [1_000_000, 0, 0]])
    np.testing.assert_array_equal(export.moved_bytes(values, 2), [[96, 0], [16, 0]])
    with pytest.raises(UsageError, match="3 rows; nccl-tests refuses 4 ranks"):
        export.moved_bytes(values, 4)


def test_parser_takes_what_nccl_tests_takes(tmp_path: Path) -> None:
    path = tmp_path / "m.txt"
    path.write_bytes(b"\n 1e3\t.5  7.\r\n\n\n16 +32 0\r\n\v48 64 80 \f\n")  # CRLF, tabs, blank lines
    values = export.read_matrix_file(path)
    np.testing.assert_array_equal(values, [[1000, 0.5, 7], [16, 32, 0], [48, 64, 80]])
    np.testing.assert_array_equal(export.moved_bytes(values, 2), [[992, 0], [16, 32]])


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "holds no values"),
        (b" \n\t\n", "holds no values"),
        (b"1 2\n3\n", "row 2 has 1 values, row 1 has 2"),
        (b"1 2\n3 4\n5 6\n", "3 rows of 2 values; nccl-tests needs a square matrix"),
        (b"1 -2\n3 4\n", "row 1, value 2: '-2' is negative"),
        (b"1 2\n3 1e\n", "row 2, value 2: '1e' is not a number"),
        (b"1 2\n3 4.5.6\n", "'4.5.6' is not a number"),
        (b"1 2\n3 1e400\n", "is above 2^63 bytes"),
        (b"1 0x10\n3 4\n", "'x' on line 1 is not part of a number"),
        (b"1 nan\n3 4\n", "'n' on line 1 is not part of a number"),
        (b"1,2\n3,4\n", "',' on line 1 is not part of a number"),
        (b"1 2\n3 4\xff\n", "byte 0xff at offset 7 is not text"),
    ],
)
def test_malformed_files_are_one_line_errors(tmp_path: Path, content: bytes, fragment: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(UsageError) as caught:
        export.read_matrix_file(path)
    message = str(caught.value)
    assert "\n" not in message and "bad.txt" in message and fragment in message, message


def test_missing_folder_and_oversized_files_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UsageError, match="not found"):
        export.read_matrix_file(tmp_path / "none.txt")
    with pytest.raises(UsageError, match="is a folder"):
        export.read_matrix_file(tmp_path)
    big = tmp_path / "big.txt"
    big.write_text("16 16\n16 16\n")
    monkeypatch.setattr(export, "MAX_MATRIX_FILE_BYTES", 8)
    with pytest.raises(UsageError, match="larger than 8 bytes"):
        export.read_matrix_file(big)


# ---------------------------------------------------------------------------------------------------------
# The command line and the notes


def test_command_line_fields(tmp_path: Path) -> None:
    pattern = small_pattern(tmp_path, hidden=64)
    dispatch, combine = written(tmp_path, pattern, iters=7, warmup=3)
    for phase_export in (dispatch, combine):
        argv = shlex.split(phase_export.command)
        assert argv[:5] == [
            "mpirun",
            "-np",
            "4",
            "env",
            f"NCCL_TESTS_ALLTOALLV_MATRIX_FILE={phase_export.path}",
        ]
        assert argv[5] == "./build/alltoallv_perf"
        flags = dict(zip(argv[6::2], argv[7::2], strict=True))
        size = str(phase_export.size_bytes)
        assert flags == {"-b": size, "-e": size, "-d": "uint8", "-g": "1", "-a": "3", "-n": "7", "-w": "3"}
    assert dispatch.size_bytes == max(
        pattern.dispatch_bytes.sum(0).max(), pattern.dispatch_bytes.sum(1).max()
    )

    plain = shlex.split(export.alltoallv_command("rel dir/m.txt", 8, 4096, launcher="srun"))
    assert plain[:4] == ["srun", "-n", "8", "env"]
    assert plain[4] == f"NCCL_TESTS_ALLTOALLV_MATRIX_FILE={Path.cwd() / 'rel dir/m.txt'}"  # absolute, quoted
    assert "-n" not in plain[5:] and "-w" not in plain[5:]  # nccl-tests' own defaults
    with pytest.raises(ValueError, match="launcher"):
        export.alltoallv_command("m.txt", 2, 16, launcher="pdsh")


def test_summary_states_rounding_busbw_and_time(tmp_path: Path) -> None:
    pattern = small_pattern(tmp_path, hidden=36)
    exports = written(tmp_path, pattern)
    text = export.export_summary(exports)
    for phase_export in exports:
        assert phase_export.command in text and str(phase_export.path) in text
    lost = pattern.dispatch_bytes - exports[0].moved
    assert f"{np.count_nonzero(lost)} of 16 pairs lose up to {lost.max()} B" in text
    for words in ("size x (n-1)/n", "-a 3", "--timing window", "out-of-place", "srun -n 4"):
        assert words in text
    moved = exports[0].moved
    link = max((moved.sum(1) - np.diag(moved)).max(), (moved.sum(0) - np.diag(moved)).max())
    assert f"busbw = {exports[0].size_bytes * 3 / 4 / link:.3f} x commbench's" in text
    (tmp_path / "aligned").mkdir()
    aligned = export.export_summary(written(tmp_path / "aligned", small_pattern(tmp_path, hidden=64)))
    assert "every pair is a multiple of 16 B: nccl-tests moves exactly the pattern's bytes" in aligned


# ---------------------------------------------------------------------------------------------------------
# What is refused: nothing written


def test_combine_file_name() -> None:
    assert export.combine_path("/x/m.txt") == Path("/x/m.combine.txt")
    assert export.combine_path("/x/matrix") == Path("/x/matrix.combine")
    assert export.combine_path("/x/a.b.csv") == Path("/x/a.b.combine.csv")


@pytest.mark.parametrize("existing", ["matrix.txt", "matrix.combine.txt"])
def test_an_existing_file_is_refused_and_nothing_written(tmp_path: Path, existing: str) -> None:
    pattern = small_pattern(tmp_path, hidden=64)
    (tmp_path / existing).write_text("mine\n")
    with pytest.raises(UsageError, match="already exists"):
        export.plan_export(pattern, tmp_path / "matrix.txt")
    assert (tmp_path / existing).read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.glob("matrix*")) == [existing]
    with pytest.raises(UsageError, match="does not exist; create it"):
        export.plan_export(pattern, tmp_path / "no-folder" / "matrix.txt")


def test_a_file_that_appears_after_the_plan_is_not_overwritten(tmp_path: Path) -> None:
    exports = export.plan_export(small_pattern(tmp_path, hidden=64), tmp_path / "m.txt")
    (tmp_path / "m.combine.txt").write_text("mine\n")
    with pytest.raises(UsageError, match="appeared meanwhile"):
        export.write_export(exports)
    assert not (tmp_path / "m.txt").exists() and (tmp_path / "m.combine.txt").read_text() == "mine\n"


def test_balanced_one_rank_and_empty_patterns_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="alltoall_perf"):
        export.plan_export(balanced_pattern(4, 4096), tmp_path / "b.txt")
    with pytest.raises(UsageError, match="at least 2 ranks"):
        export.plan_export(small_pattern(tmp_path, hidden=64, world=1), tmp_path / "one.txt")
    # 4-byte rows, one token per rank: no pair reaches 16 bytes, and -b 0 would hang nccl-tests' warm-up.
    with pytest.raises(UsageError, match="moves no whole 16-byte unit"):
        export.plan_export(small_pattern(tmp_path, hidden=2, tokens=1), tmp_path / "tiny.txt")
    assert not list(tmp_path.glob("*.txt"))

"""nccl-tests ``alltoallv_perf`` cross-check: an MoE phase's [src][dst] bytes as its traffic-matrix file,
the command line that replays the same bytes, and such a file read back.

What nccl-tests does with the file (read at NVIDIA/nccl-tests v2.19.6, commit a0b82b2, ``src/alltoallv.cu``
and ``src/common.cu``; the matrix mode exists since v2.19.0):

- the file is named by the environment variable ``NCCL_TESTS_ALLTOALLV_MATRIX_FILE`` (there is no flag);
- it holds byte counts, not fractions: whitespace-separated numbers, one line per SENDING rank, cell [i][j]
  = bytes rank i sends rank j; the matrix must be square with at least as many rows as ranks (only the
  first nranks rows and columns are used); a negative value, a non-number, a ragged row or a non-square
  matrix aborts the run. ``NCCL_TESTS_ALLTOALLV_MATRIX_SCALE`` (default 1) multiplies every value;
- each value is cut to an integer and rounded DOWN to a multiple of 16 bytes, then divided by the ``-d``
  type's size (a whole number of elements for every type up to 16 bytes): with ``-d uint8`` a pair moves
  its value rounded down to 16 bytes, at most 15 bytes short;
- ``-b`` must equal ``-e`` and be at least the busiest rank's max(bytes sent, bytes received) (``-f``
  plays no part); ``-b 0`` would never leave nccl-tests' warm-up loop (it doubles the size from ``-b``);
- its size column, algbw and busbw use those selected bytes, not a nominal size: size = the busiest rank's
  max(sent, received), self traffic included (commbench's size(B)); algbw = size / time; busbw = algbw x
  (n-1)/n. Time is the window of ``-n`` back-to-back calls / n, averaged over ranks (``-a 1``) unless
  ``-a 3`` (max over ranks, which the source recommends for imbalanced traffic);
- in-place is not supported (its in-place columns are not checked): read the out-of-place columns.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from commbench.errors import UsageError
from commbench.inputs.userfiles import read_user_bytes, shorten, show_path
from commbench.report.folder.claim import write_atomic
from commbench.traffic.pattern import Pattern

NCCL_TESTS_SOURCE = "NVIDIA/nccl-tests v2.19.6 (a0b82b2), src/alltoallv.cu"
MATRIX_FILE_VARIABLE = "NCCL_TESTS_ALLTOALLV_MATRIX_FILE"
MATRIX_SCALE_VARIABLE = "NCCL_TESTS_ALLTOALLV_MATRIX_SCALE"
ALIGN_BYTES = 16  # nccl-tests rounds every pair down to this many bytes
BINARY = "./build/alltoallv_perf"  # where nccl-tests' `make` puts it
DATATYPE = "uint8"  # one byte per element: counts are bytes
LAUNCHERS = ("mpirun", "srun")
# Reading back: 64 MiB holds ~2,800 ranks of 8-digit byte counts, beyond any pattern commbench builds
# (its world size divides a model's expert count); the whole text is split in memory.
MAX_MATRIX_FILE_BYTES = 64 << 20
_INT64_LIMIT = float(1 << 63)
# C's isspace() set and what strtod() reads as a decimal number; anything else (hex, inf, nan) is refused.
_NOT_NUMBER_TEXT = re.compile(r"[^0-9.eE+\- \t\n\r\v\f]")
_C_SPACE = " \t\r\v\f"


@dataclass(frozen=True)
class PhaseExport:
    """One phase's traffic-matrix file for alltoallv_perf and the command that replays it."""

    phase: str  # "dispatch" or "combine"
    path: Path  # absolute: every rank of the nccl-tests launch opens it
    matrix: np.ndarray  # int64 [src][dst]: the pattern's bytes, as written to the file
    moved: np.ndarray  # int64 [src][dst]: the bytes nccl-tests moves (each pair rounded down to 16 B)
    size_bytes: int  # -b = -e: the busiest rank's max(sent, received) of ``moved``, self included
    command: str

    def text(self) -> str:
        """The file's content."""
        return matrix_text(self.matrix)


def matrix_text(matrix: np.ndarray) -> str:
    """A [src][dst] byte matrix as alltoallv_perf reads it: one line per sending rank, values separated by
    one space, whole bytes."""
    buffer = io.StringIO()
    np.savetxt(buffer, np.asarray(matrix, dtype=np.int64), fmt="%d", delimiter=" ")
    return buffer.getvalue()


def parse_matrix_text(text: str, where: str) -> np.ndarray:
    """The values of a traffic-matrix file (float64 [rows, rows], as written: not yet rounded), checked as
    nccl-tests checks them; a one-line UsageError naming ``where`` and the place otherwise. Only decimal
    numbers are taken (nccl-tests' strtod also reads hex, inf and nan)."""
    bad = _NOT_NUMBER_TEXT.search(text)
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        raise UsageError(
            f"{where}: {shorten(bad.group())} on line {line} is not part of a number; the file holds "
            "whitespace-separated byte counts"
        )
    # nccl-tests ends a row at a newline after at least one value: blank lines are not rows.
    rows = [line.split() for line in text.split("\n")]
    rows = [row for row in rows if row]
    if not rows:
        raise UsageError(f"{where}: holds no values; write one line of byte counts per sending rank")
    widths = np.array([len(row) for row in rows])
    ragged = np.flatnonzero(widths != widths[0])
    if ragged.size:
        row = int(ragged[0])
        raise UsageError(
            f"{where}: row {row + 1} has {widths[row]} values, row 1 has {widths[0]}; every row needs one "
            "value per receiving rank"
        )
    if len(rows) != widths[0]:
        raise UsageError(
            f"{where}: {len(rows)} rows of {widths[0]} values; nccl-tests needs a square matrix (a row and "
            "a column per rank)"
        )
    tokens = [token for row in rows for token in row]
    try:
        values = np.array(tokens, dtype=np.float64)
    except ValueError:
        index = next(i for i, token in enumerate(tokens) if not _is_number(token))  # the error path only
        place = _place(index, len(rows))
        raise UsageError(f"{where}: {place} {shorten(tokens[index])} is not a number") from None
    for wrong, problem in ((values < 0, "is negative"), (~(values < _INT64_LIMIT), "is above 2^63 bytes")):
        if wrong.any():
            index = int(np.flatnonzero(wrong)[0])
            raise UsageError(f"{where}: {_place(index, len(rows))} {shorten(tokens[index])} {problem}")
    return values.reshape(len(rows), len(rows))


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _place(index: int, width: int) -> str:
    return f"row {index // width + 1}, value {index % width + 1}:"


def read_matrix_file(path: str | os.PathLike[str]) -> np.ndarray:
    """A traffic-matrix file's values (``parse_matrix_text``), read bounded (``MAX_MATRIX_FILE_BYTES``)."""
    where = f"nccl-tests matrix file {show_path(path)}"
    data = read_user_bytes(path, "nccl-tests matrix file", MAX_MATRIX_FILE_BYTES)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where}: byte 0x{data[exc.start]:02x} at offset {exc.start} is not text") from None
    return parse_matrix_text(text, where)


def moved_bytes(values: np.ndarray, world_size: int | None = None) -> np.ndarray:
    """int64 [src][dst]: what alltoallv_perf moves for a matrix of ``values`` on ``world_size`` ranks
    (default: all rows): the first world_size rows and columns, each cut to whole bytes and rounded down to
    a multiple of 16."""
    values = np.asarray(values)
    world = values.shape[0] if world_size is None else world_size
    if not 1 <= world <= values.shape[0]:
        raise UsageError(
            f"the matrix has {values.shape[0]} rows; nccl-tests refuses {world} ranks (it needs a row per "
            "rank)"
        )
    whole = np.floor(values[:world, :world]).astype(np.int64)
    return whole & ~np.int64(ALIGN_BYTES - 1)


def selected_size_bytes(moved: np.ndarray) -> int:
    """The busiest rank's max(bytes sent, bytes received), self included: alltoallv_perf's size column and
    the least ``-e`` it accepts."""
    return int(max(moved.sum(axis=1).max(), moved.sum(axis=0).max()))


def combine_path(path: str | os.PathLike[str]) -> Path:
    """The combine file beside ``path``: ``.combine`` before the suffix (m.txt -> m.combine.txt), or after
    the name when it has none (m -> m.combine)."""
    target = Path(path)
    return target.with_name(f"{target.stem}.combine{target.suffix}")


def check_export_paths(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The (dispatch, combine) files of ``path``, absolute; UsageError when either exists (a user's file is
    never overwritten) or its folder does not."""
    dispatch = Path(os.path.abspath(path))
    files = (dispatch, combine_path(dispatch))
    for target in files:
        if os.path.lexists(target):
            raise UsageError(
                f"--nccl-tests-matrix: {show_path(target)} already exists; pass a new file name (it is never "
                "overwritten)"
            )
        if not target.parent.is_dir():
            folder = show_path(target.parent)
            raise UsageError(f"--nccl-tests-matrix: folder {folder} does not exist; create it first")
    return files


def alltoallv_command(
    path: str | os.PathLike[str],
    world_size: int,
    size_bytes: int,
    iters: int | None = None,
    warmup: int | None = None,
    launcher: str = "mpirun",
) -> str:
    """The alltoallv_perf command line for a matrix file on ``world_size`` ranks, one process per GPU: -b =
    -e = ``size_bytes``, -d uint8, -g 1, -a 3 (time = max over ranks), -n/-w when given (else nccl-tests'
    defaults, 20 and 1). The file is passed through ``env`` so every rank gets it under mpirun and srun."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} not known; use one of {LAUNCHERS}")
    start = ["mpirun", "-np", str(world_size)] if launcher == "mpirun" else ["srun", "-n", str(world_size)]
    argv = [*start, "env", f"{MATRIX_FILE_VARIABLE}={os.path.abspath(path)}", BINARY]
    argv += ["-b", str(size_bytes), "-e", str(size_bytes), "-d", DATATYPE, "-g", "1", "-a", "3"]
    if iters is not None:
        argv += ["-n", str(iters)]
    if warmup is not None:
        argv += ["-w", str(warmup)]
    return shlex.join(argv)


def plan_export(
    pattern: Pattern, path: str | os.PathLike[str], iters: int | None = None, warmup: int | None = None
) -> list[PhaseExport]:
    """Dispatch (to ``path``) and combine (``combine_path``) of an MoE ``pattern`` as alltoallv_perf files
    and commands; nothing is written. UsageError for a balanced pattern, one rank, a phase that moves
    nothing nccl-tests can take, or paths ``check_export_paths`` refuses."""
    if pattern.send_mode == "balanced":
        raise UsageError(
            "--nccl-tests-matrix exports an MoE pattern; a balanced sweep is nccl-tests' own alltoall_perf "
            "(-b/-e/-f as --min-bytes/--max-bytes/--step-factor)"
        )
    world = pattern.world_size
    if world < 2:
        raise UsageError(
            "--nccl-tests-matrix needs at least 2 ranks: on one rank nothing crosses a link and nccl-tests' "
            "busbw is 0 by its (n-1)/n factor"
        )
    paths = check_export_paths(path)
    exports = []
    for phase, target in zip(("dispatch", "combine"), paths, strict=True):
        matrix = np.asarray(getattr(pattern, f"{phase}_bytes"), dtype=np.int64)
        moved = moved_bytes(matrix)
        size = selected_size_bytes(moved)
        if size == 0:
            # -b 0 never leaves nccl-tests' warm-up loop (it doubles the size from -b up to -e).
            raise UsageError(
                f"--nccl-tests-matrix: the {phase} phase moves no whole 16-byte unit between any two ranks; "
                "raise --tokens"
            )
        command = alltoallv_command(target, world, size, iters, warmup)
        exports.append(PhaseExport(phase, target, matrix, moved, size, command))
    return exports


def write_export(exports: Sequence[PhaseExport]) -> None:
    """Write every file atomically; UsageError, before anything is written, if one appeared since the plan."""
    for export in exports:
        if os.path.lexists(export.path):
            shown = show_path(export.path)
            raise UsageError(f"--nccl-tests-matrix: {shown} appeared meanwhile; it is not overwritten")
    for export in exports:
        write_atomic(export.path, export.text())


def remove_export(exports: Sequence[PhaseExport]) -> None:
    """Remove the files of ``exports`` (a run refused after they were written leaves nothing)."""
    for export in exports:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(export.path)


def export_summary(exports: Sequence[PhaseExport], timing_known: bool = False) -> str:
    """What was written, each phase's command, and how nccl-tests' figures relate to commbench's: rounding,
    size and busbw, time. ``timing_known``: the commands carry the run's -n/-w."""
    world = exports[0].moved.shape[0]
    lines = [f"nccl-tests alltoallv_perf files ({NCCL_TESTS_SOURCE}; format since v2.19.0):"]
    for export in exports:
        lines.append(
            f"  {export.phase}: {export.path} ({world} x {world} bytes, a row per sending rank; size "
            f"{export.size_bytes} B)"
        )
        lines.append(f"    {export.command}")
    lines.append("  notes:")
    for export in exports:
        lines.append(f"  - {export.phase}: {_rounding_text(export)}; {_busbw_text(export, world)}")
    iterations = (
        "-n/-w are this run's --iters/--warmup"
        if timing_known
        else "no -n/-w given: nccl-tests' defaults, 20 timed and 1 warm-up"
    )
    lines += [
        "  - size and algbw: nccl-tests' size column is the busiest rank's max(sent, received) of the bytes "
        "it moves, self included, as commbench's size(B); algbw = size / time in both.",
        f"  - time: one window of -n back-to-back calls, max over ranks with -a 3 ({iterations}); compare "
        "with commbench --timing window. commbench's dispatch time also holds its counts exchange.",
        "  - read the out-of-place columns (alltoallv_perf does not support in-place); -c 1 (default) checks "
        f"the data once. It allocates about 3 x size per GPU. Leave {MATRIX_SCALE_VARIABLE} unset.",
        f"  - launch: one process per GPU (nccl-tests built with MPI=1); under Slurm use srun -n {world} in "
        "place of mpirun -np; the file must be at the same path on every node.",
    ]
    return "\n".join(lines)


def _rounding_text(export: PhaseExport) -> str:
    lost = export.matrix - export.moved
    changed = int(np.count_nonzero(lost))
    if not changed:
        return "every pair is a multiple of 16 B: nccl-tests moves exactly the pattern's bytes"
    return (
        f"nccl-tests rounds each pair down to 16 B: {changed} of {lost.size} pairs lose up to "
        f"{int(lost.max())} B ({int(lost.sum())} of {int(export.matrix.sum())} B in all)"
    )


def _busbw_text(export: PhaseExport, world: int) -> str:
    """nccl-tests' busbw counts size x (n-1)/n; commbench's the bottleneck rank's link bytes (self
    excluded): the ratio of the two byte counts is the ratio of the two busbw at one time."""
    moved = export.moved
    diagonal = np.diag(moved)
    link_max = int(max((moved.sum(axis=1) - diagonal).max(), (moved.sum(axis=0) - diagonal).max()))
    nominal = export.size_bytes * (world - 1) / world
    ratio = f"{nominal / link_max:.3f} x commbench's" if link_max else "- (no link bytes)"
    return (
        f"busbw: nccl-tests' = size x (n-1)/n ({nominal:.0f} B), commbench's = the bottleneck rank's link "
        f"bytes, self excluded ({link_max} B): at one time nccl-tests' busbw = {ratio}"
    )

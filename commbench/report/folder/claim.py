"""Report-folder I/O that survives faults: the folder claimed exclusively, files replaced atomically, CSV rows
appended whole.

- Claim (``claim_out_dir``): a new folder is created with ``os.mkdir``; in it, or in an existing EMPTY folder,
  the marker ``.commbench-run`` is created with ``O_EXCL`` and holds the claim's token. Whoever creates the
  marker owns the folder, so two runs given the same ``--out`` can never both pass the emptiness check. The
  marker stays in the finished folder (a later claim finds it and refuses); ``OutDirClaim.release_if_unused``
  undoes a claim whose run wrote nothing.
- Atomic files (``write_atomic``): a temporary file in the same folder, written, fsynced, renamed over the
  target, then the folder fsynced: a reader sees the old file or the new one, never a part of one.
- Whole rows (``CsvAppender``): each batch of rows is built as text first and appended in one write of
  complete lines, then fsynced; a write that fails midway is cut back to the last whole row. The header and
  first rows, and a rewrite with a wider header, are atomic files.

A write that fails (a full disk, a file-size limit, permissions) raises ``ReportWriteError``, a UsageError
(exit 2: the run could not be recorded), one line naming the file; no temporary file is left behind and every
file already in the folder stays whole.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commbench.errors import UsageError

MARKER = ".commbench-run"
_MARKER_BYTES = 256  # a token line; more than this is not a marker commbench wrote
_FULL = (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC))


class ReportWriteError(UsageError):
    """A report file could not be written (disk full, file-size limit, permissions): exit 2."""


class OutDirTaken(UsageError):
    """The output folder holds files, or another run has claimed it."""


def report_write_error(path: Path, exc: OSError) -> ReportWriteError:
    """The one-line error for a failed write of ``path``: what the system said and what to do."""
    reason = exc.strerror or type(exc).__name__
    if exc.errno in _FULL:
        fix = "free disk space (or raise the file-size limit) and run again"
    else:
        fix = "check the folder's permissions and free space"
    return ReportWriteError(
        f"cannot write report file {str(path)!r}: {reason}; {fix} (the files already written are whole)"
    )


def _write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd`` (os.write may write less than asked when the disk fills up)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable; filesystems that cannot fsync a folder are let be."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace ``path`` with ``data`` (text as UTF-8) atomically; ReportWriteError if it cannot be written."""
    target = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as exc:  # a signal's exception too: never leave the temporary file behind
        _remove_quietly(tmp)
        if isinstance(exc, OSError):
            raise report_write_error(target, exc) from None
        raise
    _sync_folder(target.parent)


def csv_text(records: Sequence[dict[str, Any]], columns: Sequence[str], header: bool) -> str:
    """Complete CSV lines of ``records`` in ``columns`` order (missing values empty), the header first if
    asked."""
    import pandas as pd  # here: a rank that only unpickles the claim (in its LaunchPlan) needs no pandas

    frame = pd.DataFrame(list(records)).reindex(columns=list(columns))
    return frame.to_csv(header=header, index=False, lineterminator="\n")


class CsvAppender:
    """Appends records to a CSV, header once, whole rows only; rewrites the file (atomically) only when later
    records add columns. The in-memory state changes only after a write succeeded."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: list[str] = []
        self.records: list[dict[str, Any]] = []

    def continue_file(self) -> None:
        """Take up an existing file (``--resume``): its header and rows, as text, so that a later rewrite
        (new columns) writes the old rows back as they were."""
        if not self.path.exists():
            return
        with open(self.path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            self.records = [dict(row) for row in reader]
            self.columns = list(reader.fieldnames or [])

    def append(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        new_columns = [c for c in dict.fromkeys(k for r in records for k in r) if c not in self.columns]
        columns = self.columns + new_columns
        if not self.columns or new_columns:
            # The first rows, or a later phase that brought new columns (e.g. backend knobs): the whole file
            # with the (wider) header, atomically, so the file is always a valid CSV.
            write_atomic(self.path, csv_text(self.records + records, columns, header=True))
        else:
            self._append_whole(csv_text(records, columns, header=False).encode("utf-8"))
        self.columns = columns
        self.records.extend(records)

    def _append_whole(self, data: bytes) -> None:
        """One write of complete lines; on failure the file is cut back to the last whole row."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            raise report_write_error(self.path, exc) from None
        try:
            whole = os.fstat(fd).st_size
            try:
                _write_all(fd, data)
                os.fsync(fd)
            except BaseException as exc:
                try:
                    os.ftruncate(fd, whole)
                    os.fsync(fd)
                except OSError:
                    pass
                if isinstance(exc, OSError):
                    raise report_write_error(self.path, exc) from None
                raise
        finally:
            os.close(fd)


@dataclass(frozen=True)
class OutDirClaim:
    """A report folder this process owns: ``token`` is in its marker file; ``created``: the claim made it."""

    path: Path
    token: str
    created: bool
    parents: tuple[Path, ...] = ()  # the folders above it the claim made, deepest first

    def release_if_unused(self) -> bool:
        """Undo the claim when nothing but the marker was written (a launch that failed before rank 0 wrote
        meta.json): the marker removed, and the folder if the claim created it. True if released."""
        try:
            if os.listdir(self.path) != [MARKER] or claim_token(self.path) != self.token:
                return False
            os.unlink(self.path / MARKER)
            if self.created:
                os.rmdir(self.path)
                _remove_parents(self.parents)
        except OSError:
            return False
        return True


def claim_token(out_dir: str | os.PathLike[str]) -> str | None:
    """The token in ``out_dir``'s marker, or None without a readable marker."""
    try:
        fd = os.open(Path(out_dir) / MARKER, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        data = os.read(fd, _MARKER_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > _MARKER_BYTES:
        return None
    return data.decode("utf-8", errors="replace").strip() or None


def check_claim(out_dir: str | os.PathLike[str], token: str) -> Path:
    """``out_dir`` as claimed by this run (its marker holds ``token``); UsageError otherwise."""
    path = Path(out_dir)
    if claim_token(path) != token:
        raise OutDirTaken(
            f"output folder {str(path)!r} is no longer claimed by this run (its {MARKER} marker is missing "
            "or was replaced); pass a new --out folder"
        )
    return path


def take_over_out_dir(out_dir: str | os.PathLike[str]) -> OutDirClaim:
    """Claim the folder of an interrupted run for the run that resumes it (``--resume``): its marker gets
    this run's token (a rename: the last taker wins, and the run it replaced stops at its next write).
    UsageError for a folder commbench did not write."""
    path = Path(out_dir)
    if claim_token(path) is None:
        raise UsageError(f"{str(path)!r} has no {MARKER} marker: not a report folder commbench wrote")
    token = secrets.token_hex(16)
    write_atomic(path / MARKER, token + "\n")
    return OutDirClaim(path, token, created=False)


def claim_out_dir(out_dir: str | os.PathLike[str]) -> OutDirClaim:
    """Claim ``out_dir`` for one run: create it (parents too) or claim an existing empty folder by creating
    its marker exclusively. UsageError (nothing touched) if it is a file, holds anything, or another run
    claimed it first; OutDirTaken for the last two."""
    path = Path(out_dir)
    created = False
    parents = _missing_parents(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_parents(parents)
        raise UsageError(f"cannot create output folder {str(path)!r}: {exc.strerror or exc}") from None
    try:
        os.mkdir(path)
        created = True
    except FileExistsError:
        if not path.is_dir():
            raise UsageError(
                f"output path {str(path)!r} exists and is not a folder; pass a new --out folder"
            ) from None
    except OSError as exc:
        _remove_parents(parents)
        raise UsageError(f"cannot create output folder {str(path)!r}: {exc.strerror or exc}") from None
    token = secrets.token_hex(16)
    marker = path / MARKER
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        if _names(path) != [MARKER]:
            raise OutDirTaken(_not_empty(path)) from None
        raise OutDirTaken(
            f"output folder {str(path)!r} is claimed by another commbench run starting in it; pass a new "
            f"--out folder (if no run is using it, delete {str(marker)!r})"
        ) from None
    except OSError as exc:
        _undo(path, None, created, parents)
        raise UsageError(f"cannot write in output folder {str(path)!r}: {exc.strerror or exc}") from None
    try:
        try:
            _write_all(fd, f"{token}\n".encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        _undo(path, marker, created, parents)
        raise report_write_error(marker, exc) from None
    if [name for name in _names(path) if name != MARKER]:
        _undo(path, marker, created, parents)
        raise OutDirTaken(_not_empty(path))
    return OutDirClaim(path, token, created, parents)


def _not_empty(path: Path) -> str:
    return (
        f"output folder {str(path)!r} already exists and is not empty; pass a new --out folder "
        "(commbench never overwrites a report)"
    )


def _names(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _missing_parents(path: Path) -> tuple[Path, ...]:
    """The folders above ``path`` that do not exist yet, deepest first."""
    missing = []
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return tuple(missing)


def _remove_parents(parents: tuple[Path, ...]) -> None:
    """Remove the folders a claim made above its own, deepest first, while they are empty."""
    for parent in parents:
        try:
            os.rmdir(parent)
        except OSError:
            return


def _undo(path: Path, marker: Path | None, created: bool, parents: tuple[Path, ...] = ()) -> None:
    """Leave the folder as the failed claim found it."""
    if marker is not None:
        _remove_quietly(marker)
    if created:
        with contextlib.suppress(OSError):
            os.rmdir(path)
    _remove_parents(parents)

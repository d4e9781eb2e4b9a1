"""A stopped run's folder in which nothing finished: what the run wrote there removed and its claim released,
so that a stop before the first case leaves no report folder (``report.folder.writer.mark_incomplete`` is
the one end of a stopped run's folder; this is its "nothing to keep" branch)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from commbench.report.folder.claim import MARKER, OutDirClaim, claim_token
from commbench.report.folder.reading import EXTRA_APPENDED, EXTRA_WHOLE, KINETO_FOLDER
from commbench.report.judge.junit import JUNIT_FILE
from commbench.report.judge.pairs import PAIRS_FILE
from commbench.report.judge.verdict import VERDICT_FILE

# Everything a run writes in its folder (beside the marker): what a stop that finished nothing removes.
RUN_FILES = frozenset(
    {
        "meta.json", "results.csv", "ranks.csv", *EXTRA_APPENDED, *EXTRA_WHOLE, "results.parquet",
        "results.json", "summary.md", "report.html", VERDICT_FILE, JUNIT_FILE, "trace.json", KINETO_FOLDER,
    }
)  # fmt: skip


def nothing_finished(out_dir: str | os.PathLike[str]) -> bool:
    """No case of the run finished: results.csv and pairs.csv (the pairwise link test's rows, written as its
    rounds finish) hold no row (rows are appended whole: a row is a line after the header)."""
    for name in ("results.csv", PAIRS_FILE):
        try:
            with open(Path(out_dir) / name, "rb") as handle:
                lines = [line for line in handle.read().splitlines() if line.strip()]
        except FileNotFoundError:
            continue
        except OSError:
            return False  # unreadable: not known to be empty
        if len(lines) > 1:
            return False
    return True


def discard_unfinished(claim: OutDirClaim) -> bool:
    """A stopped run's folder in which nothing finished (``nothing_finished``): what the run wrote there
    (``RUN_FILES``: meta.json, headers, pages) removed and the claim released, so that no folder is left (an
    existing empty folder given with --out is left empty). True if discarded; False, with nothing removed,
    when something finished, the folder holds anything else, or it is no longer this claim's."""
    path = Path(claim.path)
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if claim_token(path) != claim.token or not set(names) <= RUN_FILES | {MARKER}:
        return False
    if not nothing_finished(path):
        return False
    for name in names:
        if name == MARKER:
            continue
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                target.unlink()
    return claim.release_if_unused()

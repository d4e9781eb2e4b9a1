"""A spawned rank that writes no report (every rank but 0) imports neither pandas nor matplotlib: only the
writer pays for them (a rank's start-up is most of a small run's wall time)."""

import sys
from typing import Any

from click.testing import CliRunner

from commbench.cli.main import cli
from commbench.run import dist

HEAVY = ("pandas", "matplotlib")


def heavy_modules_after(comm: Any, entry: Any, *args: Any) -> tuple[Any, list[list[str]]]:
    """The real rank entry, then every rank's heavy modules, gathered (rank 0's return value)."""
    result = entry(comm, *args)
    return result, comm.all_gather_object(sorted(name for name in HEAVY if name in sys.modules))


def test_a_rank_that_writes_no_report_imports_no_pandas_nor_matplotlib(tmp_path, monkeypatch) -> None:
    seen: dict[str, Any] = {}
    real_launch = dist.launch

    def probing(world_size: int, entry: Any, args: tuple, *rest: Any, **kwargs: Any) -> Any:
        result, seen["heavy"] = real_launch(world_size, heavy_modules_after, (entry, *args), *rest, **kwargs)
        return result

    monkeypatch.setattr(dist, "launch", probing)
    args = [
        "run", "--backend", "gloo", "--pattern", "balanced", "--min-bytes", "1K", "--max-bytes", "1K",
        "--iters", "1", "--warmup", "0", "--world-size", "2", "--out", str(tmp_path / "report"),
    ]  # fmt: skip
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 0, done.output
    writer, other = seen["heavy"]
    assert writer == ["matplotlib", "pandas"]  # rank 0 wrote the report: the probe sees what was imported
    assert other == []

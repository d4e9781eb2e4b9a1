"""A refused --out leaves no folder behind, not even the parents it would have been created under."""

from pathlib import Path

from click.testing import CliRunner

from commbench.cli.main import cli
from commbench.report import claim_out_dir


def test_an_out_name_too_long_leaves_none_of_its_new_parents(tmp_path: Path) -> None:
    out = tmp_path / "new" / "deeper" / ("x" * 300)  # a name over NAME_MAX (255): refused by mkdir
    result = CliRunner().invoke(cli, ["run", "--world-size", "2", "--pattern", "balanced", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "cannot create output folder" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_claim_released_unused_removes_the_parents_it_made(tmp_path: Path) -> None:
    (tmp_path / "kept").mkdir()
    claim = claim_out_dir(tmp_path / "kept" / "a" / "b" / "run")
    assert claim.release_if_unused()
    assert [path.name for path in tmp_path.iterdir()] == ["kept"] and not any((tmp_path / "kept").iterdir())

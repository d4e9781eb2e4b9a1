import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from commbench.cli.fabric import simulate, topo
from commbench.errors import UsageError

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_topo_on_this_machine():
    result = CliRunner().invoke(topo, [])
    assert result.exit_code == 0, result.output
    assert "GPUs:" in result.output and "NVLink domain(s) seen from here" in result.output
    if torch.cuda.device_count() == 0:
        assert "cannot be seen" in result.output


def test_topo_json():
    result = CliRunner().invoke(topo, ["--json"])
    assert result.exit_code == 0
    found = json.loads(result.output)
    assert {"host", "gpus", "nics", "libraries", "env", "notes", "nvlink_domains"} <= set(found)


def test_simulate_table():
    args = ["--model", "qwen3-30b-a3b", "--ranks", "8,16", "--tokens", "256", "--spec", "hgx-h100"]
    result = CliRunner().invoke(simulate, [*args, "--sample-tokens", "1024"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:5] == ["ranks", "EP", "groups", "domains", "phase"]
    assert "100.0%" in lines[1] and "NVLink" in lines[1]  # 8 ranks: one HGX server
    assert any("scale-out NIC" in line for line in lines[4:7])
    assert any(line.startswith("note: 16 ranks") and "spans 2 NVLink domains" in line for line in lines)


def test_simulate_json_and_fabric_options():
    args = ["--model", "qwen3-30b-a3b", "--ranks", "16", "--tokens", "128", "--spec", "hgx-h100", "--json"]
    result = CliRunner().invoke(simulate, [*args, "--fabric", "fat-tree", "--exact"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [r["phase"] for r in data["rows"]] == ["dispatch", "combine", "total"]
    assert data["rows"][0]["method"] == "exact" and "fat-tree" in data["notes"][0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ranks", "72,x"], "comma-separated"),
        (["--ranks", "300", "--tokens", "16"], "do not split into EP groups"),
        (["--spec", "nvl1000", "--ranks", "8", "--tokens", "16"], "unknown spec"),
    ],
)
def test_simulate_bad_input(args, message):
    result = CliRunner().invoke(simulate, args)
    assert isinstance(result.exception, UsageError) and message in str(result.exception)


def test_calibration_table_in_the_docs_is_current():
    result = CliRunner().invoke(simulate, ["--calibration"])
    assert result.exit_code == 0, result.output
    table, notes, sources = result.output.strip().split("\n\n")
    assert table in DOCS.joinpath("fabric-model.md").read_text(), (
        "regenerate: commbench simulate --calibration"
    )
    assert "| GB300 2 racks x 16 trays (!)" in table and "+262% |" in table
    assert notes.startswith("- (!) GB300 2 racks x 16 trays: not explained")
    assert sources.startswith("Sources: ") and "DeepEP README" in sources


def test_calibration_json_rows():
    result = CliRunner().invoke(simulate, ["--calibration", "--json", "--tokens", "256"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert len(rows) == 21 and all(row["source"] for row in rows)
    flagged = [row["case"] for row in rows if row["note"]]
    assert flagged == ["GB300 2 racks x 16 trays", "GB300 2 racks (128), 512 KiB"]

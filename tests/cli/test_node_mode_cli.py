"""``pattern`` and ``simulate`` with --send-mode node: each stage's bytes per link class, printed, JSON."""

import json

import numpy as np
from click.testing import CliRunner

from commbench.cli import cli

PATTERN = ["pattern", "--world-size", "8", "--tokens", "64", "--skew", "zipf:1.2", "--send-mode", "node"]


def test_pattern_prints_each_stage_per_link_class():
    result = CliRunner().invoke(cli, [*PATTERN, "--ranks-per-host", "2"])
    assert result.exit_code == 0, result.output
    assert "dispatch:scaleout" in result.output and "combine:nvlink" in result.output
    assert "node mode on 4 node(s) of 2 rank(s)" in result.output
    assert "NVLink domains of 4 x 2 ranks" in result.output


def test_pattern_json_link_classes_follow_the_stages():
    result = CliRunner().invoke(cli, [*PATTERN, "--ranks-per-domain", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    classes = data["link_class_bytes"]
    stages = {phase: {k: np.array(v) for k, v in parts.items()} for phase, parts in data["stages"].items()}
    for phase in ("dispatch", "combine"):
        scaleout, nvlink = classes[f"{phase}:scaleout"], classes[f"{phase}:nvlink"]
        assert scaleout["nvlink"] == 0 and scaleout["scaleout"] == int(stages[phase]["scaleout"].sum()) > 0
        assert nvlink["scaleout"] == 0 and nvlink["total"] == int(stages[phase]["nvlink"].sum())
        assert classes[phase]["scaleout"] == scaleout["scaleout"]
        assert np.array_equal(np.array(data[f"{phase}_bytes"]), sum(stages[phase].values()))
    token = json.loads(
        CliRunner().invoke(cli, [*PATTERN[:-1], "token", "--ranks-per-domain", "4", "--json"]).output
    )
    assert classes["dispatch"]["scaleout"] < token["link_class_bytes"]["dispatch"]["scaleout"]


def test_simulate_node_mode_json():
    args = ["simulate", "--model", "qwen3-30b-a3b", "--ranks", "16", "--spec", "hgx-h100", "--tokens", "256"]
    rows = {}
    for mode in ("token", "node"):
        result = CliRunner().invoke(cli, [*args, "--send-mode", mode, "--sample-tokens", "1024", "--json"])
        assert result.exit_code == 0, result.output
        rows[mode] = next(r for r in json.loads(result.output)["rows"] if r["phase"] == "dispatch")
    assert rows["node"]["scaleout_bytes_per_gpu"] < rows["token"]["scaleout_bytes_per_gpu"]

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from commbench.cli import cli
from commbench.cli.fabric import simulate, topo
from commbench.errors import UsageError
from commbench.fabric.rackfit import RACK_PARAMETERS, balanced_phase, pair_phase, predicted_times

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


def test_calibration_page_in_the_docs_is_current():
    result = CliRunner().invoke(simulate, ["--calibration"])
    assert result.exit_code == 0, result.output
    page = DOCS.joinpath("fabric-calibration.md").read_text()
    assert result.output.strip() in page, "regenerate: commbench simulate --calibration (see the page's head)"
    assert "## Accuracy per regime" in result.output and "| low_latency " in result.output
    assert "| GB300 2 racks x 16 trays (!)" in result.output
    assert "## Not modelled" in result.output and "no catalogue spec for GPU" in result.output


def test_calibration_json_rows():
    result = CliRunner().invoke(simulate, ["--calibration", "--json"])  # the rows of the page test, cached
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert len(rows) > 100 and all(row["source"] for row in rows)
    assert {row["regime"] for row in rows} == {
        "node_or_rack",
        "nccl_multinode",
        "ep_multinode",
        "low_latency",
    }
    assert any(row["untrusted"] for row in rows)  # listed with its reason, not dropped
    trusted = [row for row in rows if not row["untrusted"]]
    assert all(row["loso_error_pct"] == row["loso_error_pct"] for row in trusted)  # every one held out once
    flagged = [row["case"] for row in rows if row["note"]]
    assert flagged == ["GB300 2 racks x 16 trays", "GB300 2 racks (128), 512 KiB"]


# A CPU report folder of this host (4 gloo ranks, --ranks-per-domain 2: a balanced sweep and the pairwise
# test), whose times the synthetic tests replace with the model's own.
CPU_RACK = Path(__file__).resolve().parents[1] / "fabric" / "data" / "cpu-rack"
KNOWN = np.array([2.0, 8.0, 200.0, 50.0, 30.0])  # GB/s, GB/s, us, us, us: NVLink limits the large sizes


def _synthetic_folder(tmp_path, noise=0.02, pairs=True):
    import pandas as pd

    folder = tmp_path / "rack"
    shutil.copytree(CPU_RACK, folder)
    results = pd.read_csv(folder / "results.csv")
    phases = [balanced_phase("", 4, 2, float(size), 1.0) for size in results["size_bytes"]]
    frame = pd.read_csv(folder / "pairs.csv")
    chosen = frame["test"].isin(["latency", "bandwidth"]) & (frame["link_class"] != "self")
    for row in frame[chosen].itertuples():
        phases.append(pair_phase("", 4, row.src, row.dst, row.link_class == "scaleout", row.size_bytes, 1.0))
    rng = np.random.default_rng(7)
    times = predicted_times(phases, KNOWN, 2, 2) * 1e6 * np.exp(rng.normal(0, noise, len(phases)))
    results["time_us_p50"] = times[: len(results)]
    results.to_csv(folder / "results.csv", index=False)
    frame.loc[chosen, "time_us"] = times[len(results) :]
    frame.to_csv(folder / "pairs.csv", index=False)
    if not pairs:
        (folder / "pairs.csv").unlink()
    return folder


def test_calibrate_recovers_the_parameters_of_a_synthetic_folder(tmp_path):
    folder = _synthetic_folder(tmp_path)
    args = ["--calibrate", str(folder), "--ranks", "4,8", "--tokens", "64", "--model", "qwen3-30b-a3b"]
    result = CliRunner().invoke(simulate, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    fitted = data["parameters"]
    for name, true in zip(RACK_PARAMETERS, KNOWN, strict=True):
        value, sigma = fitted[name]["value"], fitted[name]["relative_sigma"]
        assert abs(np.log(value / true)) < max(4 * sigma, 0.03), (name, value, true, sigma)
    assert len(data["residuals"]) == 5 + 24  # 5 sweep sizes, 12 latency + 12 bandwidth pairs
    assert [row["ranks"] for row in data["prediction"]] == [4, 4, 8, 8]
    assert "CPU" in data["measured_on"] and "not a GPU fabric" in data["measured_on"]
    text = CliRunner().invoke(simulate, args).output
    assert "nvlink_GBps" in text and "16-84%" in text and "this host's CPU" in text


def test_calibrate_on_the_real_cpu_folder_labels_it_this_host():
    result = CliRunner().invoke(simulate, ["--calibrate", str(CPU_RACK), "--ranks", "4", "--tokens", "64"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("fit to 29 measured phases") and "not a GPU fabric" in result.output


def test_calibrate_reads_the_moe_phases_of_a_run_with_their_per_rank_bytes():
    # ranks.csv of a MoE run states no size: its rows match the result rows by case, phase and repeat.
    moe = CPU_RACK.parent / "cpu-moe"
    args = ["--calibrate", str(moe), "--calibrate", str(CPU_RACK), "--ranks", "4", "--tokens", "64", "--json"]
    result = CliRunner().invoke(simulate, args)
    assert result.exit_code == 0, result.output
    phases = [row["phase"] for row in json.loads(result.output)["residuals"]]
    assert phases[:2] == [
        "qwen3-30b-a3b uniform dispatch 3874816 B",
        "qwen3-30b-a3b uniform combine 3874816 B",
    ]
    assert len(phases) == 31


def test_calibrate_reads_the_sweep_and_the_moe_phases_of_one_suite_folder(tmp_path):
    # A suite writes both into one folder: ranks.csv states the sweep rows' sizes and not the MoE rows'.
    import pandas as pd

    suite = tmp_path / "suite"
    shutil.copytree(CPU_RACK, suite)
    moe = CPU_RACK.parent / "cpu-moe"
    for name in ("results.csv", "ranks.csv"):
        frames = [pd.read_csv(CPU_RACK / name), pd.read_csv(moe / name)]
        pd.concat(frames, ignore_index=True).to_csv(suite / name, index=False)
    result = CliRunner().invoke(
        simulate, ["--calibrate", str(suite), "--ranks", "4", "--tokens", "64", "--json"]
    )
    assert result.exit_code == 0, result.output
    phases = [row["phase"] for row in json.loads(result.output)["residuals"]]
    assert len(phases) == 31 and "qwen3-30b-a3b uniform combine 3874816 B" in phases


CPU_NODE = CPU_RACK.parent / "cpu-node"  # `run --world-size 8 --ranks-per-host 2 --send-mode node` here


def _node_stage_phases(folder):
    """The node-mode folder's stage rows as the fit must see them: per-rank bytes from ranks.csv, and a
    scale-out stage exchanging with one rank (of the same local index) on each of the 3 other nodes."""
    import pandas as pd

    from commbench.fabric.rackfit import MeasuredPhase

    results, ranks = pd.read_csv(folder / "results.csv"), pd.read_csv(folder / "ranks.csv")
    phases = []
    for row in results[results["phase"].str.contains(":")].itertuples():
        frame = ranks[ranks["phase"] == row.phase].sort_values("rank")
        loads = np.zeros((8, 2, 2))
        for c, name in enumerate(("nvlink", "scaleout")):
            loads[:, c, 0] = frame[f"{name}_sent_bytes"]
            loads[:, c, 1] = frame[f"{name}_recv_bytes"]
        peers = np.where(loads > 0, np.array([1, 3])[None, :, None], 0)  # 2 ranks per node, 4 nodes
        phases.append(MeasuredPhase(row.phase, loads, peers, 1.0))
    return results, phases


def test_calibrate_fits_the_two_stages_of_a_node_mode_run(tmp_path):
    # The model's own stage times (no noise) beside the synthetic sweep: the fit recovers them exactly
    # only if it reads each stage as its own phase with the right peers (3 scale-out peers, not 6), and
    # leaves out the phase rows that are the two stages in sequence.
    rack = _synthetic_folder(tmp_path, noise=0.0)
    node = tmp_path / "node"
    shutil.copytree(CPU_NODE, node)
    results, phases = _node_stage_phases(node)
    staged = results["phase"].str.contains(":")
    results.loc[staged, "time_us_p50"] = predicted_times(phases, KNOWN, 2, 2) * 1e6
    results.to_csv(node / "results.csv", index=False)
    args = ["--calibrate", str(node), "--calibrate", str(rack), "--ranks", "8", "--tokens", "64", "--json"]
    result = CliRunner().invoke(simulate, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    labels = [row["phase"].split()[2] for row in data["residuals"][:4]]
    assert labels == ["dispatch:scaleout", "dispatch:nvlink", "combine:nvlink", "combine:scaleout"]
    assert len(data["residuals"]) == 4 + 5 + 24
    assert max(abs(row["residual_pct"]) for row in data["residuals"]) < 0.5


def test_calibrate_refuses_a_node_mode_run_alone_naming_what_to_add():
    result = CliRunner().invoke(cli, ["simulate", "--calibrate", str(CPU_NODE), "--ranks", "8"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "4 distinct measured phase(s), fewer than the 5 parameters" in lines[0]
    assert "balanced sweep and the pairwise test" in lines[0] and "Warning" not in result.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (
            ["--calibrate", str(CPU_RACK), "--send-mode", "node"],
            "--send-mode does not apply with --calibrate",
        ),
        (["--calibrate", str(CPU_RACK), "--kernel", "normal"], "--kernel does not apply with --calibrate"),
        (["--calibration", "--spec", "hgx-h100"], "--spec does not apply with --calibration"),
        (["--calibration", "--calibrate", str(CPU_RACK)], "two modes; choose one"),
    ],
)
def test_an_option_the_calibration_modes_do_not_read_is_refused_not_ignored(args, named):
    result = CliRunner().invoke(cli, ["simulate", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], result.stderr


def test_calibrate_refuses_a_folder_that_cannot_constrain_a_parameter(tmp_path):
    folder = _synthetic_folder(tmp_path, noise=0.0, pairs=False)
    args = ["simulate", "--calibrate", str(folder), "--ranks", "4", "--tokens", "64"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot constrain" in lines[0], result.stderr
    assert any(name in lines[0] for name in RACK_PARAMETERS)

"""``commbench simulate --tflops``: the comm/compute budget of the modelled sizes."""

import json

import pytest
from click.testing import CliRunner

from commbench.cli.main import cli

SMALL = ["simulate", "--model", "qwen3-30b-a3b", "--ranks", "8,16", "--tokens", "256", "--spec", "hgx-h100"]
SMALL += ["--sample-tokens", "1024"]


def _budget_lines(output: str) -> list[str]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Can the all-to-all hide behind"))
    return lines[start + 1 :]


def test_simulate_prints_the_budget_after_its_table():
    result = CliRunner().invoke(cli, [*SMALL, "--tflops", "400"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].split()[:5] == ["ranks", "EP", "groups", "domains", "phase"]
    lines = _budget_lines(result.output)
    assert lines[0].split()[:3] == ["ranks", "busiest-rank", "selections"]
    rows = lines[1:7]  # 2 sizes x (--tflops, dense BF16 peak, dense FP8 peak)
    assert [row.split()[0] for row in rows] == ["8"] * 3 + ["16"] * 3
    first = rows[0].split()
    assert first[3] == "--tflops" and first[4] == "400"
    a2a, compute, forward_ratio, training_ratio = (float(v) for v in first[5:9])
    assert forward_ratio == pytest.approx(a2a / compute, abs=0.01)
    assert training_ratio == pytest.approx(2 * a2a / (3 * compute), abs=0.01)
    assert "dense BF16 peak" in rows[1] and " 989.5 " in rows[1] and "dense FP8 peak" in rows[2]
    assert lines[7].startswith("8 ranks: qwen3-30b-a3b at 400 TFLOPs/GPU, DualPipe-style overlap: training")
    assert lines[8].startswith("16 ranks: ")
    assert any(line.startswith("note: expert FLOPs (forward) = 2 x 3 x hidden") for line in lines)
    assert any("1,648" in line and "GB300 NVL72" in line for line in lines)


def test_default_tflops_is_the_record_and_json_carries_the_budget():
    result = CliRunner().invoke(cli, [*SMALL, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [b["ranks"] for b in data["budget"]] == [8, 16]
    first = data["budget"][0]
    assert first["rows"][0]["throughput"] == {"label": "--tflops (record, delivered)", "tflops": 1648.0}
    total = next(r["time_us"] for r in data["rows"] if r["ranks"] == 8 and r["phase"] == "total")
    assert first["comm_us"] == pytest.approx(total)
    assert first["selections"] >= 256 * 8  # the busiest rank: at least the mean, tokens x top-k
    assert "DualPipe-style overlap" in first["verdict"]


def test_a_model_without_moe_intermediate_says_not_computed(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nhidden: 1024\nnum_experts: 16\ntopk: 2\n")
    args = ["simulate", "--model", str(path), "--ranks", "8", "--tokens", "64", "--spec", "hgx-h100"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "8 ranks: mine: not computed: no moe_intermediate in model mine" in result.output


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "2e6"])
def test_bad_tflops_is_one_line_exit_2(value):
    result = CliRunner().invoke(cli, [*SMALL, "--tflops", value])
    assert result.exit_code == 2 and "--tflops" in result.output
    assert "Traceback" not in result.output

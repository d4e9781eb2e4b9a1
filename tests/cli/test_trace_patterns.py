"""Patterns from real training traces on the command line: a Kineto trace run and printed, --skew load:."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from commbench.cli import cli
from commbench.inputs.kineto import read_kineto
from commbench.report.judge.verdict import read_verdict_json
from commbench.run.config_meta import meta_values
from tests.launches import not_failed_by_data_or_completion

DATA = Path(__file__).resolve().parents[1] / "data"
NCCL, GLOO, LOADS = DATA / "kineto", DATA / "kineto-gloo", DATA / "expert_load.csv"
SIXTEEN = "name: sixteen\nhidden: 64\nnum_experts: 16\ntopk: 2\ndispatch_dtype: bf16\n"
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def commbench(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    command = [sys.executable, "-m", "commbench", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def gloo_run(trace: Path, out: Path, *extra: str) -> list[str]:
    return ["run", "--pattern", "kineto", "--kineto-trace", str(trace), "--world-size", "4",
            "--backend", "gloo", "--warmup", "1", "--iters", "3", "--out", str(out), *extra]  # fmt: skip


def test_a_kineto_trace_runs_verified_on_gloo_with_its_bytes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = commbench(gloo_run(NCCL, out), tmp_path)
    assert done.returncode in (0, 1), done.stderr  # 1: a busy host's straggler flagged (timing only)
    assert done.stdout.strip().splitlines()[-1].startswith("commbench verdict: ")
    not_failed_by_data_or_completion(read_verdict_json(out / "verdict.json"))
    trace = read_kineto(NCCL)
    results = pd.read_csv(out / "results.csv")
    assert results["phase"].tolist() == [call.name for call in trace.calls]
    assert (results["pattern"] == "kineto").all() and (results["wrong"] == 0).all()
    assert (results["backend"] == "gloo").all()
    for row, call in zip(results.to_dict("records"), trace.calls, strict=True):
        assert row["total_bytes"] == call.matrix.sum() and row["self_bytes"] == np.trace(call.matrix)
        assert row["max_send_bytes"] == call.matrix.sum(1).max()
        assert row["max_recv_bytes"] == call.matrix.sum(0).max()
    ranks = pd.read_csv(out / "ranks.csv")
    dispatch = ranks[ranks["phase"] == "call 1 all_to_allv"].sort_values("rank")
    assert dispatch["sent_bytes"].tolist() == [480, 416, 384, 512]  # the trace's in-splits x 32 B rows
    assert dispatch["recv_bytes"].tolist() == [320, 672, 288, 512]
    meta = json.loads((out / "meta.json").read_text())
    assert meta_values(meta)["pattern"] == "kineto" and meta_values(meta)["kineto_calls"] == 6
    assert meta_values(meta)["kineto_trace"] == str(NCCL) and meta_values(meta)["kineto_group"] == "0"


def one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commbench: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    base = ["run", "--world-size", "4", "--backend", "gloo", "--out", str(out)]
    runner = CliRunner()
    one_line_error(runner.invoke(cli, [*base, "--pattern", "kineto"]), "needs --kineto-trace PATH")
    one_line_error(runner.invoke(cli, [*base, "--kineto-trace", str(NCCL)]), "add --pattern kineto")
    wrong_world = ["run", "--world-size", "2", "--backend", "gloo", "--out", str(out)]
    one_line_error(
        runner.invoke(cli, [*wrong_world, "--pattern", "kineto", "--kineto-trace", str(NCCL)]),
        "has 4 ranks, this run 2",
        "--world-size 4",
    )
    broken = tmp_path / "broken.json"
    broken.write_text('{"traceEvents": [{"ph": "X", "name": "record_param_comms", "cat": "cpu_op", "args": ')
    one_line_error(
        runner.invoke(cli, [*base, "--pattern", "kineto", "--kineto-trace", str(broken)]),
        "broken.json",
        "JSON",
    )
    resume = [*base[:-2], "--pattern", "kineto", "--kineto-trace", str(NCCL), "--resume", str(tmp_path)]
    one_line_error(runner.invoke(cli, resume), "--resume")
    assert not out.exists()


def test_pattern_prints_the_trace_matrices() -> None:
    runner = CliRunner()
    args = ["pattern", "--pattern", "kineto", "--kineto-trace", str(GLOO), "--world-size", "4"]
    printed = runner.invoke(cli, [*args, "--json"])
    assert printed.exit_code == 0, printed.output
    data = json.loads(printed.stdout)
    trace = read_kineto(GLOO)
    assert data["world"] == 4 and data["read_from"] == "c10d::alltoall_base_"
    assert [call["bytes"] for call in data["calls"]] == [call.matrix.tolist() for call in trace.calls]
    assert [call["row_bytes"] for call in data["calls"]] == [8, 32, 32, 8, 32, 32]
    text = runner.invoke(cli, args)
    assert text.exit_code == 0 and "call 1 all_to_allv: bfloat16, 1792 B in rows of 32 B" in text.stdout
    assert "rank 3    0  288   64  160   512" in text.stdout
    one_line_error(runner.invoke(cli, [*args[:-1], "3"]), "give --world-size 4")


def busiest_expert(model: Path, skew: str) -> tuple[int, dict]:
    args = [
        "pattern",
        "--model",
        str(model),
        "--world-size",
        "4",
        "--tokens",
        "512",
        "--skew",
        skew,
        "--json",
    ]
    printed = CliRunner().invoke(cli, args)
    assert printed.exit_code == 0, printed.output
    data = json.loads(printed.stdout)
    return int(np.argmax(data["expert_load"])), data["stats"]


def test_skew_load_routes_by_the_layers_logged_load(tmp_path: Path) -> None:
    model = tmp_path / "sixteen.yaml"
    model.write_text(SIXTEEN)
    # The shipped table's busiest experts: 3 in layer 0, 11 in layer 1; each layer's pattern follows its own.
    assert busiest_expert(model, f"load:{LOADS}:0")[0] == 3
    busiest, stats = busiest_expert(model, f"load:{LOADS}:1")
    assert busiest == 11 and stats["hot_experts"][0] == 11
    out = tmp_path / "run"
    args = ["run", "--model", str(model), "--tokens", "512", "--skew", f"load:{LOADS}:1", "--world-size", "4"]
    done = commbench(
        [*args, "--backend", "gloo", "--warmup", "1", "--iters", "3", "--out", str(out)], tmp_path
    )
    assert done.returncode in (0, 1), done.stderr  # 1: a busy host's straggler flagged (timing only)
    results = pd.read_csv(out / "results.csv")
    assert results["phase"].tolist() == ["dispatch", "combine"] and (results["wrong"] == 0).all()
    # The run routed what `pattern` printed: the same expert-load imbalance.
    assert results["maxvio"].iloc[0] == pytest.approx(stats["expert_maxvio"])
    unknown = [*args[:-3], f"load:{LOADS}:7", "--world-size", "4", "--out", str(tmp_path / "no")]
    one_line_error(CliRunner().invoke(cli, unknown), "expert_load.csv", "no layer 7 (layers: 0, 1)")
    assert not (tmp_path / "no").exists()

"""--replicas on the command line: pattern prints the placement, run measures without and with replicas
in one launch (both verified), bad counts are refused before anything starts, and resume tells the two
cases apart."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from commbench.cli import cli
from commbench.cli.inputs import build_routing_config, moe_job, replica_cases
from commbench.cli.resume import remaining_jobs
from commbench.report.analysis.replicas import replicas_table
from commbench.report.judge.verdict import read_verdict_json
from commbench.run.case import model_digest
from commbench.run.config import MoeConfig, RunConfig
from commbench.run.config_meta import meta_values
from tests.launches import not_failed_by_data_or_completion

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COMMBENCH_DEBUG", raising=False)


def invoke(args: list[str]):
    return CliRunner().invoke(cli, args)


def assert_one_line_usage_error(result, fragment: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commbench: error: "), result.stderr
    assert fragment in lines[0] and "Traceback" not in result.output


def test_pattern_prints_the_placement_and_the_load_before_and_after() -> None:
    args = ["pattern", "--world-size", "8", "--tokens", "512", "--skew", "hot:8:0.3", "--replicas", "8"]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "EPLB replicas: 8 redundant experts, 264 slots on 8 ranks (33 per rank)" in out
    before, after = map(
        float, re.search(r"selections received\) max/mean: ([\d.]+) without -> ([\d.]+) with", out).groups()
    )
    assert before > 1.2 and after < before
    ranks = re.findall(r"^  rank (\d+): \d+: (.*)$", out, flags=re.MULTILINE)
    assert [int(rank) for rank, _ in ranks] == list(range(8))
    assert all(len(cells.split()) == 33 for _, cells in ranks)
    assert sum(cells.count("*") for _, cells in ranks) == 16  # 8 hot experts x 2 replicas
    assert "replicated experts (by load; 8 of 256)" in out


def test_pattern_json_carries_the_placement() -> None:
    args = ["pattern", "--world-size", "4", "--tokens", "256", "--skew", "zipf:1.2", "--replicas", "8"]
    result = invoke([*args, "--json"])
    assert result.exit_code == 0, result.output
    eplb = json.loads(result.output)["eplb_replicas"]
    assert eplb["replicas"] == 8 and eplb["slots_per_rank"] == 66
    assert len(eplb["expert_ranks"]) == 256 and all(eplb["expert_ranks"])
    assert sum(len(ranks) for ranks in eplb["expert_ranks"]) == 264
    assert [len(experts) for experts in eplb["rank_experts"]] == [66] * 4
    load = eplb["rank_load_max_mean"]
    assert load["with"] < load["without"]


def test_run_measures_without_and_with_replicas_both_verified(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["run", "--replicas", "8", "--world-size", "4", "--backend", "gloo", "--skew", "hot:8:0.3"]
    args += ["--tokens", "256", "--warmup", "1", "--iters", "5", "--out", str(out)]
    # A process of its own: rank 0, a spawned process, prints the progress lines.
    env = {key: value for key, value in os.environ.items() if key not in TORCHRUN_VARIABLES}
    command = [sys.executable, "-m", "commbench", *args]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr  # 1: a busy host's straggler flagged (timing only)
    assert "[1/4] deepseek-v3 hot:8:0.3 dispatch:" in done.stderr
    assert "[3/4] deepseek-v3 hot:8:0.3 dispatch [replicas=8]:" in done.stderr
    assert "commbench verdict: " in done.stdout
    not_failed_by_data_or_completion(read_verdict_json(out / "verdict.json"))
    results = pd.read_csv(out / "results.csv")
    assert len(results) == 4 and (results["wrong"] == 0).all()
    knobs = results["knobs"].fillna("").tolist()
    assert knobs == ["", "", "replicas=8", "replicas=8"]
    assert results["phase"].tolist() == ["dispatch", "combine", "dispatch", "combine"]
    # The dispatch bytes moved differ: replicas send tokens elsewhere.
    assert results["max_recv_bytes"][0] != results["max_recv_bytes"][2]
    assert meta_values(json.loads((out / "meta.json").read_text()))["replicas"] == 8
    table = replicas_table(results)
    table = None if table is None else table.text()
    assert table is not None and len(table.splitlines()) == 2
    cells = table.splitlines()[1].split()
    assert cells[:4] == ["deepseek-v3", "hot:8:0.3", "256", "8"]
    assert float(cells[5]) < float(cells[4])  # recv max/mean with < without


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--world-size", "4", "--replicas", "5", "--backend", "gloo"],
        ["suite", "--world-size", "4", "--replicas", "6", "--quick"],
        ["pattern", "--world-size", "8", "--replicas", "3"],
    ],
)
def test_a_count_that_does_not_split_over_the_ranks_is_refused(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "out"
    result = invoke([*args, "--tokens", "64", *([] if args[0] == "pattern" else ["--out", str(out)])])
    assert_one_line_usage_error(result, "slots do not split evenly over")
    assert not out.exists()


def test_resume_tells_the_case_with_replicas_from_the_one_without() -> None:
    inputs = MoeConfig("deepseek-v3", "hot:8:0.3", 64, replicas=4)
    config = RunConfig.from_options("run", {"world_size": 4, "backend": "gloo", "warmup": 1, "iters": 2})
    jobs = [moe_job(cfg, "token", config) for cfg in replica_cases(build_routing_config(inputs, 4))]
    assert [job.routing.replicas for job in jobs] == [0, 4]
    finished = pd.DataFrame(
        [
            {"pattern": "deepseek-v3", "repeat": 0, "skew": "hot:8:0.3", "phase": phase, "knobs": ""}
            for phase in ("dispatch", "combine")
        ]
    )
    left, _ = remaining_jobs(jobs, finished)
    assert [job.routing.replicas for job in left] == [4]
    left, _ = remaining_jobs(jobs, finished.assign(knobs="replicas=4"))
    assert [job.routing.replicas for job in left] == [0]
    # The same Case decides: another repeat, tokens per rank or model (digest) is not what finished.
    assert len(remaining_jobs(jobs, finished.assign(repeat=1))[0]) == 2
    assert len(remaining_jobs(jobs, finished.assign(tokens_per_rank=128))[0]) == 2
    assert len(remaining_jobs(jobs, finished.assign(model_digest="0123456789ab"))[0]) == 2
    digest = model_digest(jobs[0].routing.model)
    assert [
        job.routing.replicas for job in remaining_jobs(jobs, finished.assign(model_digest=digest))[0]
    ] == [4]

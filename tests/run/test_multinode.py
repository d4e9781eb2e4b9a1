"""Multi-node launches on one machine: two torchrun agents as two nodes, srun tasks emulated by hand; hosts
told apart by the launcher's node rank, so the all-to-all crosses "nodes" (scale-out bytes)."""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from commbench.hardware.probes import RankPlace, launcher_node, local_place
from commbench.inputs.layout import build_layout
from commbench.report.judge.verdict import read_verdict_json
from commbench.run.launch_env import derived_port
from tests.launches import not_failed_by_data_or_completion
from tests.run.processes import free_port, kill_marked, new_mark, run_env

# Launch variables of torchrun and Slurm that the test's own environment may carry: never passed on.
LAUNCH_PREFIXES = ("SLURM_", "MASTER_", "TORCHELASTIC_", "COMMBENCH_LAUNCH")
LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")
BALANCED = ["--pattern", "balanced", "--backend", "gloo", "--min-bytes", "1K", "--max-bytes", "64K"]
SHORT = ["--iters", "3", "--warmup", "1", "--timeout", "60"]
QUICK_SUITE = ["--quick", "--backend", "gloo", "--timeout", "60"]
WAIT_S = 90.0  # a guard for a hung launch; each test takes 10-25 s on a 2-core machine


def clean_env(tmp_path: Path, mark: str, **extra: str) -> dict[str, str]:
    """A child's environment: the test's, without any launcher's variables, one thread per rank."""
    env = {
        name: value
        for name, value in run_env(tmp_path, mark).items()
        if not name.startswith(LAUNCH_PREFIXES) and name not in LAUNCH_NAMES
    }
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def start(argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    with open(log, "w") as handle:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, *argv], env=env, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT
        )


def wait_all(processes: list[subprocess.Popen], logs: list[Path], mark: str) -> None:
    """Every process exits 0, or 1 where the verdict's timing checks flagged a busy host's straggler (else
    the failure shows each log's last lines; the report's data and completion are checked by the caller)."""
    try:
        codes = [process.wait(timeout=WAIT_S) for process in processes]
    except subprocess.TimeoutExpired:
        kill_marked(mark)
        codes = [process.wait() for process in processes]
    tails = "\n".join(f"--- {log.name}:\n" + "\n".join(log.read_text().splitlines()[-15:]) for log in logs)
    assert set(codes) <= {0, 1}, (codes, tails)


def check_two_node_report(out: Path, world_size: int) -> dict:
    """2 hosts (the same hostname on 2 nodes), every result row crossing them, data and completion PASS."""
    meta = json.loads((out / "meta.json").read_text())
    topology = meta["topology"]
    assert topology["num_hosts"] == 2 and topology["num_domains"] == 2, topology["description"]
    hostname = socket.gethostname()
    half = world_size // 2
    expected = [f"{hostname} (node 0)"] * half + [f"{hostname} (node 1)"] * half
    assert [place["host"] for place in topology["places"]] == expected
    assert [place["node"] for place in topology["places"]] == [0] * half + [1] * half
    with open(out / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows and all(int(row["scaleout_bytes"]) > 0 for row in rows)
    not_failed_by_data_or_completion(read_verdict_json(out / "verdict.json"))
    return meta


# ---------------------------------------------------------------------------------------------------------
# Hosts from the ranks' places (no processes)


def test_nodes_sharing_a_hostname_are_distinct_hosts():
    places = [RankPlace(host="box", node=n, pid=10 + i) for i, n in enumerate((0, 0, 1, 1))]
    layout = build_layout(4, discovered=places)
    assert (layout.num_hosts, layout.num_domains) == (2, 2)
    assert layout.host_of_rank.tolist() == [0, 0, 1, 1] and layout.domain_of_rank.tolist() == [0, 0, 1, 1]
    assert [p.host for p in layout.places] == ["box (node 0)"] * 2 + ["box (node 1)"] * 2
    # Read back from meta.json: the same layout, the names not suffixed twice.
    again = build_layout(4, discovered=layout.to_meta()["places"])
    assert again.host_of_rank.tolist() == [0, 0, 1, 1] and again.places == layout.places


def test_single_node_and_real_multi_node_layouts_do_not_change():
    for nodes in ((-1,) * 4, (0,) * 4):  # spawned, or one torchrun / srun node
        layout = build_layout(4, discovered=[RankPlace(host="box", node=n) for n in nodes])
        assert layout.num_hosts == 1 and [p.host for p in layout.places] == ["box"] * 4
    hosts = [RankPlace(host=h, node=n) for h, n in (("a", 0), ("a", 0), ("b", 1), ("b", 1))]
    assert [p.host for p in build_layout(4, discovered=hosts).places] == ["a", "a", "b", "b"]
    # An NVLink fabric clique spanning the nodes stays one domain.
    clique = {"fabric_cluster_uuid": "c0ffee00-0000-0000-0000-000000000000", "fabric_clique_id": 3}
    nvl = [RankPlace(host="box", node=n, **clique) for n in (0, 0, 1, 1)]
    layout = build_layout(4, discovered=nvl)
    assert (layout.num_hosts, layout.num_domains, layout.method) == (2, 1, "nvml-clique")


def test_old_meta_places_without_a_node_are_read():
    old = [{"host": "box", "gpu_uuid": "", "fabric_cluster_uuid": "", "fabric_clique_id": -1}] * 2
    layout = build_layout(2, discovered=old)
    assert layout.num_hosts == 1 and [p.node for p in layout.places] == [-1, -1]
    # A spawned run's meta.json records places as before; a launcher's node is recorded.
    assert "node" not in RankPlace(host="box").to_dict()
    assert RankPlace(host="box", node=0).to_dict()["node"] == 0


def test_local_place_carries_the_launchers_node(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "3")
    assert launcher_node() == 3 and local_place().node == 3
    monkeypatch.setenv("GROUP_RANK", "three")
    assert launcher_node() == -1
    monkeypatch.delenv("GROUP_RANK")
    assert local_place().node == -1


# ---------------------------------------------------------------------------------------------------------
# Real launches


def test_two_torchrun_agents_on_one_machine_are_two_nodes(tmp_path):
    mark, out, port = new_mark(), tmp_path / "report", free_port()
    env = clean_env(tmp_path, mark)
    processes, logs = [], []
    for node in (0, 1):
        argv = [
            "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "commbench", "run", *BALANCED, *SHORT, "--out", str(out),
        ]  # fmt: skip
        logs.append(tmp_path / f"node{node}.log")
        processes.append(start(argv, env, logs[-1], tmp_path))
    wait_all(processes, logs, mark)
    check_two_node_report(out, 4)


def slurm_job_with_a_free_port(attempts: int = 200) -> str:
    """A SLURM_JOB_ID whose derived MASTER_PORT (step 0) is free on this machine now."""
    for job in range(attempts):
        job_id = str(900000 + zlib.crc32(f"{os.getpid()}.{job}".encode()) % 99999)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", derived_port(job_id, "0")))
            except OSError:
                continue
        return job_id
    pytest.skip("no free port in the derived range")


def test_srun_tasks_on_two_emulated_nodes_run_the_suite(tmp_path):
    # What srun gives 4 tasks on 2 nodes (2 each): no torchrun variable, no MASTER_ADDR/PORT.
    mark, out, job = new_mark(), tmp_path / "report", slurm_job_with_a_free_port()
    slurm = {
        "SLURM_NTASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": job,
        "SLURM_STEP_ID": "0",
    }
    processes, logs = [], []
    for rank in range(4):
        task = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2)}
        env = clean_env(tmp_path, mark, **slurm, **task)
        logs.append(tmp_path / f"task{rank}.log")
        argv = ["-m", "commbench", "suite", *QUICK_SUITE, "--out", str(out)]
        processes.append(start(argv, env, logs[-1], tmp_path))
    wait_all(processes, logs, mark)
    meta = check_two_node_report(out, 4)
    assert meta["subcommand"] == "suite"
    assert "4 ranks" in logs[0].read_text()


def test_two_slurm_tasks_need_no_world_size(tmp_path):
    # The case: SLURM_PROCID and SLURM_NTASKS only (no step id: processes started by hand with
    # Slurm's task variables); one node, so the rendezvous is on this host.
    mark, out, port = new_mark(), tmp_path / "report", str(free_port())
    processes, logs = [], []
    for rank in range(2):
        env = clean_env(tmp_path, mark, SLURM_PROCID=str(rank), SLURM_NTASKS="2", MASTER_PORT=port)
        logs.append(tmp_path / f"task{rank}.log")
        argv = ["-m", "commbench", "run", *BALANCED, *SHORT, "--out", str(out)]
        processes.append(start(argv, env, logs[-1], tmp_path))
    wait_all(processes, logs, mark)
    text = logs[0].read_text()
    assert "--world-size is required" not in text and "2 ranks" in text
    not_failed_by_data_or_completion(read_verdict_json(out / "verdict.json"))
    assert json.loads((out / "meta.json").read_text())["topology"]["num_hosts"] == 1


def test_a_batch_script_without_world_size_says_why_it_waits_and_times_out(tmp_path):
    # Task 0 outside any srun step: it cannot tell the batch script from a hand-started rank 0, so it
    # says so at once and its rendezvous times out naming the missing rank (exit 4), leaving no folder.
    env = clean_env(tmp_path, new_mark(), SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_ID="5")
    argv = ["-m", "commbench", "run", *BALANCED, "--timeout", "5", "--out", str(tmp_path / "report")]
    result = subprocess.run(
        [sys.executable, *argv], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 4, result.stderr
    lines = result.stderr.splitlines()
    assert "without SLURM_STEP_ID: running as rank 0 of 2 Slurm tasks" in lines[0]
    assert "the batch script itself the other ranks never join" in lines[0]
    assert any("timed out" in line and "1/2 clients joined" in line for line in lines), result.stderr
    assert not (tmp_path / "report").exists()

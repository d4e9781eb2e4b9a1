"""--check end to end: ranks started as torchrun starts them, each a process that injects a transfer fault
below commbench (``tests.run.faults``) and then runs the CLI; a fault in a timed iteration exits 3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
from click.testing import CliRunner

from commbench.cli.main import cli
from commbench.cli.run import run, suite
from commbench.run.config import CHECK_MODES
from commbench.run.config_meta import meta_values
from commbench.run.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
# One 4 KiB balanced all-to-all (one 2 KiB row per rank pair), 1 warm-up + 5 timed iterations.
BALANCED = ["run", "--pattern", "balanced", "--min-bytes", "4K", "--max-bytes", "4K", "--warmup", "1"]
BALANCED += ["--iters", "5", "--timing", "iteration"]
MIDDLE = 3  # the 3rd of the 5 timed iterations, counted from the warm-up call

RANK_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
if {fault!r}:
    from tests.run.faults import install
    install({fault!r})
from commbench.cli.main import main
main({argv!r})
"""


def run_ranks(argv: list[str], fault: str | None = None) -> list[subprocess.CompletedProcess]:
    """``commbench <argv>`` on WORLD ranks started with torchrun's variables; each process first applies
    ``fault`` (``tests.run.faults.install``)."""
    port = free_port()
    processes = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        script = RANK_SCRIPT.format(root=str(ROOT), fault=fault or "", argv=argv)
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", script],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    finished = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        finished.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return finished


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("commbench: error:")]


def test_gloo_transfer_that_moves_nothing_after_its_first_call_exits_3(tmp_path):
    out = tmp_path / "stale"
    ranks = run_ranks([*BALANCED, "--backend", "gloo", "--timeout", "60", "--out", str(out)], "gloo:stale:0")
    assert [rank.returncode for rank in ranks] == [3, 3], [rank.stderr[-2000:] for rank in ranks]
    for rank in ranks:
        [line] = error_lines(rank)
        assert "data verification failed" in line and "in 5 of 5 timed iterations" in line
        assert "Traceback" not in rank.stderr
    results = pd.read_csv(out / "results.csv")
    assert results["check"].tolist() == ["checksum"] and (results["wrong"] > 0).all()
    assert meta_values(json.loads((out / "meta.json").read_text()))["check"] == "checksum"
    assert "DATA MISMATCH" in ranks[0].stdout and "# check: checksum" in ranks[0].stdout


def test_shmem_emu_puts_lost_in_one_middle_iteration_exit_3_with_check_every(tmp_path):
    out = tmp_path / "skip"
    argv = [*BALANCED, "--backend", "shmem-emu", "--check", "every", "--timeout", "60", "--out", str(out)]
    ranks = run_ranks(argv, f"shmem-emu:skip:{MIDDLE}:2")
    assert [rank.returncode for rank in ranks] == [3, 3], [rank.stderr[-2000:] for rank in ranks]
    assert all("in 1 of 5 timed iterations" in error_lines(rank)[0] for rank in ranks)
    results = pd.read_csv(out / "results.csv")
    assert results["check"].tolist() == ["every"] and (results["wrong"] > 0).all()


def test_gloo_byte_flipped_in_one_middle_iteration_exits_3(tmp_path):
    out = tmp_path / "flip"
    argv = [*BALANCED, "--backend", "gloo", "--timeout", "60", "--out", str(out)]
    ranks = run_ranks(argv, f"gloo:flip:{MIDDLE}")
    assert [rank.returncode for rank in ranks] == [3, 3], [rank.stderr[-2000:] for rank in ranks]
    # The flipped byte's whole row (2048 B) is counted: the checksum cannot say which byte.
    assert pd.read_csv(out / "results.csv")["wrong"].tolist() == [2048]


def test_clean_run_with_check_every_passes(tmp_path):
    out = tmp_path / "clean"
    argv = [*BALANCED, "--backend", "gloo", "--check", "every", "--timeout", "60", "--out", str(out)]
    ranks = run_ranks(argv)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr[-2000:] for rank in ranks]
    results = pd.read_csv(out / "results.csv")
    assert results["check"].tolist() == ["every"] and results["wrong"].tolist() == [0]
    assert "# Total #wrong         : 0" in ranks[0].stdout


def test_check_option_offers_the_harness_modes_and_refuses_others(tmp_path):
    for command in (run, suite):  # the one shared option, offering exactly the harness's modes
        [option] = [param for param in command.params if param.name == "check"]
        assert tuple(option.type.choices) == CHECK_MODES and option.default == "checksum"
    args = ["run", "--world-size", "2", "--backend", "mock", "--check", "all", "--out", str(tmp_path / "x")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "'all' is not one of 'checksum', 'every'" in result.output
    assert not (tmp_path / "x").exists()

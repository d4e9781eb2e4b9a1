"""benchmarks/gpu_check.py without a GPU: steps in their own processes, files written after every step."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
# A step's command writes its result where $GPU_CHECK_RESULT says, as gpu_check.py's child steps do.
WRITE = "import json, os; json.dump({body}, open(os.environ['GPU_CHECK_RESULT'], 'w'))"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def written(out: Path) -> tuple[dict, str, str]:
    summary = json.loads((out / "gpu_check.json").read_text())
    return summary, (out / "gpu_check.csv").read_text(), (out / "measurements.md").read_text()


def test_an_aborting_step_keeps_the_earlier_steps_figures(gpu_check, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    check = gpu_check.Check(out, tmp_path / "work")
    ceiling = WRITE.format(body="{'copy_GBps': 4321.5, 'bytes': 2147483648}")
    check.process_step("copy ceiling", python(ceiling), timeout_s=60)
    figures = "{'dispatch_us': 12.5, 'dispatch_wrong': 0, 'combine_us': 20.0, 'combine_wrong': 0}"
    nccl = WRITE.format(body=figures)
    check.process_step("nccl world 1", python(nccl), timeout_s=60)
    # What NVSHMEM does when its bootstrap fails: a message on stderr, then abort() (SIGABRT).
    abort = "import os, sys; print('nvshmem init failed: bootstrap', file=sys.stderr, flush=True); os.abort()"
    entry = check.process_step("nvshmem world 1", python(abort), timeout_s=60)
    assert entry["status"] == "FAIL" and entry["signal"] == "SIGABRT" and entry["exit_code"] < 0
    summary, table, section = written(out)  # as they are on disk right after the abort
    steps = {s["step"]: s for s in summary["steps"]}
    assert steps["copy ceiling"]["copy_GBps"] == 4321.5 and summary["copy_GBps"] == 4321.5
    assert steps["nccl world 1"]["status"] == "ok" and steps["nccl world 1"]["dispatch_us"] == 12.5
    failed = steps["nvshmem world 1"]
    assert failed["stderr_tail"][-1] == "nvshmem init failed: bootstrap"
    assert "killed by SIGABRT before writing a result; nvshmem init failed" in failed["error"]
    assert "4321.5 GB/s" in table and "dispatch 12.5 us #wrong 0" in table
    assert "| nvshmem world 1 | FAIL | killed by SIGABRT" in section
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.csv", "gpu_check.json", "measurements.md"]


def test_what_a_step_saved_before_it_died_is_kept(gpu_check, tmp_path) -> None:
    check = gpu_check.Check(tmp_path, tmp_path / "work")
    partial = WRITE.format(body="{'configs': [{'kernel_GBps': 3900.0}], 'status': 'FAIL'}")
    check.process_step("loopback put kernel", python(partial + "; import os; os.abort()"), timeout_s=60)
    step = written(tmp_path)[0]["steps"][0]
    assert step["configs"] == [{"kernel_GBps": 3900.0}]
    assert step["status"] == "FAIL" and step["error"].startswith("killed by SIGABRT")


def test_a_hung_step_is_killed_at_its_timeout_and_the_check_goes_on(gpu_check, tmp_path) -> None:
    check = gpu_check.Check(tmp_path, tmp_path / "work")
    hung = check.process_step("copy ceiling", python("import time; time.sleep(60)"), timeout_s=1)
    assert hung["status"] == "FAIL" and hung["signal"] == "SIGKILL" and "timed out after 1 s" in hung["error"]
    done = check.process_step("environment", python(WRITE.format(body="{'torch': '2.11.0'}")), timeout_s=60)
    assert done["status"] == "ok" and done["exit_code"] == 0
    assert [s["status"] for s in written(tmp_path)[0]["steps"]] == ["FAIL", "ok"]


def test_a_real_gpu_step_fails_cleanly_in_its_own_process_on_a_cpu(gpu_check, tmp_path) -> None:
    check = gpu_check.Check(tmp_path, tmp_path / "work")
    entry = check.isolated("copy ceiling", "copy ceiling", {"size_bytes": 1 << 20, "reps": 1}, timeout_s=120)
    assert entry["status"] == "FAIL" and entry["exit_code"] == 1 and "signal" not in entry
    assert entry["error"].startswith("exit 1; ") and "CUDA" in entry["error"]


def test_cli_step_and_outputs_stay_within_what_comes_back(gpu_check, tmp_path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    args = ["--model", "qwen3-30b-a3b", "--tokens", "16", "--warmup", "1", "--iters", "1"]
    args += ["--backend", "gloo"]
    result = gpu_check.cli_run(out, work, "gloo", args, timeout_s=120)
    assert result["status"] == "ok", result
    assert result["dispatch_wrong"] == 0 and result["combine_wrong"] == 0
    assert result["dispatch_us"] > 0
    assert (work / "gloo" / "results.json").is_file()
    assert "===== gloo" in (out / "cli_runs.log").read_text()
    slow = gpu_check.cli_run(out, work, "slow", args, timeout_s=0.2)
    assert slow["status"] == "FAIL" and "timed out" in slow["error"]

    check = gpu_check.Check(out, work)
    check.record({"step": "nccl world 1", **result})
    table, ok = gpu_check.write_outputs(check, out)
    assert not ok  # no loopback figures
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    # With gpu_check.sh's gpu_check.log: at most 8 files, all at the top of $OUT.
    assert files == ["cli_runs.log", "gpu_check.csv", "gpu_check.json", "measurements.md"]


def test_sigterm_to_the_check_records_the_running_step_and_stops(gpu_check, tmp_path) -> None:
    import os
    import signal
    import threading

    check = gpu_check.Check(tmp_path, tmp_path / "work")
    check.process_step("copy ceiling", python(WRITE.format(body="{'copy_GBps': 4000.0}")), timeout_s=60)
    previous = signal.signal(signal.SIGTERM, gpu_check._stop)  # as main() installs it
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))  # gpu_check.sh's overall limit
    try:
        timer.start()
        with pytest.raises(gpu_check.Stopped):
            check.process_step("nvshmem world 1", python("import time; time.sleep(60)"), timeout_s=60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    steps = written(tmp_path)[0]["steps"]
    assert [s["status"] for s in steps] == ["ok", "FAIL"] and steps[0]["copy_GBps"] == 4000.0
    assert steps[1]["error"].startswith("stopped by SIGTERM") and steps[1]["seconds"] < 30

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


def test_the_torchrun_suite_step_runs_commbench_suite_under_torchrun(gpu_check, tmp_path) -> None:
    """The step's own launcher (python -m torch.distributed.run --standalone --nproc-per-node 1 -m commbench
    suite --quick --no-pairwise), on gloo with the smallest sizes: figures, #wrong and the verdict kept."""
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    args = ["--backend", "gloo", "--max-bytes", "4096", "--tokens", "16"]
    result = gpu_check.cli_run(out, work, "suite", args, timeout_s=600, launcher=gpu_check.TORCHRUN_SUITE)
    assert result["status"] == "ok", result
    assert (
        "torch.distributed.run --standalone --nproc-per-node 1 -m commbench suite --quick"
        in result["command"]
    )
    assert result["verdict"] == "PASS" and result["findings"] == []
    assert result["wrong_total"] == 0 and result["rows"] >= 8  # 2 balanced sizes + 3 skews x 2 phases
    assert result["alltoall_max_bytes"] == 4096 and result["alltoall_max_busbw_GBps"] is not None
    assert "===== suite" in (out / "cli_runs.log").read_text()


def test_an_option_is_asked_of_the_cli_help_before_its_step_runs(gpu_check) -> None:
    assert gpu_check.listed_option("run", "--backend") == (True, "`commbench run --help` lists --backend")
    listed, note = gpu_check.listed_option("run", "--back")  # a prefix of a listed option is not it
    assert (
        not listed
        and note == "`commbench run --help` does not list --back (not in this checkout): step not run"
    )


def test_the_nvml_step_dumps_the_box_and_judges_it_with_commbench_s_readers(gpu_check, tmp_path, monkeypatch):
    """The step's function in this process over the fake NVML (tests/hardware/fake_nvml.py) as the H200
    test box shows itself: one GPU, its 18 NVLinks present and inactive, the fabric registration not
    started. nvml.json holds the dump and commbench's readings; without a spec nothing is a finding."""
    from tests.hardware.fake_nvml import NVML_GPU_FABRIC_STATE_NOT_STARTED, FakeGpu, FakeNvml

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    box = FakeNvml([FakeGpu(0, down=set(range(18)), fabric=(NVML_GPU_FABRIC_STATE_NOT_STARTED, 0, b"", 0))])
    monkeypatch.setitem(sys.modules, "pynvml", box)
    summary = gpu_check.nvml_snapshot(str(tmp_path / "nvml.json"))
    assert summary["status"] == "ok" and summary["findings"] == [] and summary["gpus"] == 1
    assert (summary["nvlink"], summary["fabric"]) == ("0 of 18 links active", "not started")
    assert summary["nvlink_counters_read"] == [
        "nvlink_crc_data",
        "nvlink_crc_flit",
        "nvlink_recovery",
        "nvlink_replay",
    ]
    dump = json.loads((tmp_path / "nvml.json").read_text())
    assert dump["gpus"][0]["links"]["0"]["active"] is False and dump["gpus"][0]["fabric_v"]["state"] == 1
    statuses = {e["name"]: e["status"] for e in dump["commbench"]["elements"]}
    assert (
        statuses["NVLink links: not checked"] == "SKIP" and statuses["NVLink fabric: not checked"] == "SKIP"
    )
    assert box.inits == 0


def test_the_nvml_step_on_a_machine_without_nvml_fails_with_the_reason(gpu_check, tmp_path) -> None:
    check = gpu_check.Check(tmp_path, tmp_path / "work")
    entry = check.isolated(gpu_check.NVML, "nvml", {"path": str(tmp_path / "nvml.json")}, timeout_s=120)
    assert entry["status"] == "FAIL" and entry["nvml"] is False, entry
    assert json.loads((tmp_path / "nvml.json").read_text())["error"].startswith("NVML unavailable")


class _Stubs:
    """Every step's outcome decided here: run_steps' order and its rules, with no process started."""

    def __init__(self, gpu_check, monkeypatch, compile_error: str | None, graph_listed: bool) -> None:
        self.ran: list[str] = []
        self.commands: dict[str, list[str]] = {}

        def isolated(check, name, step, kwargs, timeout_s, needs_s=10.0):
            self.ran.append(name)
            entry = {"step": name, "status": "ok", "seconds": 1.0}
            if name == gpu_check.COMPILE:
                entry["configs"] = kwargs["configs"]
                entry["wrong_total"] = 0
                if compile_error:
                    entry.update(status="FAIL", error=compile_error)
            if name == gpu_check.LOOP:
                entry["wrong_total"] = 0
            return check.record(entry)

        def cli_run(out, work, folder, args, timeout_s, launcher=gpu_check.RUN):
            self.ran.append(folder)
            self.commands[folder] = [*launcher, *args]
            return {"dispatch_us": 10.0, "dispatch_wrong": 0, "combine_us": 12.0, "combine_wrong": 0}

        monkeypatch.setattr(gpu_check.Check, "isolated", isolated)
        monkeypatch.setattr(gpu_check, "cli_run", cli_run)
        monkeypatch.setattr(
            gpu_check, "listed_option", lambda command, flag: (graph_listed, "not listed: note")
        )


def run_all(gpu_check, tmp_path, quick=False):
    import argparse

    check = gpu_check.Check(tmp_path, tmp_path / "work")
    args = argparse.Namespace(tokens=4096, loopback_tokens=16384, launches=50, quick=quick)
    gpu_check.run_steps(check, args)
    return check, {s["step"]: s for s in check.steps}


def test_every_step_runs_in_order_and_an_option_this_checkout_lacks_is_skipped_with_a_note(
    gpu_check, tmp_path, monkeypatch
) -> None:
    stubs = _Stubs(gpu_check, monkeypatch, compile_error=None, graph_listed=False)
    check, steps = run_all(gpu_check, tmp_path)
    assert [s["step"] for s in check.steps] == [*gpu_check.TABLE_STEPS, gpu_check.LOOP]
    assert stubs.ran == [
        "environment", "nvml dump", "copy ceiling", "nccl", "nccl_suite", "nvshmem set-up compile",
        "nvshmem", "nvshmem_wait", "nvshmem_set", "nvshmem_vdev2d", "loopback put kernel",
    ]  # fmt: skip
    assert steps[gpu_check.GRAPH]["status"] == "SKIP" and steps[gpu_check.GRAPH]["note"] == "not listed: note"
    suite = stubs.commands["nccl_suite"]
    assert suite[: len(gpu_check.TORCHRUN_SUITE)] == list(gpu_check.TORCHRUN_SUITE)
    assert suite[len(gpu_check.TORCHRUN_SUITE) :][:2] == ["--backend", "nccl"]
    assert stubs.commands["nvshmem_wait"][-2:] == ["--backend-option", "wait=nvshmem"]
    assert stubs.commands["nvshmem_set"][-2:] == ["--backend-option", "signal_op=set"]
    assert stubs.commands["nvshmem_vdev2d"].count("--model") == 1
    table, ok = gpu_check.write_outputs(check, tmp_path)
    assert ok and ["verification", "ok", "#wrong 0 in every step"] in table
    section = (tmp_path / "measurements.md").read_text()
    assert "| nvshmem --cuda-graph | SKIP | not listed: note |" in section


def test_a_listed_cuda_graph_option_runs_its_step(gpu_check, tmp_path, monkeypatch) -> None:
    stubs = _Stubs(gpu_check, monkeypatch, compile_error=None, graph_listed=True)
    _, steps = run_all(gpu_check, tmp_path, quick=True)
    assert steps[gpu_check.GRAPH]["status"] == "ok"
    assert stubs.commands["nvshmem_graph"][-2:] == list(gpu_check.CUDA_GRAPH)
    # A command the CLI accepts: nvshmem is captured only with counts on the device.
    assert stubs.commands["nvshmem_graph"][-4:-2] == ["--backend-option", "counts=device"]
    assert gpu_check.VDEV not in steps  # --quick


def test_a_set_up_compile_that_hung_skips_the_nvshmem_steps_and_one_that_failed_does_not(
    gpu_check, tmp_path, monkeypatch
) -> None:
    stubs = _Stubs(gpu_check, monkeypatch, compile_error="timed out after 90 s (killed)", graph_listed=True)
    check, steps = run_all(gpu_check, tmp_path / "hung")
    nvshmem_steps = (
        gpu_check.NVSHMEM,
        gpu_check.WAIT,
        gpu_check.SET,
        gpu_check.GRAPH,
        gpu_check.VDEV,
        gpu_check.LOOP,
    )
    assert all(steps[name]["status"] == "SKIP" for name in nvshmem_steps)
    assert steps[gpu_check.WAIT]["note"].startswith("not run: the set-up compile timed out after 90 s")
    assert stubs.ran[-1] == "nvshmem set-up compile"
    assert steps[gpu_check.NCCL]["status"] == "ok"  # what ran before keeps its figures
    _, ok = gpu_check.write_outputs(check, tmp_path / "hung")
    assert not ok

    stubs = _Stubs(gpu_check, monkeypatch, compile_error="exit 1; bitcode not found", graph_listed=True)
    _, steps = run_all(gpu_check, tmp_path / "failed")
    assert all(steps[name]["status"] == "ok" for name in nvshmem_steps)  # each records its own outcome


def test_a_verdict_fail_is_not_wrong_data(gpu_check, tmp_path) -> None:
    check = gpu_check.Check(tmp_path, tmp_path / "work")
    figures = {"dispatch_us": 10.0, "dispatch_wrong": 0, "combine_us": 12.0, "combine_wrong": 0}
    preflight = "FAIL preflight/GPUs per host: host h: 1 GPU(s) visible to NVML, hgx-h200 has 8 per host"
    check.record(
        {"step": gpu_check.NCCL, "status": "FAIL", **figures, "verdict": "FAIL", "findings": [preflight]}
    )
    check.record({"step": gpu_check.NVSHMEM, "status": "ok", **figures})
    check.record({"step": gpu_check.LOOP, "status": "ok", "wrong_total": 0})
    table, ok = gpu_check.write_outputs(check, tmp_path)
    assert ["verification", "ok", "#wrong 0 in every step"] in table and not ok
    nccl = next(row for row in table if row[0] == gpu_check.NCCL)
    assert nccl[2] == "dispatch 10.0 us #wrong 0; combine 12.0 us #wrong 0; verdict FAIL"
    check.record({"step": gpu_check.SET, "status": "FAIL", **figures, "combine_wrong": 3})
    table, _ = gpu_check.write_outputs(check, tmp_path)
    assert ["verification", "FAIL", "#wrong in nvshmem signal_op=set"] in table

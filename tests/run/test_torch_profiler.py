"""--torch-profiler's capture: a real torch.profiler trace of a gloo all-to-all (and, on a GPU, of a CUDA
kernel) lands in <out_dir>/kineto/rank<R>.json; a capture that cannot run never fails the benchmark."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from commbench.report.profiler.kernels import classify_kernel
from commbench.report.profiler.kineto_overlap import WINDOW_MEASURED, load_trace, overlap_from_folder
from commbench.run import torch_profiler
from commbench.run.torch_profiler import MEASURED_PREFIX, capture, measured, trace_path

REQUIRED_KEYS = ("name", "ph", "ts", "pid", "tid")


@pytest.fixture
def gloo_group():
    """A 1-rank gloo process group on an in-memory store (no port, no other process)."""
    if dist.is_initialized():
        pytest.skip("a default process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_capture_of_a_gloo_all_to_all_writes_a_loadable_chrome_trace(tmp_path, gloo_group):
    source = torch.arange(8, dtype=torch.float32)
    target = torch.empty(8)
    with capture(True, tmp_path, rank=0) as trace:
        assert trace is not None and not trace.written
        with measured("balanced alltoall"):
            dist.all_to_all_single(target, source, [8], [8])
    assert torch.equal(target, source)
    assert trace.written and trace.path == tmp_path / "kineto" / "rank0.json" == trace_path(tmp_path, 0)
    assert [path.name for path in (tmp_path / "kineto").iterdir()] == ["rank0.json"]  # no temporary left

    document = json.loads(trace.path.read_text(encoding="utf-8"))
    events = document["traceEvents"]
    assert events and all(all(key in event for key in REQUIRED_KEYS) for event in events)
    names = {event["name"] for event in events}
    assert MEASURED_PREFIX + "balanced alltoall" in names
    assert "c10d::alltoall_base_" in names  # the all-to-all itself, recorded by torch
    assert document["distributedInfo"]["rank"] == 0

    # The report side reads it: a measured window, and no GPU work on a CPU machine.
    assert load_trace(trace.path)["traceEvents"] == events
    row = overlap_from_folder(tmp_path / "kineto").ranks.iloc[0]
    assert row["rank"] == 0 and row["window"] == WINDOW_MEASURED
    if not torch.cuda.is_available():
        assert row["gpu_events"] == 0


def test_disabled_capture_records_and_writes_nothing(tmp_path):
    with capture(False, tmp_path, rank=0) as trace:
        assert trace is None
        assert measured("dispatch") is measured("combine")  # the shared no-op
        torch.ones(4).sum()
    assert not (tmp_path / "kineto").exists()


def test_no_folder_is_one_stderr_line_and_no_profiling(capsys):
    with capture(True, None, rank=3) as trace:
        assert trace is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--torch-profiler (rank 3)" in err and "no report folder" in err


def test_a_failed_export_is_one_stderr_line_not_an_error(tmp_path, capsys):
    blocker = tmp_path / "report"
    blocker.write_text("a file where the report folder should be", encoding="utf-8")
    with capture(True, blocker, rank=1) as trace:
        torch.ones(4).sum()
    assert trace is not None and not trace.written
    err = [line for line in capsys.readouterr().err.splitlines() if "--torch-profiler" in line]
    assert len(err) == 1 and "could not be written" in err[0] and "rank1.json" in err[0]
    assert blocker.read_text(encoding="utf-8").startswith("a file")


def test_a_profiler_that_does_not_start_leaves_the_run_unprofiled(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED\nsecond line")

    monkeypatch.setattr(torch.profiler, "profile", refuse)  # a Kineto/CUPTI start failure
    with capture(True, tmp_path, rank=0) as trace:
        assert trace is None
        assert measured("dispatch") is measured("combine")  # no marks without a profiler
        assert torch.ones(2).sum() == 2
    err = capsys.readouterr().err
    assert "did not start (RuntimeError: CUPTI_ERROR_NOT_INITIALIZED)" in err and "second line" not in err
    assert not (tmp_path / "kineto").exists()


def test_an_error_of_the_run_passes_through_and_the_next_capture_works(tmp_path):
    with pytest.raises(ValueError, match="the benchmark's own error"), capture(True, tmp_path, rank=0):
        raise ValueError("the benchmark's own error")
    assert not (tmp_path / "kineto" / "rank0.json").exists()
    assert torch_profiler._active is None
    with capture(True, tmp_path, rank=0) as trace:
        torch.ones(2).sum()
    assert trace is not None and trace.written


def test_one_capture_per_process(tmp_path, capsys):
    """Thread ranks share a process and torch allows one profiler: the second rank runs unprofiled."""
    with capture(True, tmp_path, rank=0) as first, capture(True, tmp_path, rank=1) as second:
        assert first is not None and second is None
    assert first.written and not (tmp_path / "kineto" / "rank1.json").exists()
    assert "(rank 1): another rank of this process" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU")
def test_a_cuda_kernel_is_captured_and_classified(tmp_path):
    data = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    with capture(True, tmp_path, rank=0) as trace:
        with measured("scale"):
            data.mul_(2.0)
        torch.cuda.synchronize()
    assert trace is not None and trace.written
    kernels = [event for event in load_trace(trace.path)["traceEvents"] if event.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the trace"
    assert any("elementwise" in event["name"] for event in kernels)
    assert all(classify_kernel(event["name"]) == ("other", "compute") for event in kernels)
    result = overlap_from_folder(tmp_path / "kineto")
    row = result.ranks.iloc[0]
    assert row["window"] == WINDOW_MEASURED and row["gpu_events"] >= 1 and row["gpus"] == 1
    assert row["compute_us"] > 0 and row["comm_us"] == 0
    assert set(result.kernels["kind"]) == {"compute"}

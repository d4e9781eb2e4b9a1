"""A GPU host whose torch cannot use its GPUs: named with the cause and the fix, refused before launch."""

from pathlib import Path

import pytest
from click.testing import CliRunner

from commbench.cli.main import cli
from commbench.hardware import cuda_use
from commbench.hardware.cuda_use import CudaUse, judge_cuda_use

EIGHT = {"nvml": True, "gpus": [{"index": i} for i in range(8)], "driver_version": "580.1"}


def test_a_cpu_wheel_on_a_gpu_host_is_named_with_the_driver_cuda():
    found = judge_cuda_use({**EIGHT, "cuda_driver_version": "13.0"}, [], 0, "2.13.0+cpu", None)
    assert found.unusable and found.gpus_seen == 8
    assert "8 GPU(s) on this host (driver 580.1)" in found.cause and "CPU build" in found.cause
    assert "CUDA 13.0" in found.fix


def test_a_cuda_torch_that_sees_no_gpu_says_what_torch_said():
    found = judge_cuda_use(EIGHT, [], 0, "2.11.0+cu130", "13.0", "CUDA driver version is insufficient")
    assert found.unusable and "built for CUDA 13.0" in found.cause and "insufficient" in found.cause


def test_device_files_count_when_nvml_cannot_be_loaded():
    found = judge_cuda_use({"nvml": False, "gpus": []}, ["/dev/nvidia0", "/dev/nvidia1"], 0, "2.13.0", None)
    assert found.unusable and found.gpus_seen == 2


@pytest.mark.parametrize(("gpus", "files", "devices"), [([], [], 0), (EIGHT["gpus"], [], 8)])
def test_a_cpu_host_or_a_working_gpu_host_is_fine(gpus, files, devices):
    assert not judge_cuda_use({"gpus": gpus}, files, devices, "2.13.0", "13.0").unusable


def test_run_and_suite_refuse_a_cpu_run_on_such_a_host_unless_allow_cpu(monkeypatch, tmp_path: Path):
    bad = CudaUse(8, 0, "8 GPU(s) on this host, but torch 2.13.0+cpu is a CPU build (no CUDA)", "install it")
    monkeypatch.setattr(cuda_use, "cuda_use", lambda: bad)
    for command in (["run"], ["suite", "--quick"]):
        args = [*command, "--world-size", "2", "--backend", "gloo", "--out", str(tmp_path / "r")]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2, result.output
        assert "CPU build" in result.stderr and "--allow-cpu" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
        # With --allow-cpu the check is passed: the next check (a knob gloo does not have) answers instead.
        result = CliRunner().invoke(cli, [*args, "--allow-cpu", "--backend-option", "nonsense=1"])
        assert result.exit_code == 2 and "nonsense" in result.stderr and "CPU build" not in result.stderr

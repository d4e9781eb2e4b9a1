"""Environment capture works on a CPU machine and is JSON-serializable."""

from __future__ import annotations

import json
import sys

from commbench.hardware.environment import capture_environment, communication_env_vars


def test_capture_environment_on_cpu(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1G")
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("UNRELATED_SECRET_THING", "x")
    env = capture_environment()
    json.dumps(env)  # must serialize as is
    assert env["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["versions"]["torch"] and env["versions"]["commbench"]
    assert env["env_vars"]["NCCL_DEBUG"] == "INFO"
    assert env["env_vars"]["NVSHMEM_SYMMETRIC_SIZE"] == "1G"
    assert env["env_vars"]["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert "CUDA_VISIBLE_DEVICES" in env["env_vars"]
    assert "UNRELATED_SECRET_THING" not in env["env_vars"]
    assert env["argv"] == sys.argv
    assert env["hostname"]
    assert env["time_utc"].endswith("+00:00")
    assert isinstance(env["devices"], list)


def test_communication_env_vars_filters_and_sorts() -> None:
    picked = communication_env_vars({"PATH": "/bin", "NCCL_B": "2", "NCCL_A": "1", "NCCLX": "no"})
    assert list(picked) == ["NCCL_A", "NCCL_B"]


def test_nvml_section_from_the_probe(install_nvml) -> None:
    install_nvml(gpus=2, links={0: 1, 1: 1, 2: 1, 3: 0})
    assert capture_environment()["nvml"] == {
        "driver_version": "580.82.07",
        "gpus": [
            {"index": 0, "name": "NVIDIA GB300", "nvlink_active_links": 3},
            {"index": 1, "name": "NVIDIA GB300", "nvlink_active_links": 3},
        ],
    }
    install_nvml(absent=True)  # no driver: not an error for a report
    assert capture_environment()["nvml"] is None

"""Environment capture for reports: versions, devices, host, communication env vars, command line, time.

Everything here must work on a CPU-only machine: each probe that can fail (CUDA, NCCL, NVML) is guarded and
records ``None`` or an error string instead of raising.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import socket
import sys
from collections.abc import Mapping
from typing import Any

import commbench
from commbench.hardware.probes import nccl_version, probe_env, probe_gpus

# Environment variables that change communication behaviour; recorded so two reports can be compared.
REPORT_ENV_PREFIXES: tuple[str, ...] = ("NCCL_", "NVSHMEM_", "TORCH_NCCL_", "CUDA_VISIBLE_DEVICES")


def communication_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """NCCL_*, NVSHMEM_*, TORCH_NCCL_* and CUDA_VISIBLE_DEVICES, sorted by name."""
    return probe_env(environ, REPORT_ENV_PREFIXES)


def _torch_versions() -> dict[str, Any]:
    versions: dict[str, Any] = {"torch": None, "cuda": None, "nccl": None}
    try:
        import torch
    except Exception as exc:  # torch is a dependency, but a report must still be written without it
        versions["torch"] = f"unavailable ({type(exc).__name__})"
        return versions
    versions["torch"] = torch.__version__
    versions["cuda"] = torch.version.cuda  # None on CPU builds
    if torch.version.cuda is not None:
        versions["nccl"] = nccl_version()
    return versions


def _cuda_devices() -> list[dict[str, Any]]:
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:
        return []
    devices = []
    for index in range(count):
        try:
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_bytes": int(props.total_memory),
                    "compute_capability": f"{props.major}.{props.minor}",
                    "multiprocessors": int(props.multi_processor_count),
                }
            )
        except Exception as exc:
            devices.append({"index": index, "error": f"{type(exc).__name__}: {exc}"})
    return devices


def nvml_summary() -> dict[str, Any] | None:
    """Driver version and each GPU's active NVLink links, from the NVML probe; None when NVML cannot start
    (no driver: a CPU machine, not an error for a report)."""
    found = probe_gpus()
    if not found["nvml"]:
        return None
    summary: dict[str, Any] = {}
    if "driver_version" in found:
        summary["driver_version"] = found["driver_version"]
    summary["gpus"] = [
        {
            "index": gpu["index"],
            "name": gpu.get("name"),
            "nvlink_active_links": gpu.get("nvlink_links_active", 0),
        }
        for gpu in found["gpus"]
    ]
    if "error" in found:
        summary["error"] = found["error"]
    return summary


def capture_environment() -> dict[str, Any]:
    """A JSON-serializable description of where and how a run happened; never raises on a CPU machine."""
    versions = {
        "python": platform.python_version(),
        "commbench": commbench.__version__,
        **_torch_versions(),
    }
    return {
        "versions": versions,
        "devices": _cuda_devices(),
        "nvml": nvml_summary(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "env_vars": communication_env_vars(),
        "argv": list(sys.argv),
        "command": shlex.join(sys.argv),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }

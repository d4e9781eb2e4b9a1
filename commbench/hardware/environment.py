"""Environment capture for reports: versions, devices, host, communication env vars, command line, time.

Everything here must work on a CPU-only machine: each probe that can fail (CUDA, NCCL, NVML) is guarded and
records ``None`` or an error string instead of raising.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import shlex
import socket
import sys
from typing import Any

import commbench

# Environment variables that change communication behaviour; recorded so two reports can be compared.
ENV_VAR_PREFIXES: tuple[str, ...] = ("NCCL_", "NVSHMEM_", "TORCH_NCCL_")
ENV_VAR_NAMES: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)


def communication_env_vars(environ: dict[str, str] | None = None) -> dict[str, str]:
    """NCCL_*, NVSHMEM_*, TORCH_NCCL_* and CUDA_VISIBLE_DEVICES, sorted by name."""
    environ = dict(os.environ if environ is None else environ)
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(ENV_VAR_PREFIXES) or name in ENV_VAR_NAMES
    }


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
        try:
            nccl = torch.cuda.nccl.version()
            versions["nccl"] = ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception:  # CUDA build without NCCL, or no driver
            versions["nccl"] = None
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


def _nvml_info() -> dict[str, Any] | None:
    """Driver version and per-GPU NVLink state from NVML, only if pynvml imports and initializes."""
    try:
        import pynvml
    except Exception:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver (CPU machine): not an error for a report
        return None
    info: dict[str, Any] = {}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver_version"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            gpu: dict[str, Any] = {"index": index, "name": name.decode() if isinstance(name, bytes) else name}
            active_links = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                        active_links += 1
                except Exception:  # link index not present on this GPU
                    break
            gpu["nvlink_active_links"] = active_links
            gpus.append(gpu)
        info["gpus"] = gpus
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return info


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
        "nvml": _nvml_info(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "env_vars": communication_env_vars(),
        "argv": list(sys.argv),
        "command": shlex.join(sys.argv),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }

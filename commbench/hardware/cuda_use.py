"""Whether torch can use the GPUs this host shows: a GPU host whose torch sees no CUDA device (a CPU wheel, a
driver that does not fit the CUDA torch was built for, a broken driver) must not pass a CPU run as its
acceptance test."""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CudaUse:
    """What the host shows against what torch can use: ``gpus_seen`` by NVML or the driver's device files,
    ``cuda_devices`` torch counts, and when they disagree the ``cause`` and the ``fix`` in words."""

    gpus_seen: int
    cuda_devices: int
    cause: str = ""
    fix: str = ""

    @property
    def unusable(self) -> bool:
        """GPUs are there and torch has none of them."""
        return self.gpus_seen > 0 and self.cuda_devices == 0


def device_files(pattern: str = "/dev/nvidia[0-9]*") -> list[str]:
    """The driver's per-GPU device files (/dev/nvidia0, ...): present even when NVML cannot be loaded."""
    return sorted(glob.glob(pattern))


def judge_cuda_use(
    probe: Mapping[str, Any],
    files: Sequence[str],
    cuda_devices: int,
    torch_version: str,
    torch_cuda: str | None,
    init_error: str = "",
) -> CudaUse:
    """The host's GPUs (``probe``: ``hardware.probes.probe_gpus()``; ``files``: ``device_files()``) against
    torch's ``cuda_devices``; ``torch_cuda`` is ``torch.version.cuda`` (None: a CPU build) and
    ``init_error`` what ``torch.cuda.init()`` said, if anything."""
    seen = max(len(probe.get("gpus") or []), len(files))
    if seen == 0 or cuda_devices > 0:
        return CudaUse(seen, cuda_devices)
    where = f"{seen} GPU(s) on this host" + (
        f" (driver {probe['driver_version']})" if probe.get("driver_version") else ""
    )
    driver_cuda = probe.get("cuda_driver_version")
    if torch_cuda is None:
        cause = f"{where}, but torch {torch_version} is a CPU build (no CUDA)"
        fix = "install a CUDA build of torch" + (f" for CUDA {driver_cuda} or older" if driver_cuda else "")
    else:
        said = f": {init_error}" if init_error else ""
        cause = f"{where}, but torch {torch_version} (built for CUDA {torch_cuda}) sees none of them{said}"
        fix = (
            f"the driver supports CUDA {driver_cuda}: install a torch built for it or older, or update the "
            "driver"
            if driver_cuda
            else "check the driver (nvidia-smi) and that CUDA_VISIBLE_DEVICES names the GPUs"
        )
    return CudaUse(seen, cuda_devices, cause, fix)


def cuda_use() -> CudaUse:
    """This host's GPUs against what the imported torch can use."""
    import torch

    from commbench.hardware.probes import probe_gpus

    devices = torch.cuda.device_count()
    init_error = ""
    if devices == 0 and torch.version.cuda is not None:
        try:
            torch.cuda.init()
        except Exception as exc:  # the reason torch has no device: the one line the user needs
            init_error = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:200]
    return judge_cuda_use(
        probe_gpus(), device_files(), devices, torch.__version__, torch.version.cuda, init_error
    )

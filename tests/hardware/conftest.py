"""A stand-in ``pynvml`` module (tests/hardware/fake_nvml.py's, on the real binding's constants, errors and
structs), so the NVML probes are tested the same way on CPU and GPU machines."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from tests.hardware.fake_nvml import (
    CLUSTER,
    NVLINK5_LINK_MBPS,
    FakeGpu,
    FakeNvml,
    gpu_uuid,
    nvml_bus_id,
)

__all__ = ["CLUSTER", "cuda_props", "gpu_uuid", "nvml_bus_id", "rack_nvml"]


def rack_nvml(
    gpus: int = 2,
    links: dict[int, int] | None = None,
    uuid: bytes = CLUSTER,
    clique: int = 42,
    state: int = 3,
    status: int = 0,
    fabric: bool = True,
) -> FakeNvml:
    """``gpus`` GB300 GPUs (fake_nvml's FakeNvml, NVLink 5) with NVLink states ``links`` (link -> 1 active,
    0 inactive; links 0..max present, none: no NVLink at all) and one fabric registration for all (state,
    status, cluster uuid, clique id; ``fabric=False``: the fabric calls are not supported)."""
    states = {0: 1, 1: 1, 2: 0} if links is None else links
    count = max(states) + 1 if states else 0
    down = {link for link, active in states.items() if not active}
    registration = (state, status, uuid, clique) if fabric else None
    return FakeNvml(
        [
            FakeGpu(i, links=count, down=down, nvlink=5, speed_MBps=NVLINK5_LINK_MBPS, name="NVIDIA GB300",
                    fabric=registration)
            for i in range(gpus)
        ]
    )  # fmt: skip


@pytest.fixture
def install_nvml(monkeypatch):
    """``install_nvml(**rack_nvml options)``: ``import pynvml`` gives that FakeNvml (and returns it).
    ``install_nvml(absent=True)``: the import fails, as on a machine without the NVIDIA driver."""

    def install(absent: bool = False, **options: Any) -> FakeNvml | None:
        nvml = None if absent else rack_nvml(**options)
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        return nvml

    return install


@pytest.fixture
def install_cuda(monkeypatch):
    """``install_cuda({ordinal: props})``: torch.cuda.get_device_properties answers with these device
    properties (SimpleNamespace with the attributes torch has), and raises for any other ordinal, as a CPU
    build does for all."""
    import torch

    def install(devices: dict[int, Any]) -> None:
        def properties(ordinal: int) -> Any:
            if ordinal not in devices:
                raise AssertionError("Torch not compiled with CUDA enabled")
            return devices[ordinal]

        monkeypatch.setattr(torch.cuda, "get_device_properties", properties)

    return install


def cuda_props(index: int, uuid: str | None = "bare", pci: bool = True, name: str = "NVIDIA H200") -> Any:
    """torch's properties of the CUDA device that is fake NVML GPU ``index``: ``uuid`` "bare" (torch's own
    spelling, no "GPU-"), "prefixed", None (an older torch without the attribute) or a literal value."""
    props = SimpleNamespace(name=name)
    if uuid is not None:
        text = gpu_uuid(index)
        props.uuid = {"bare": text[4:], "prefixed": text}.get(uuid, uuid)
    if pci:
        props.pci_domain_id, props.pci_bus_id, props.pci_device_id = 0, 0x19 + 0x10 * index, 0
    return props

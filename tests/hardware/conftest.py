"""A stand-in ``pynvml`` module, so the NVML probe is tested the same way on CPU and GPU machines."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

CLUSTER = bytes(range(1, 17))  # the fabric cluster UUID every fake GPU reports


def gpu_uuid(index: int) -> str:
    """NVML's UUID of fake GPU ``index`` ("GPU-00000003-1111-2222-3333-000000000003")."""
    return f"GPU-{index:08x}-1111-2222-3333-{index:012x}"


def nvml_bus_id(index: int) -> str:
    """NVML's PCI bus id of fake GPU ``index``: 8-digit domain, upper-case hex ("00000000:49:00.0")."""
    return f"00000000:{0x19 + 0x10 * index:02X}:00.0"


class FakeNvml:
    """Just enough of pynvml for ``commbench.hardware.probes.probe_gpus``: ``gpus`` GPUs with NVLink states
    ``links`` (link -> 1 active, 0 inactive; absent links raise) and one fabric registration for all."""

    NVML_NVLINK_MAX_LINKS = 18

    def __init__(
        self,
        gpus: int = 2,
        links: dict[int, int] | None = None,
        uuid: bytes = CLUSTER,
        clique: int = 42,
        state: int = 3,
        status: int = 0,
        fabric_error: Exception | None = None,
    ) -> None:
        self._gpus = gpus
        self._links = {0: 1, 1: 1, 2: 0} if links is None else links
        self._fabric = SimpleNamespace(
            clusterUuid=uuid.ljust(16, b"\0"), cliqueId=clique, state=state, status=status
        )
        self._fabric_error = fabric_error
        self.c_nvmlGpuFabricInfo_t = SimpleNamespace

    def byref(self, obj: Any) -> Any:
        return obj

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"580.82.07"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        return self._gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA GB300"

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return gpu_uuid(handle)

    def nvmlDeviceGetPciInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(busId=nvml_bus_id(handle))

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        if link not in self._links:
            raise RuntimeError("NotSupported")
        return self._links[link]

    def nvmlDeviceGetNvLinkVersion(self, handle: int, link: int) -> int:
        return 5

    def nvmlDeviceGetGpuFabricInfo(self, handle: int, info: SimpleNamespace) -> None:
        if self._fabric_error:
            raise self._fabric_error
        info.__dict__.update(vars(self._fabric))


@pytest.fixture
def install_nvml(monkeypatch):
    """``install_nvml(**FakeNvml options)``: ``import pynvml`` gives a FakeNvml.
    ``install_nvml(absent=True)``: the import fails, as on a machine without the NVIDIA driver."""

    def install(absent: bool = False, **options: Any) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", None if absent else FakeNvml(**options))

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

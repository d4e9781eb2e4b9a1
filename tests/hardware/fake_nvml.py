"""A fake NVML module for the health checks: per-GPU links, speeds, ECC, fabric, counters, Xid events.

It implements exactly what ``commbench.hardware.health`` (and the ``probes`` helpers it reuses) call, with
pynvml's names, constants and exception classes (checked against nvidia-ml-py 13.x's pynvml.py). Each GPU is
a ``FakeGpu``; a test changes it between ``before`` and ``after`` (``bump``, ``raise_xid``) and makes chosen
calls fail (``fail={"nvmlDeviceGetEccMode": NVMLError_NotSupported}``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

# pynvml's constants (same names, same values).
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_TIMEOUT = 10
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_NVLINK_ERROR_DL_REPLAY = 0
NVML_NVLINK_ERROR_DL_RECOVERY = 1
NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
NVML_NVLINK_ERROR_DL_CRC_DATA = 3
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON = 90
NVML_FI_DEV_NVLINK_GET_SPEED = 164
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
NVML_GPU_FABRIC_STATE_COMPLETED = 3
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlClocksEventReasonGpuIdle = 0x0000000000000001
nvmlClocksEventReasonSwPowerCap = 0x0000000000000004
nvmlClocksEventReasonHwSlowdown = 0x0000000000000008
nvmlClocksEventReasonSwThermalSlowdown = 0x0000000000000020
nvmlClocksEventReasonHwThermalSlowdown = 0x0000000000000040
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x0000000000000080

CLUSTER = bytes(range(1, 17))
CLUSTER_TEXT = "01020304-0506-0708-090a-0b0c0d0e0f10"  # CLUSTER as NVML tools print it
H100_LINK_MBPS = 26562  # what NVML reports per NVLink 4 link (one way, raw)


class NVMLError(Exception):
    """pynvml's base error: ``value`` is the NVML return code."""

    value = 999

    def __str__(self) -> str:
        return {3: "Not Supported", 4: "Insufficient Permissions", 10: "Timeout"}.get(
            self.value, "Unknown Error"
        )


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    value = NVML_ERROR_NOT_SUPPORTED


class NVMLError_NoPermission(NVMLError):  # noqa: N801
    value = NVML_ERROR_NO_PERMISSION


class NVMLError_Timeout(NVMLError):  # noqa: N801
    value = NVML_ERROR_TIMEOUT


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    value = 12


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}"


def nvml_bus_id(index: int) -> str:
    """NVML's spelling of fake GPU ``index``'s PCI bus id ("00000000:19:00.0"); nccl-tests': "0000:19:00"."""
    return f"00000000:{0x19 + 0x10 * index:02X}:00.0"


@dataclass(eq=False)
class FakeGpu:
    """One GPU. ``links`` links exist, ``down`` of them inactive; ``fabric`` None: the fabric call raises
    NotSupported (a Hopper GPU); ``counters``: (NVML_NVLINK_ERROR_DL_*, link) -> count; ``fail``: NVML
    function name -> exception class it raises for this GPU."""

    index: int
    links: int = 18
    down: set[int] = field(default_factory=set)
    speed_MBps: int = H100_LINK_MBPS
    slow: dict[int, int] = field(default_factory=dict)  # link -> its own speed
    per_link_speed: bool = True  # False: only the common-speed field answers
    ecc: tuple[int, int] = (1, 1)  # current, pending
    persistence: int = 1
    fabric: tuple[int, int, bytes, int] | None = None  # state, status, cluster uuid, clique id
    counters: dict[tuple[int, int], int] = field(default_factory=dict)
    ecc_errors: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})  # error type -> count
    clocks: int = nvmlClocksEventReasonGpuIdle
    name: str = "NVIDIA H200"
    fail: dict[str, type[Exception]] = field(default_factory=dict)
    event_sets: list[_EventSet] = field(default_factory=list)

    def check(self, function: str) -> None:
        if function in self.fail:
            raise self.fail[function]()


@dataclass(eq=False)
class _EventSet:
    queue: list[SimpleNamespace] = field(default_factory=list)
    freed: bool = False


class FakeNvml:
    """The pynvml module as seen by commbench: ``gpus`` (a count, or FakeGpu objects), one driver and CUDA
    version for the host; ``init_error`` makes nvmlInit raise it; ``fail`` as FakeGpu's, for system calls."""

    def __init__(
        self,
        gpus: int | list[FakeGpu] = 2,
        driver: str = "580.82.07",
        cuda: int = 13000,
        init_error: type[Exception] | None = None,
        fail: dict[str, type[Exception]] | None = None,
    ) -> None:
        self.gpus = [FakeGpu(i) for i in range(gpus)] if isinstance(gpus, int) else gpus
        self.driver, self.cuda, self.init_error = driver, cuda, init_error
        self.fail = fail or {}
        self.inits = 0  # nvmlInit minus nvmlShutdown calls: 0 again once every user closed NVML
        self.c_nvmlGpuFabricInfo_t = SimpleNamespace
        for name, value in globals().items():
            if name.startswith(("NVML", "nvml")) and not callable(value) or name.startswith("NVMLError"):
                setattr(self, name, value)

    # Changes between the snapshots.
    def bump(self, gpu: int, kind: int, link: int, by: int = 1) -> None:
        """NVLink error counter ``kind`` (NVML_NVLINK_ERROR_DL_*) of ``link`` grows by ``by``."""
        counters = self.gpus[gpu].counters
        counters[kind, link] = counters.get((kind, link), 0) + by

    def raise_xid(self, gpu: int, xid: int) -> None:
        """An Xid critical error on ``gpu``: queued in every event set registered for it (as NVML does)."""
        for events in self.gpus[gpu].event_sets:
            events.queue.append(SimpleNamespace(eventType=nvmlEventTypeXidCriticalError, eventData=xid))

    def _system(self, function: str) -> None:
        if function in self.fail:
            raise self.fail[function]()

    # pynvml's functions.
    def byref(self, obj: Any) -> Any:
        return obj

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error()
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._system("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._system("nvmlSystemGetCudaDriverVersion")
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._system("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return gpu.name

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return gpu_uuid(gpu.index)

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> SimpleNamespace:
        return SimpleNamespace(busId=nvml_bus_id(gpu.index).encode())

    def nvmlDeviceGetNvLinkState(self, gpu: FakeGpu, link: int) -> int:
        gpu.check("nvmlDeviceGetNvLinkState")
        if link >= gpu.links:
            raise NVMLError_NotSupported()
        return NVML_FEATURE_DISABLED if link in gpu.down else NVML_FEATURE_ENABLED

    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, field_ids: list[Any]) -> list[SimpleNamespace]:
        gpu.check("nvmlDeviceGetFieldValues")
        out = []
        for entry in field_ids:
            field_id, scope = entry if isinstance(entry, tuple) else (entry, 0)
            if field_id == NVML_FI_DEV_NVLINK_GET_SPEED and gpu.per_link_speed:
                ret, speed = NVML_SUCCESS, gpu.slow.get(scope, gpu.speed_MBps)
            elif field_id == NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON:
                ret, speed = NVML_SUCCESS, gpu.speed_MBps
            else:
                ret, speed = NVML_ERROR_NOT_SUPPORTED, 0
            value = SimpleNamespace(uiVal=speed)
            out.append(SimpleNamespace(nvmlReturn=ret, valueType=NVML_VALUE_TYPE_UNSIGNED_INT, value=value))
        return out

    def nvmlDeviceGetEccMode(self, gpu: FakeGpu) -> list[int]:
        gpu.check("nvmlDeviceGetEccMode")
        return list(gpu.ecc)

    def nvmlDeviceGetPersistenceMode(self, gpu: FakeGpu) -> int:
        gpu.check("nvmlDeviceGetPersistenceMode")
        return gpu.persistence

    def nvmlDeviceGetGpuFabricInfo(self, gpu: FakeGpu, info: SimpleNamespace) -> int:
        gpu.check("nvmlDeviceGetGpuFabricInfo")
        if gpu.fabric is None:
            raise NVMLError_NotSupported()
        state, status, cluster, clique = gpu.fabric
        info.__dict__.update(
            state=state, status=status, clusterUuid=cluster.ljust(16, b"\0"), cliqueId=clique
        )
        return NVML_SUCCESS

    def nvmlDeviceGetNvLinkErrorCounter(self, gpu: FakeGpu, link: int, counter: int) -> int:
        gpu.check("nvmlDeviceGetNvLinkErrorCounter")
        if link >= gpu.links:
            raise NVMLError_NotSupported()
        return gpu.counters.get((counter, link), 0)

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter_type: int) -> int:
        gpu.check("nvmlDeviceGetTotalEccErrors")
        assert counter_type == NVML_VOLATILE_ECC
        return gpu.ecc_errors[error_type]

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        gpu.check("nvmlDeviceGetCurrentClocksEventReasons")
        return gpu.clocks

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: FakeGpu) -> int:
        gpu.check("nvmlDeviceGetCurrentClocksThrottleReasons")
        return gpu.clocks

    def nvmlEventSetCreate(self) -> _EventSet:
        return _EventSet()

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, event_types: int, events: _EventSet) -> None:
        gpu.check("nvmlDeviceRegisterEvents")
        assert event_types == nvmlEventTypeXidCriticalError
        gpu.event_sets.append(events)

    def nvmlEventSetWait(self, events: _EventSet, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0, "the drain must not block"
        if not events.queue:
            raise NVMLError_Timeout()
        return events.queue.pop(0)

    def nvmlEventSetFree(self, events: _EventSet) -> None:
        events.freed = True
        for gpu in self.gpus:
            if events in gpu.event_sets:
                gpu.event_sets.remove(events)

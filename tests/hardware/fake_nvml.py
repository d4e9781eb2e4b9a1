"""A fake NVML module for the hardware probes and health checks, built on the real ``pynvml`` binding.

commbench talks to NVML through nvidia-ml-py (``pynvml.py``, a commbench dependency; the tests quote the line
numbers of 13.615.71). This fake keeps that module's constants, error classes and ctypes structures (so a
field value is a real ``c_nvmlFieldValue_t`` with its own ``nvmlReturn``, and ``NVMLError(code)`` is the
real per-code subclass) and replaces only the functions that would call the driver. Each function answers
as NVML documents it (nvml.h, as vendored in NVIDIA/DCGM 4.6 sdk/nvidia/nvml/dcgm_nvml.h), errors included:

- ``nvmlDeviceGetNvLinkState`` / ``GetNvLinkVersion`` / ``GetNvLinkErrorCounter``: NotSupported on a GPU
  without NVLink, InvalidArgument for a link number past the GPU's links (dcgm_nvml.h: "if device or link
  is invalid"). ``GetNvLinkErrorCounter`` is also NotSupported on NVLink 5 (Blackwell): DCGM 4.6
  modules/health/DcgmHealthWatch.cpp reads those counters "Pre-Blackwell only, deprecated on Blackwell+".
- ``nvmlDeviceGetFieldValues``: the call succeeds and every field carries its own return code (dcgm_nvml.h:
  "you must check the nvmlReturn field of each value"; "value is undefined if nvmlReturn != NVML_SUCCESS",
  so a failed field holds garbage here). The NVLink 5 counters ``NVML_FI_DEV_NVLINK_COUNT_*`` answer per link
  (scopeId = link, DCGM 4.6 dcgmlib/src/DcgmCacheManager.cpp "Query NVML with scopeId = linkIndex for
  per-link value") or summed over links (scopeId = UINT_MAX, the same file's aggregate) on NVLink 5 only.
- ``nvmlDeviceGetGpuFabricInfo`` (deprecated in pynvml.py) and ``nvmlDeviceGetGpuFabricInfoV`` (a versioned
  struct: a wrong version is NVML_ERROR_ARGUMENT_VERSION_MISMATCH): NotSupported where the GPU has no fabric.

Each GPU is a ``FakeGpu``; a test changes it between ``before`` and ``after`` (``bump``, ``bump_field``,
``raise_xid``) and makes chosen calls fail (``fail={"nvmlDeviceGetEccMode": NVMLError_NoPermission}``).
``FakeNvml(missing=(...))`` drops names from the module, as an older nvidia-ml-py lacks them.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pynvml as _real

# The real module's constants and error classes, re-exported for the tests (same names, same values).
NVML_SUCCESS = _real.NVML_SUCCESS
NVML_ERROR_INVALID_ARGUMENT = _real.NVML_ERROR_INVALID_ARGUMENT
NVML_ERROR_NOT_SUPPORTED = _real.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NO_PERMISSION = _real.NVML_ERROR_NO_PERMISSION
NVML_FEATURE_DISABLED = _real.NVML_FEATURE_DISABLED
NVML_FEATURE_ENABLED = _real.NVML_FEATURE_ENABLED
NVML_NVLINK_ERROR_DL_REPLAY = _real.NVML_NVLINK_ERROR_DL_REPLAY
NVML_NVLINK_ERROR_DL_RECOVERY = _real.NVML_NVLINK_ERROR_DL_RECOVERY
NVML_NVLINK_ERROR_DL_CRC_FLIT = _real.NVML_NVLINK_ERROR_DL_CRC_FLIT
NVML_NVLINK_ERROR_DL_CRC_DATA = _real.NVML_NVLINK_ERROR_DL_CRC_DATA
NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS = _real.NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS
NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS = _real.NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS
NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS = (
    _real.NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS
)
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = _real.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
NVML_GPU_FABRIC_STATE_NOT_STARTED = _real.NVML_GPU_FABRIC_STATE_NOT_STARTED
NVML_GPU_FABRIC_STATE_IN_PROGRESS = _real.NVML_GPU_FABRIC_STATE_IN_PROGRESS
NVML_GPU_FABRIC_STATE_COMPLETED = _real.NVML_GPU_FABRIC_STATE_COMPLETED
nvmlEventTypeXidCriticalError = _real.nvmlEventTypeXidCriticalError
nvmlClocksEventReasonGpuIdle = _real.nvmlClocksEventReasonGpuIdle
nvmlClocksEventReasonSwPowerCap = _real.nvmlClocksEventReasonSwPowerCap
nvmlClocksEventReasonHwSlowdown = _real.nvmlClocksEventReasonHwSlowdown
nvmlClocksEventReasonHwThermalSlowdown = _real.nvmlClocksEventReasonHwThermalSlowdown
NVMLError = _real.NVMLError
NVMLError_NotSupported = _real.NVMLError_NotSupported
NVMLError_NoPermission = _real.NVMLError_NoPermission
NVMLError_InvalidArgument = _real.NVMLError_InvalidArgument
NVMLError_Timeout = _real.NVMLError_Timeout
NVMLError_LibraryNotFound = _real.NVMLError_LibraryNotFound
NVMLError_FunctionNotFound = _real.NVMLError_FunctionNotFound

CLUSTER = bytes(range(1, 17))
CLUSTER_TEXT = "01020304-0506-0708-090a-0b0c0d0e0f10"  # CLUSTER as NVML tools print it
H100_LINK_MBPS = 26562  # what NVML reports per NVLink 4 link (one way, raw)
NVLINK5_LINK_MBPS = 53125  # per NVLink 5 link: above 900 GB/s / 18 links = 50 GB/s
AGGREGATE_SCOPE = 0xFFFFFFFF  # scopeId UINT_MAX: an NVLink 5 counter summed over the GPU's links
GARBAGE = 0xDEADBEEF  # what a failed field's value holds ("undefined")
# NVLink 5 per-link counters: NVML_FI_DEV_NVLINK_COUNT_XMIT_PACKETS (201) .. _SYMBOL_BER (222) and the FEC
# history bins (235 .. 250), as DCGM 4.6 dcgmlib/src/DcgmCMUtils.cpp lists them (NvLinkAggregate fields).
NVLINK5_FIELDS = frozenset(range(201, 223)) | frozenset(range(235, 251))
_VERSION_ENUM = {4: _real.NVML_NVLINK_VERSION_4_0, 5: _real.NVML_NVLINK_VERSION_5_0}


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}"


def nvml_bus_id(index: int) -> str:
    """NVML's spelling of fake GPU ``index``'s PCI bus id ("00000000:19:00.0"); nccl-tests': "0000:19:00"."""
    return f"00000000:{0x19 + 0x10 * index:02X}:00.0"


@dataclass(eq=False)
class FakeGpu:
    """One GPU. ``links`` links exist (0: no NVLink at all), ``down`` of them inactive; ``nvlink`` the
    NVLink generation (4 Hopper, 5 Blackwell: which error counters answer); ``fabric`` None: the fabric
    calls raise NotSupported (a Hopper HGX GPU), else (state, status, cluster uuid, clique id);
    ``counters``: (NVML_NVLINK_ERROR_DL_*, link) -> count; ``field_counts``: (NVML_FI_DEV_NVLINK_COUNT_*,
    link) -> count; ``field_errors``: (field id, scope) -> the return code that field answers with (a
    refusal of one field); ``fail``: NVML function name -> exception class it raises for this GPU."""

    index: int
    links: int = 18
    down: set[int] = field(default_factory=set)
    nvlink: int = 4
    speed_MBps: int = H100_LINK_MBPS
    slow: dict[int, int] = field(default_factory=dict)  # link -> its own speed
    per_link_speed: bool = True  # False: only the common-speed field answers
    ecc: tuple[int, int] = (1, 1)  # current, pending
    persistence: int = 1
    fabric: tuple[int, int, bytes, int] | None = None
    health_mask: int = 0
    counters: dict[tuple[int, int], int] = field(default_factory=dict)
    field_counts: dict[tuple[int, int], int] = field(default_factory=dict)
    field_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (field, scope) -> its nvmlReturn
    ecc_errors: dict[int, int] = field(default_factory=lambda: {0: 0, 1: 0})  # error type -> count
    clocks: int = nvmlClocksEventReasonGpuIdle
    name: str = "NVIDIA H200"
    fail: dict[str, type[Exception]] = field(default_factory=dict)
    event_sets: list[_EventSet] = field(default_factory=list)

    def check(self, function: str) -> None:
        if function in self.fail:
            raise self.fail[function]()

    def link_error(self, link: int) -> int:
        """The return code of a per-link query of ``link``: success, or why not."""
        if self.links == 0:
            return NVML_ERROR_NOT_SUPPORTED
        return NVML_SUCCESS if 0 <= link < self.links else NVML_ERROR_INVALID_ARGUMENT


@dataclass(eq=False)
class _EventSet:
    queue: list[Any] = field(default_factory=list)
    freed: bool = False


def _raise(code: int) -> None:
    if code != NVML_SUCCESS:
        raise NVMLError(code)  # the real binding's mapping: NVMLError(3) is an NVMLError_NotSupported


def _struct(info: Any) -> Any:
    """The structure a ``byref`` (ctypes' own) points at."""
    return getattr(info, "_obj", info)


class FakeNvml:
    """The pynvml module as seen by commbench: ``gpus`` (a count, or FakeGpu objects), one driver and CUDA
    version for the host; ``init_error`` makes nvmlInit raise it; ``fail`` as FakeGpu's, for system calls;
    ``missing``: names this binding lacks (AttributeError, as an older nvidia-ml-py)."""

    def __init__(
        self,
        gpus: int | list[FakeGpu] = 2,
        driver: str = "580.82.07",
        cuda: int = 13000,
        init_error: type[Exception] | None = None,
        fail: dict[str, type[Exception]] | None = None,
        missing: tuple[str, ...] = (),
    ) -> None:
        self.gpus = [FakeGpu(i) for i in range(gpus)] if isinstance(gpus, int) else gpus
        self.driver, self.cuda, self.init_error = driver, cuda, init_error
        self.fail = fail or {}
        self.missing = set(missing)
        self.inits = 0  # nvmlInit minus nvmlShutdown calls: 0 again once every user closed NVML
        for name in dir(_real):
            value = getattr(_real, name)
            keep = name.startswith(("NVML", "nvml", "c_nvml")) and not callable(value)
            if keep or name.startswith(("NVMLError", "c_nvml")):  # constants, error classes, structs
                self.__dict__[name] = value
        self.byref = ctypes.byref

    def __getattribute__(self, name: str) -> Any:
        if name != "missing" and name in object.__getattribute__(self, "missing"):
            raise AttributeError(f"module 'pynvml' has no attribute '{name}'")
        return object.__getattribute__(self, name)

    # Changes between the snapshots.
    def bump(self, gpu: int, kind: int, link: int, by: int = 1) -> None:
        """NVLink error counter ``kind`` (NVML_NVLINK_ERROR_DL_*) of ``link`` grows by ``by``."""
        counters = self.gpus[gpu].counters
        counters[kind, link] = counters.get((kind, link), 0) + by

    def bump_field(self, gpu: int, field_id: int, link: int, by: int = 1) -> None:
        """NVLink 5 counter ``field_id`` (NVML_FI_DEV_NVLINK_COUNT_*) of ``link`` grows by ``by``."""
        counts = self.gpus[gpu].field_counts
        counts[field_id, link] = counts.get((field_id, link), 0) + by

    def raise_xid(self, gpu: int, xid: int) -> None:
        """An Xid critical error on ``gpu``: queued in every event set registered for it (as NVML does)."""
        for events in self.gpus[gpu].event_sets:
            data = _real.c_nvmlEventData_t()
            data.eventType, data.eventData = nvmlEventTypeXidCriticalError, xid
            events.queue.append(data)

    def _system(self, function: str) -> None:
        if function in self.fail:
            raise self.fail[function]()

    # pynvml's functions.
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
        if not 0 <= index < len(self.gpus):
            _raise(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return gpu.name  # pynvml.py decodes (convertStrBytes): str

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return gpu_uuid(gpu.index)

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> Any:
        info = _real.nvmlPciInfo_t()
        info.busId = nvml_bus_id(gpu.index).encode()  # a c_char array: bytes, as the real struct's
        return info

    def nvmlDeviceGetNvLinkState(self, gpu: FakeGpu, link: int) -> int:
        gpu.check("nvmlDeviceGetNvLinkState")
        _raise(gpu.link_error(link))
        return NVML_FEATURE_DISABLED if link in gpu.down else NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkVersion(self, gpu: FakeGpu, link: int) -> int:
        gpu.check("nvmlDeviceGetNvLinkVersion")
        _raise(gpu.link_error(link))
        return _VERSION_ENUM[gpu.nvlink]

    def nvmlDeviceGetNvLinkErrorCounter(self, gpu: FakeGpu, link: int, counter: int) -> int:
        gpu.check("nvmlDeviceGetNvLinkErrorCounter")
        if gpu.nvlink >= 5:
            _raise(NVML_ERROR_NOT_SUPPORTED)  # deprecated on Blackwell: the field values carry them
        _raise(gpu.link_error(link))
        if counter not in range(_real.NVML_NVLINK_ERROR_COUNT):
            _raise(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.counters.get((counter, link), 0)

    def _field(self, gpu: FakeGpu, field_id: int, scope: int) -> tuple[int, int, int]:
        """(nvmlReturn, valueType, value) of one field."""
        uint, ull = _real.NVML_VALUE_TYPE_UNSIGNED_INT, _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        if (field_id, scope) in gpu.field_errors:
            return gpu.field_errors[field_id, scope], ull, GARBAGE
        if gpu.links == 0 and (field_id in NVLINK5_FIELDS or 84 <= field_id <= 166):
            return NVML_ERROR_NOT_SUPPORTED, uint, GARBAGE  # no NVLink: no NVLink field
        if field_id == _real.NVML_FI_DEV_NVLINK_LINK_COUNT:
            return NVML_SUCCESS, uint, gpu.links
        if field_id == _real.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON:
            return NVML_SUCCESS, uint, gpu.speed_MBps
        if field_id in (_real.NVML_FI_DEV_NVLINK_GET_SPEED, _real.NVML_FI_DEV_NVLINK_GET_STATE):
            code = gpu.link_error(scope)
            unreported = field_id == _real.NVML_FI_DEV_NVLINK_GET_SPEED and not gpu.per_link_speed
            if code != NVML_SUCCESS or unreported:
                return code or NVML_ERROR_NOT_SUPPORTED, uint, GARBAGE
            if field_id == _real.NVML_FI_DEV_NVLINK_GET_STATE:
                return NVML_SUCCESS, uint, int(scope not in gpu.down)
            return NVML_SUCCESS, uint, 0 if scope in gpu.down else gpu.slow.get(scope, gpu.speed_MBps)
        if field_id in NVLINK5_FIELDS:
            if gpu.nvlink < 5:
                return NVML_ERROR_NOT_SUPPORTED, ull, GARBAGE
            if scope == AGGREGATE_SCOPE:
                total = sum(n for (kind, _link), n in gpu.field_counts.items() if kind == field_id)
                return NVML_SUCCESS, ull, total
            code = gpu.link_error(scope)
            return code, ull, gpu.field_counts.get((field_id, scope), 0) if code == NVML_SUCCESS else GARBAGE
        return NVML_ERROR_NOT_SUPPORTED, uint, GARBAGE

    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, field_ids: list[Any]) -> Any:
        """pynvml.py's own construction (an int, or a (fieldId, scopeId) tuple, per entry), then each field's
        own return code, value type and value as NVML fills them."""
        gpu.check("nvmlDeviceGetFieldValues")
        values = (_real.c_nvmlFieldValue_t * len(field_ids))()
        for i, entry in enumerate(field_ids):
            try:
                (values[i].fieldId, values[i].scopeId) = entry
            except TypeError:
                values[i].fieldId = entry
            ret, kind, value = self._field(gpu, int(values[i].fieldId), int(values[i].scopeId))
            values[i].nvmlReturn, values[i].valueType = ret, kind
            if kind == _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
                values[i].value.ullVal = value
            else:
                values[i].value.uiVal = value
        return values

    def nvmlDeviceGetEccMode(self, gpu: FakeGpu) -> list[int]:
        gpu.check("nvmlDeviceGetEccMode")
        return list(gpu.ecc)

    def nvmlDeviceGetPersistenceMode(self, gpu: FakeGpu) -> int:
        gpu.check("nvmlDeviceGetPersistenceMode")
        return gpu.persistence

    def _fill_fabric(self, gpu: FakeGpu, info: Any) -> None:
        if gpu.fabric is None:
            _raise(NVML_ERROR_NOT_SUPPORTED)
        state, status, cluster, clique = gpu.fabric
        info.state, info.status, info.cliqueId = state, status, clique
        ctypes.memmove(info.clusterUuid, cluster.ljust(16, b"\0"), 16)

    def nvmlDeviceGetGpuFabricInfo(self, gpu: FakeGpu, info: Any) -> int:
        gpu.check("nvmlDeviceGetGpuFabricInfo")
        self._fill_fabric(gpu, _struct(info))
        return NVML_SUCCESS

    def nvmlDeviceGetGpuFabricInfoV(self, gpu: FakeGpu, info: Any) -> int:
        gpu.check("nvmlDeviceGetGpuFabricInfoV")
        struct = _struct(info)
        if getattr(struct, "version", None) != _real.nvmlGpuFabricInfo_v2:
            _raise(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        self._fill_fabric(gpu, struct)
        struct.healthMask = gpu.health_mask
        return NVML_SUCCESS

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, error_type: int, counter_type: int) -> int:
        gpu.check("nvmlDeviceGetTotalEccErrors")
        assert counter_type == _real.NVML_VOLATILE_ECC
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

    def nvmlEventSetWait(self, events: _EventSet, timeout_ms: int) -> Any:
        assert timeout_ms == 0, "the drain must not block"
        if not events.queue:
            _raise(_real.NVML_ERROR_TIMEOUT)
        return events.queue.pop(0)

    def nvmlEventSetFree(self, events: _EventSet) -> None:
        events.freed = True
        for gpu in self.gpus:
            if events in gpu.event_sets:
                gpu.event_sets.remove(events)

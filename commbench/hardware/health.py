"""GPU health read from NVML on each rank: preflight facts (links, ECC, versions, fabric) and error counters.

``read_health`` -> ``GpuHealth`` (before anything is measured); ``watch_counters`` -> ``CounterWatch``:
``.before`` at once, ``.finish()`` after the suite (``CounterSnapshot``s: NVLink error counters, volatile ECC
totals, clocks-event reasons, Xid critical errors in between). Plain frozen dataclasses (pickled for the
all-gather, ``to_dict`` for JSON), judged by ``report.judge.preflight`` (the facts) and
``report.judge.counters`` (the counters). The NVML module is passed in (tests: a fake) or ``pynvml`` is
imported lazily. Nothing raises: what cannot be read (CPU rank, no NVML, NotSupported, NoPermission) is in
``skipped``, fact -> reason. The rank's GPU is found as ``probes`` does.

The NVLink error counters are read by ``nvlink_counters`` (NVLink 4's call and NVLink 5's field values).
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

from commbench.hardware.nvlink_counters import (
    ALL_NVLINK_COUNTERS,
    field_number,
    read_nvlink_counters,
    skip_reason,
)
from commbench.hardware.probes import (
    _error_text,
    _nvml,
    _nvml_gpu_of,
    _text,
    bus_id_text,
    cuda_device,
    nccl_version,
    pci_tuple,
    read_fabric,
)

NO_GPU = "no GPU: CPU rank"
# Volatile ECC totals (nvmlDeviceGetTotalEccErrors): counter name -> NVML memory error type constant name.
ECC_COUNTERS = {
    "ecc_corrected": "NVML_MEMORY_ERROR_TYPE_CORRECTED",
    "ecc_uncorrected": "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
}
# Clocks-event reasons that mean hardware or driver slowed the GPU (nvml.h nvmlClocksEventReason* bits).
# Idle, application clocks, sync boost and the SW power cap (at the power limit under load) are normal.
SLOWDOWN_REASONS = {
    0x08: "HW slowdown",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake slowdown",
}
_MAX_EVENTS = 4096  # drained per finish(): bounded, so a storm of events cannot hold a rank here
_FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}


@dataclass(frozen=True)
class GpuHealth:
    """What one rank's GPU shows before the suite (its rank: its place in the gathered list). Facts left
    None or empty were not read; ``skipped`` says why per fact: "gpu" (all of them), "nvlink",
    "nvlink_speed", "ecc", "persistence", "driver", "cuda_driver", "nccl", "fabric"."""

    host: str
    device: int = -1  # CUDA ordinal in the rank's process; -1 = a CPU rank
    uuid: str = ""
    bus_id: str = ""  # "0000:19:00", as nccl-tests prints it
    gpu_name: str = ""
    nvml_index: int = -1
    host_gpu_count: int | None = None  # GPUs NVML sees on the host (CUDA_VISIBLE_DEVICES hides none)
    nvlink_active: tuple[int, ...] = ()  # link numbers NVML reports active
    nvlink_inactive: tuple[int, ...] = ()  # link numbers NVML reports, not active
    nvlink_speed_MBps: dict[int, int] = field(default_factory=dict)  # active link -> speed NVML reports
    nvlink_common_speed_MBps: int | None = None  # all active links' speed, where per-link is not reported
    ecc_current: bool | None = None
    ecc_pending: bool | None = None
    persistence: bool | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # "13.0"
    nccl_version: str | None = None
    fabric_state: str | None = None  # "completed", "in progress", "not started", "not supported"
    fabric_status: int | None = None  # an NVML return code: 0 = registered
    fabric_cluster_uuid: str = ""
    fabric_clique_id: int = -1
    fabric_health_mask: int | None = None  # nvmlGpuFabricInfo_v2 healthMask (recorded, not judged)
    skipped: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CounterSnapshot:
    """One rank's GPU counters ``when`` "before" or "after" the suite. ``nvlink``: counter
    (ALL_NVLINK_COUNTERS) -> link -> count; ``nvlink_active``: the links active when the watch started (a GPU
    with active links whose NVLink counters all went unread is a finding); ``xid_events`` (after): Xid
    numbers of the critical errors since before; ``skipped``: counter (ALL_NVLINK_COUNTERS, ECC_COUNTERS,
    "clocks", "xid"; "gpu": all) -> reason."""

    host: str
    device: int = -1
    uuid: str = ""
    bus_id: str = ""
    when: str = "before"
    nvlink: dict[str, dict[int, int]] = field(default_factory=dict)
    nvlink_active: tuple[int, ...] = ()
    ecc_corrected: int | None = None  # volatile: since the driver loaded
    ecc_uncorrected: int | None = None
    clocks_event_reasons: int | None = None  # nvmlDeviceGetCurrentClocksEventReasons bitmask
    xid_events: tuple[int, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)

    def total(self, counter: str) -> int | None:
        """A counter's value (NVLink ones summed over links); None when it was not read."""
        if counter in ALL_NVLINK_COUNTERS:
            links = self.nvlink.get(counter)
            return None if links is None else sum(links.values())
        return getattr(self, counter, None)

    @property
    def slowdowns(self) -> tuple[str, ...]:
        """The SLOWDOWN_REASONS active in ``clocks_event_reasons``."""
        bits = self.clocks_event_reasons or 0
        return tuple(name for bit, name in sorted(SLOWDOWN_REASONS.items()) if bits & bit)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _open(nvml: Any | None) -> Any:
    """The NVML module, initialised (``pynvml`` imported now when none is given)."""
    if nvml is None:
        return _nvml()
    nvml.nvmlInit()
    return nvml


def _close(nvml: Any) -> None:
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()


@dataclass(frozen=True)
class _Gpu:
    """The NVML GPU that is this rank's CUDA device, and how many GPUs NVML sees on the host."""

    handle: Any
    index: int
    uuid: str
    bus_id: str
    count: int


def _find_gpu(nvml: Any, device_index: int) -> _Gpu | str:
    """This rank's GPU among NVML's (by UUID, else PCI bus id: ``probes._nvml_gpu_of``), or why not."""
    count = int(nvml.nvmlDeviceGetCount())
    gpus, handles = [], {}
    for index in range(count):
        try:
            handles[index] = handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # a GPU NVML cannot open (lost) cannot be this rank's
            continue
        gpu: dict[str, Any] = {"index": index}
        for key, read in (("uuid", nvml.nvmlDeviceGetUUID), ("pci_bus_id", nvml.nvmlDeviceGetPciInfo)):
            try:
                value = read(handle)
                gpu[key] = _text(value.busId if key == "pci_bus_id" else value)
            except Exception as exc:
                gpu[key] = f"? ({_error_text(exc)})"  # probes' spelling of an unreadable field
        gpus.append(gpu)
    device = cuda_device(device_index)
    found = _nvml_gpu_of(device, gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if found is None:
        return f"GPU not found: CUDA device {device_index} is none of the {count} GPU(s) NVML sees"
    pci = device.pci or pci_tuple(found["pci_bus_id"])
    uuid = "" if found["uuid"].startswith("?") else found["uuid"]
    bus_id = bus_id_text(pci) if pci is not None else ""
    return _Gpu(handles[found["index"]], found["index"], uuid, bus_id, count)


def _links(nvml: Any, handle: Any) -> tuple[list[int], list[int], str]:
    """Active and inactive link numbers (links whose state NVML answers), and why none answered."""
    active, inactive, why = [], [], ""
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = int(nvml.nvmlDeviceGetNvLinkState(handle, link))
        except Exception as exc:  # a link number past this GPU's links, or no NVLink at all
            why = why or skip_reason(nvml, exc)
            continue
        (active if state == 1 else inactive).append(link)
    if not active and not inactive:
        return [], [], f"NVLink state not readable: {why or 'no links reported'}"
    return active, inactive, ""


def _speeds(nvml: Any, handle: Any, active: list[int]) -> tuple[dict[int, int], int | None, str]:
    """Per-link speeds (field NVML_FI_DEV_NVLINK_GET_SPEED, scope = link number), else the common speed of
    the active links (NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON), and why neither was read."""
    if not active:
        return {}, None, "no active link"
    try:
        fields = [(nvml.NVML_FI_DEV_NVLINK_GET_SPEED, link) for link in active]
        values = nvml.nvmlDeviceGetFieldValues(handle, fields)
        speeds = {link: field_number(nvml, v) for link, v in zip(active, values, strict=True)}
        known = {link: speed for link, speed in speeds.items() if speed}
        if known:
            return known, None, ""
        why = "per-link speed not reported"
    except Exception as exc:
        why = f"per-link speed: {skip_reason(nvml, exc)}"
    try:
        fields = [nvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON]
        common = field_number(nvml, nvml.nvmlDeviceGetFieldValues(handle, fields)[0])
        if common:
            return {}, common, ""
    except Exception as exc:
        why += f"; common speed: {skip_reason(nvml, exc)}"
    return {}, None, f"NVLink speed not readable ({why})"


def _fabric(nvml: Any, handle: Any) -> dict[str, Any]:
    """The GPU's multi-node NVLink fabric registration (``probes.read_fabric``: the versioned call first)."""
    info = read_fabric(nvml, handle)
    raw = bytes(info.clusterUuid).hex()
    cluster = f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}" if raw.strip("0") else ""
    state = int(info.state)
    mask = getattr(info, "healthMask", None)
    return {
        "fabric_state": _FABRIC_STATES.get(state, f"state {state}"),
        "fabric_status": int(info.status),
        "fabric_cluster_uuid": cluster,
        "fabric_clique_id": int(info.cliqueId),
        "fabric_health_mask": None if mask is None else int(mask),
    }


def _facts(nvml: Any, handle: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """Every preflight fact NVML answers for the GPU, and why each other one is missing."""
    facts: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    active, inactive, why = _links(nvml, handle)
    if why:
        skipped["nvlink"] = skipped["nvlink_speed"] = why
    else:
        speeds, common, why = _speeds(nvml, handle, active)
        facts.update(nvlink_active=tuple(active), nvlink_inactive=tuple(inactive))
        facts.update(nvlink_speed_MBps=speeds, nvlink_common_speed_MBps=common)
        if why:
            skipped["nvlink_speed"] = why
    on = int(getattr(nvml, "NVML_FEATURE_ENABLED", 1))
    readers = {
        "name": lambda: {"gpu_name": _text(nvml.nvmlDeviceGetName(handle))},
        "ecc": lambda: _ecc(nvml.nvmlDeviceGetEccMode(handle), on),
        "persistence": lambda: {"persistence": int(nvml.nvmlDeviceGetPersistenceMode(handle)) == on},
        "driver": lambda: {"driver_version": _text(nvml.nvmlSystemGetDriverVersion())},
        "cuda_driver": lambda: {"cuda_driver_version": _cuda_text(nvml.nvmlSystemGetCudaDriverVersion())},
        "fabric": lambda: _fabric(nvml, handle),
    }
    for fact, read in readers.items():
        try:
            facts.update(read())
        except Exception as exc:
            skipped[fact] = skip_reason(nvml, exc)
    skipped.pop("name", None)  # the name only labels messages: torch's stands in
    return facts, skipped


def _ecc(modes: Any, on: int) -> dict[str, bool]:
    current, pending = modes  # nvmlDeviceGetEccMode: [current, pending]
    return {"ecc_current": int(current) == on, "ecc_pending": int(pending) == on}


def _cuda_text(version: Any) -> str:
    """NVML's CUDA driver version integer as CUDA prints it: 13000 -> "13.0", 12080 -> "12.8"."""
    return f"{int(version) // 1000}.{int(version) % 1000 // 10}"


def _nccl() -> tuple[str | None, str]:
    """The NCCL version torch carries where CUDA works, else why not."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None, "CUDA not available: no NCCL"
    except Exception as exc:
        return None, f"torch not importable: {_error_text(exc)}"
    version = nccl_version()
    return version, "" if version else "NCCL version not readable from torch"


def read_health(device_index: int | None, nvml: Any | None = None) -> GpuHealth:
    """What CUDA device ``device_index`` of this process (None: a CPU rank) shows before the suite; every
    fact NVML does not answer is in ``skipped`` with the reason. Never raises."""
    host = socket.gethostname()
    if device_index is None or device_index < 0:
        return GpuHealth(host=host, skipped={"gpu": NO_GPU})
    try:
        nvml = _open(nvml)
    except Exception as exc:
        return GpuHealth(host, device_index, skipped={"gpu": f"NVML not available: {skip_reason(nvml, exc)}"})
    try:
        gpu = _find_gpu(nvml, device_index)
        if isinstance(gpu, str):
            return GpuHealth(host, device_index, skipped={"gpu": gpu})
        facts, skipped = _facts(nvml, gpu.handle)
        nccl, why = _nccl()
        skipped.update({"nccl": why} if why else {})
        facts.setdefault("gpu_name", cuda_device(device_index).name)
        where = {"uuid": gpu.uuid, "bus_id": gpu.bus_id, "nvml_index": gpu.index, "host_gpu_count": gpu.count}
        return GpuHealth(host, device_index, nccl_version=nccl, skipped=skipped, **where, **facts)
    except Exception as exc:  # never raise from a probe: the whole GPU is then not checked
        return GpuHealth(host, device_index, skipped={"gpu": f"NVML query failed: {skip_reason(nvml, exc)}"})
    finally:
        _close(nvml)


def _counters(nvml: Any, handle: Any, links: list[int]) -> tuple[dict[str, Any], dict[str, str]]:
    """NVLink error counters of ``links`` (both interfaces), volatile ECC totals and clocks-event reasons,
    and why any is missing. A counter that some links do not answer is kept for the links that do."""
    nvlink, skipped = read_nvlink_counters(nvml, handle, links)
    values: dict[str, Any] = {"nvlink": nvlink}
    for counter, constant in ECC_COUNTERS.items():
        try:
            kind = getattr(nvml, constant)
            values[counter] = int(nvml.nvmlDeviceGetTotalEccErrors(handle, kind, nvml.NVML_VOLATILE_ECC))
        except Exception as exc:  # NotSupported where ECC is off or the GPU has none
            skipped[counter] = skip_reason(nvml, exc)
    try:
        values["clocks_event_reasons"] = int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except Exception as exc:
        try:  # drivers and bindings older than the "event" name have only the "throttle" one
            values["clocks_event_reasons"] = int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
        except Exception:
            skipped["clocks"] = skip_reason(nvml, exc)
    return values, skipped


class CounterWatch:
    """This rank's GPU counters from before the suite to after it (made by ``watch_counters``). NVML stays
    open in between with an Xid event set registered, so that ``finish()`` drains, without waiting, the Xid
    critical errors that arrived in between. Never raises."""

    def __init__(self, device_index: int | None, nvml: Any | None = None) -> None:
        self._where: dict[str, Any] = {"host": socket.gethostname(), "device": device_index}
        self._nvml: Any = None
        self._gpu: _Gpu | None = None
        self._links: list[int] = []
        self._active: tuple[int, ...] = ()
        self._events: Any = None
        self._skipped: dict[str, str] = {}
        self._after: CounterSnapshot | None = None
        if device_index is None or device_index < 0:
            self._where["device"] = -1
            self._skipped["gpu"] = NO_GPU
        else:
            self._start(device_index, nvml)
        self.before = self._snapshot("before")

    def _start(self, device_index: int, nvml: Any | None) -> None:
        try:
            self._nvml = _open(nvml)
            gpu = _find_gpu(self._nvml, device_index)
        except Exception as exc:
            prefix = "NVML not available" if self._nvml is None else "NVML query failed"
            gpu = f"{prefix}: {skip_reason(nvml or self._nvml, exc)}"
        if isinstance(gpu, str):
            self._skipped["gpu"] = gpu
            self._shut()
            return
        self._gpu = gpu
        self._where.update(uuid=gpu.uuid, bus_id=gpu.bus_id)
        active, inactive, _ = _links(self._nvml, gpu.handle)
        self._links = sorted(active + inactive)
        self._active = tuple(active)
        try:
            self._events = self._nvml.nvmlEventSetCreate()
            xid = self._nvml.nvmlEventTypeXidCriticalError
            self._nvml.nvmlDeviceRegisterEvents(gpu.handle, xid, self._events)
        except Exception as exc:  # NoPermission in some containers, NotSupported on some GPUs
            self._skipped["xid"] = f"Xid events not watched: {skip_reason(self._nvml, exc)}"
            self._free_events()

    def _snapshot(self, when: str, xids: tuple[int, ...] = ()) -> CounterSnapshot:
        values: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        if self._gpu is not None:
            try:
                values, skipped = _counters(self._nvml, self._gpu.handle, self._links)
            except Exception as exc:
                skipped = {"gpu": f"NVML query failed: {skip_reason(self._nvml, exc)}"}
        skipped.update(self._skipped)
        where = {**self._where, "nvlink_active": self._active}
        return CounterSnapshot(**where, when=when, xid_events=xids, skipped=skipped, **values)

    def _drain(self) -> tuple[int, ...]:
        """Xid numbers of the events waiting in the set, up to the first wait that times out (the timeout
        is 0 ms: nothing blocks)."""
        timeout = getattr(self._nvml, "NVMLError_Timeout", None)
        xid = int(self._nvml.nvmlEventTypeXidCriticalError)
        xids: list[int] = []
        for _ in range(_MAX_EVENTS):
            try:
                data = self._nvml.nvmlEventSetWait(self._events, 0)
            except Exception as exc:
                if not (isinstance(timeout, type) and isinstance(exc, timeout)):
                    self._skipped["xid"] = f"Xid events not read: {skip_reason(self._nvml, exc)}"
                break
            if int(data.eventType) & xid:
                xids.append(int(data.eventData))
        return tuple(xids)

    def finish(self) -> CounterSnapshot:
        """The ``after`` snapshot, with the Xid events since ``before``; NVML is closed. Called again, the
        same snapshot."""
        if self._after is None:
            xids: tuple[int, ...] = ()
            if self._events is not None:
                try:
                    xids = self._drain()
                except Exception as exc:
                    self._skipped["xid"] = f"Xid events not read: {skip_reason(self._nvml, exc)}"
                self._free_events()
            self._after = self._snapshot("after", xids)
            self._shut()
        return self._after

    def _free_events(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlEventSetFree(self._events)
        self._events = None

    def _shut(self) -> None:
        _close(self._nvml)
        self._nvml, self._gpu = None, None


def watch_counters(device_index: int | None, nvml: Any | None = None) -> CounterWatch:
    """Start watching CUDA device ``device_index`` of this process (None: a CPU rank): ``.before`` now,
    ``.finish()`` after the suite."""
    return CounterWatch(device_index, nvml)

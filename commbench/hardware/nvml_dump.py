"""Everything NVML shows about this machine's NVLink, fabric and error counters, as one JSON-able dict.

``dump_nvml`` asks each GPU every link's state, version and ``nvmlDeviceGetNvLinkErrorCounter`` counters,
the NVLink field values (``NVML_FI_DEV_NVLINK_*``: state, speed, the old DL error counters and every
``NVML_FI_DEV_NVLINK_COUNT_*`` the binding has) per link and summed over links, both fabric info calls, ECC
and persistence mode; what a call refuses is the short name of its error ("NotSupported"). Nothing is
judged here: it is what a device check (benchmarks/gpu_check.py) keeps of a real box, so that the readers
in ``probes`` and ``health`` can be checked against what NVML really answers there.
"""

from __future__ import annotations

import contextlib
from typing import Any

from commbench.hardware.probes import _error_text, _nvml, _text, nvlink_version_text

# What ``dump_nvml`` asks per link as field values (besides every NVML_FI_DEV_NVLINK_COUNT_* the binding has).
_DUMP_LINK_FIELDS = (
    "NVML_FI_DEV_NVLINK_GET_STATE",
    "NVML_FI_DEV_NVLINK_GET_VERSION",
    "NVML_FI_DEV_NVLINK_GET_SPEED",
    "NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY",
    "NVML_FI_DEV_NVLINK_ERROR_DL_RECOVERY",
    "NVML_FI_DEV_NVLINK_ERROR_DL_CRC",
)
_DUMP_GPU_FIELDS = ("NVML_FI_DEV_NVLINK_LINK_COUNT", "NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON")
_DUMP_COUNTERS = ("REPLAY", "RECOVERY", "CRC_FLIT", "CRC_DATA", "ECC_DATA")  # NVML_NVLINK_ERROR_DL_*
_AGGREGATE_SCOPE = 0xFFFFFFFF  # scopeId UINT_MAX: an NVLink 5 counter over all links (as DCGM asks it)


def _short(exc: BaseException) -> str:
    """An NVML error as the dump spells it: "NotSupported", "InvalidArgument", else the error text."""
    name = type(exc).__name__
    return name[len("NVMLError_") :] if name.startswith("NVMLError_") else _error_text(exc)


def _code_text(nvml: Any, code: int) -> str:
    """A field value's own return code as the dump spells it ("NotSupported")."""
    try:
        return _short(nvml.NVMLError(code))
    except Exception:
        return f"return {code}"


def _answer(call: Any) -> Any:
    """``call()``'s value, or the short name of what it raised."""
    try:
        value = call()
    except Exception as exc:
        return _short(exc)
    return _text(value) if isinstance(value, bytes) else value


def _field_values(nvml: Any, handle: Any, name: str, scopes: list[int]) -> dict[str, Any]:
    """ "NAME@scope" -> field ``name``'s value at each of ``scopes`` (its value type's union member), or why
    not (its own return code, or what the call raised). One call per field: a few dozen values at most."""
    key = "{}@{}".format
    if not hasattr(nvml, name):
        return {}
    try:
        answers = nvml.nvmlDeviceGetFieldValues(handle, [(getattr(nvml, name), scope) for scope in scopes])
    except Exception as exc:
        return {key(name, scope): _short(exc) for scope in scopes}
    members = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # NVML_VALUE_TYPE_* order
    out: dict[str, Any] = {}
    for scope, answer in zip(scopes, answers, strict=True):
        code, kind = int(answer.nvmlReturn), int(answer.valueType)
        if code != int(getattr(nvml, "NVML_SUCCESS", 0)):
            out[key(name, scope)] = _code_text(nvml, code)
        elif 0 <= kind < len(members):
            out[key(name, scope)] = getattr(answer.value, members[kind])
        else:
            out[key(name, scope)] = f"value type {kind}"
    return out


def _dump_gpu(nvml: Any, handle: Any) -> dict[str, Any]:
    """One GPU: identity, every link NVML answers (state, version, error counters), the NVLink field values
    per link and summed, the fabric info of both calls, ECC and persistence mode."""
    gpu: dict[str, Any] = {
        "name": _answer(lambda: nvml.nvmlDeviceGetName(handle)),
        "uuid": _answer(lambda: nvml.nvmlDeviceGetUUID(handle)),
        "pci_bus_id": _answer(lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId)),
        "ecc_mode": _answer(lambda: list(nvml.nvmlDeviceGetEccMode(handle))),
        "persistence_mode": _answer(lambda: nvml.nvmlDeviceGetPersistenceMode(handle)),
    }
    links: dict[str, Any] = {}
    refused: dict[str, list[int]] = {}  # why -> link numbers whose state NVML did not answer
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        state = _answer(lambda link=link: int(nvml.nvmlDeviceGetNvLinkState(handle, link)))
        if isinstance(state, str):
            refused.setdefault(state, []).append(link)
            continue
        version = _answer(lambda link=link: int(nvml.nvmlDeviceGetNvLinkVersion(handle, link)))
        counters = {
            name.lower(): _answer(
                lambda link=link, name=name: int(
                    nvml.nvmlDeviceGetNvLinkErrorCounter(
                        handle, link, getattr(nvml, f"NVML_NVLINK_ERROR_DL_{name}")
                    )
                )
            )
            for name in _DUMP_COUNTERS
            if hasattr(nvml, f"NVML_NVLINK_ERROR_DL_{name}")
        }
        links[str(link)] = {
            "active": state == int(getattr(nvml, "NVML_FEATURE_ENABLED", 1)),
            "version": nvlink_version_text(nvml, version) if isinstance(version, int) else version,
            "error_counters": counters,
        }
    gpu["links"] = links
    gpu["link_state_refused"] = {why: numbers for why, numbers in refused.items()}
    counts = sorted(name for name in dir(nvml) if name.startswith("NVML_FI_DEV_NVLINK_COUNT_"))
    scopes = [int(link) for link in links] or [0]  # no link: link 0 still shows why the fields fail
    values: dict[str, Any] = {}
    for name in _DUMP_GPU_FIELDS:
        values.update(_field_values(nvml, handle, name, [0]))
    for name in _DUMP_LINK_FIELDS:
        values.update(_field_values(nvml, handle, name, scopes))
    for name in counts:
        values.update(_field_values(nvml, handle, name, [*scopes, _AGGREGATE_SCOPE]))
    gpu["field_values"] = values
    for key, call, struct in (
        ("fabric_v", "nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
        ("fabric", "nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"),
    ):
        gpu[key] = _answer(lambda call=call, struct=struct: _fabric_dict(nvml, handle, call, struct))
    return gpu


def _fabric_dict(nvml: Any, handle: Any, call: str, struct: str) -> dict[str, Any]:
    info = getattr(nvml, struct)()
    getattr(nvml, call)(handle, nvml.byref(info))
    out = {
        "state": int(info.state),
        "status": int(info.status),
        "cluster_uuid": bytes(info.clusterUuid).hex(),
        "clique_id": int(info.cliqueId),
    }
    if hasattr(info, "healthMask"):
        out["health_mask"] = int(info.healthMask)
    return out


def dump_nvml(nvml: Any | None = None) -> dict[str, Any]:
    """Per GPU: its links (state, version, nvmlDeviceGetNvLinkErrorCounter), the NVLink field values per
    link ("NAME@link") and summed ("NAME@4294967295"), both fabric info calls, ECC and persistence mode; the
    driver, CUDA driver and nvidia-ml-py versions. ``nvml``: the module (tests: a fake), else ``pynvml``.
    Never raises."""
    try:
        if nvml is None:
            nvml = _nvml()
        else:
            nvml.nvmlInit()
    except Exception as exc:
        return {"nvml": False, "error": f"NVML unavailable ({_error_text(exc)})", "gpus": []}
    out: dict[str, Any] = {"nvml": True, "gpus": []}
    try:
        out["driver_version"] = _answer(nvml.nvmlSystemGetDriverVersion)
        out["cuda_driver_version"] = _answer(nvml.nvmlSystemGetCudaDriverVersion)
        out["nvidia_ml_py"] = _distribution_version("nvidia-ml-py")
        for index in range(int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except Exception as exc:
                out["gpus"].append({"index": index, "error": _short(exc)})
                continue
            out["gpus"].append({"index": index, **_dump_gpu(nvml, handle)})
    except Exception as exc:
        out["error"] = f"NVML query failed ({_error_text(exc)})"
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return out


def _distribution_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None

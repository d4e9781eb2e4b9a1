"""NVLink error counters read from NVML, and the skip reasons NVML's refusals become.

Two interfaces, both asked of every GPU (``read_nvlink_counters``): ``nvmlDeviceGetNvLinkErrorCounter``
(``NVLINK_COUNTERS``: the data-link replay / recovery / CRC counters of NVLink 4 and older; not supported on
NVLink 5) and the per-link field values ``NVML_FI_DEV_NVLINK_COUNT_*`` (``NVLINK5_COUNTERS``, scopeId = the
link: NVLink 5). A GPU answers one of the two; what it does not answer is a skip reason, and one starting
with ``NOT_SUPPORTED`` means "not on this GPU" (the judge tells that from "not readable"). A field value is
read only when its own ``nvmlReturn`` is success (nvml.h: the value is undefined otherwise).
"""

from __future__ import annotations

from typing import Any

from commbench.hardware.probes import _error_text

# NVLink data-link error counters (nvmlDeviceGetNvLinkErrorCounter): counter name -> NVML constant name.
NVLINK_COUNTERS = {
    "nvlink_replay": "NVML_NVLINK_ERROR_DL_REPLAY",
    "nvlink_recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
    "nvlink_crc_flit": "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "nvlink_crc_data": "NVML_NVLINK_ERROR_DL_CRC_DATA",
}
# NVLink 5 error counters (nvmlDeviceGetFieldValues, scopeId = link): counter name -> NVML field constant.
# The error and recovery fields of NVML_FI_DEV_NVLINK_COUNT_* (nvml.h; DCGM's NVLink 5 health watch reads the
# same); the packet / byte counts, the deprecated BER fields and the FEC histogram (corrected errors) are not
# errors and are left out.
NVLINK5_COUNTERS = {
    "nvlink_rx_errors": "NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS",
    "nvlink_rx_malformed": "NVML_FI_DEV_NVLINK_COUNT_MALFORMED_PACKET_ERRORS",
    "nvlink_rx_buffer_overrun": "NVML_FI_DEV_NVLINK_COUNT_BUFFER_OVERRUN_ERRORS",
    "nvlink_rx_remote": "NVML_FI_DEV_NVLINK_COUNT_RCV_REMOTE_ERRORS",
    "nvlink_rx_general": "NVML_FI_DEV_NVLINK_COUNT_RCV_GENERAL_ERRORS",
    "nvlink_link_integrity": "NVML_FI_DEV_NVLINK_COUNT_LOCAL_LINK_INTEGRITY_ERRORS",
    "nvlink_tx_discards": "NVML_FI_DEV_NVLINK_COUNT_XMIT_DISCARDS",
    "nvlink_symbol": "NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS",
    "nvlink_recovery_ok": "NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_SUCCESSFUL_EVENTS",
    "nvlink_recovery_failed": "NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS",
}
ALL_NVLINK_COUNTERS = (*NVLINK_COUNTERS, *NVLINK5_COUNTERS)
NOT_SUPPORTED = "not supported"  # the start of a skip reason for a call or field this GPU does not have
_SKIP_WORDS = {"NVMLError_NoPermission": "no permission", "NVMLError_NotSupported": NOT_SUPPORTED}
# nvmlFieldValue_t: the union member that holds each NVML_VALUE_TYPE_* (DOUBLE = 0 ... UNSIGNED_SHORT = 6).
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def skip_reason(nvml: Any, exc: BaseException) -> str:
    """A failed NVML call as a skip reason: "no permission (...)", "not supported (...)", else the error."""
    for name, words in _SKIP_WORDS.items():
        kind = getattr(nvml, name, None)
        if isinstance(kind, type) and isinstance(exc, kind):
            return f"{words} ({_error_text(exc)})"
    return _error_text(exc)


def field_number(nvml: Any, value: Any) -> int | None:
    """One nvmlFieldValue_t as an int (None when its own return code is not success)."""
    if int(value.nvmlReturn) != int(getattr(nvml, "NVML_SUCCESS", 0)):
        return None
    kind = int(value.valueType)
    return int(getattr(value.value, _VALUE_MEMBERS[kind])) if 0 <= kind < len(_VALUE_MEMBERS) else None


def _return_why(nvml: Any, code: int) -> str:
    """A field value's own NVML return code as a skip reason ("not supported (NVMLError_NotSupported: ...)"):
    pynvml's ``NVMLError(code)`` is the subclass of that code, as the binding raises it."""
    try:
        return skip_reason(nvml, nvml.NVMLError(code))
    except Exception:
        return f"NVML return code {code}"


def _legacy_nvlink(nvml: Any, handle: Any, links: list[int]) -> tuple[dict[str, Any], dict[str, str]]:
    """NVLINK_COUNTERS of ``links`` (nvmlDeviceGetNvLinkErrorCounter), and why any is missing."""
    values: dict[str, dict[int, int]] = {}
    skipped: dict[str, str] = {}
    for counter, constant in NVLINK_COUNTERS.items():
        per_link, why = {}, "no NVLink link to read"
        for link in links:
            try:
                per_link[link] = int(
                    nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, getattr(nvml, constant))
                )
            except Exception as exc:
                why = skip_reason(nvml, exc)
        if per_link:
            values[counter] = per_link
        else:
            skipped[counter] = why
    return values, skipped


def _nvlink5(nvml: Any, handle: Any, links: list[int]) -> tuple[dict[str, Any], dict[str, str]]:
    """NVLINK5_COUNTERS of ``links`` (one nvmlDeviceGetFieldValues call per counter, scopeId = link; each
    field's own return code decides), and why any is missing."""
    values: dict[str, dict[int, int]] = {}
    skipped: dict[str, str] = {}
    for counter, constant in NVLINK5_COUNTERS.items():
        field_id = getattr(nvml, constant, None)
        if field_id is None:  # nvidia-ml-py older than the NVLink 5 fields
            skipped[counter] = f"{NOT_SUPPORTED} by this nvidia-ml-py (it lacks the NVLink 5 field constants)"
            continue
        if not links:
            skipped[counter] = "no NVLink link to read"
            continue
        try:
            answers = nvml.nvmlDeviceGetFieldValues(handle, [(field_id, link) for link in links])
        except Exception as exc:
            skipped[counter] = skip_reason(nvml, exc)
            continue
        per_link, why = {}, ""
        for link, answer in zip(links, answers, strict=True):
            number = field_number(nvml, answer)
            if number is None:
                why = why or _return_why(nvml, int(answer.nvmlReturn))
            else:
                per_link[link] = number
        if per_link:
            values[counter] = per_link
        else:
            skipped[counter] = why or "no value"
    return values, skipped


def read_nvlink_counters(nvml: Any, handle: Any, links: list[int]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every NVLink error counter of ``links`` from both interfaces: counter -> link -> count (a counter
    that some links do not answer is kept for the links that do), and counter -> why it was not read."""
    legacy, skipped = _legacy_nvlink(nvml, handle, links)
    nvlink5, skipped5 = _nvlink5(nvml, handle, links)
    return {**legacy, **nvlink5}, {**skipped, **skipped5}

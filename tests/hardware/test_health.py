"""The per-rank health readers over a fake NVML: facts, skip reasons, counters before/after, Xid events."""

import json
import pickle
import sys
from types import SimpleNamespace

import pytest

from commbench.hardware.health import NO_GPU, GpuHealth, read_health, watch_counters
from commbench.hardware.nvlink_counters import NVLINK5_COUNTERS, NVLINK_COUNTERS
from tests.hardware.fake_nvml import (
    CLUSTER,
    CLUSTER_TEXT,
    GARBAGE,
    H100_LINK_MBPS,
    NVML_ERROR_NO_PERMISSION,
    NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS,
    NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS,
    NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_GPU_FABRIC_STATE_NOT_STARTED,
    NVML_NVLINK_ERROR_DL_CRC_FLIT,
    NVML_NVLINK_ERROR_DL_REPLAY,
    FakeGpu,
    FakeNvml,
    NVMLError_FunctionNotFound,
    NVMLError_LibraryNotFound,
    NVMLError_NoPermission,
    NVMLError_NotSupported,
    gpu_uuid,
    nvmlClocksEventReasonHwSlowdown,
    nvmlClocksEventReasonSwPowerCap,
)

NOT_SUPPORTED = "not supported (NVMLError_NotSupported: Not Supported)"  # pynvml's str() of the error


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch):
    # torch (CPU build) says nothing of CUDA devices here: ordinal N is NVML index N, as on a bare machine.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_a_healthy_gpu_reports_every_fact_and_nvml_is_closed_again():
    nvml = FakeNvml(2)
    health = read_health(1, nvml)
    assert (health.device, health.uuid, health.bus_id, health.nvml_index) == (1, gpu_uuid(1), "0000:29:00", 1)
    assert (health.gpu_name, health.host_gpu_count) == ("NVIDIA H200", 2)
    assert health.nvlink_active == tuple(range(18)) and health.nvlink_inactive == ()
    assert health.nvlink_speed_MBps == dict.fromkeys(range(18), H100_LINK_MBPS)
    assert (health.ecc_current, health.ecc_pending, health.persistence) == (True, True, True)
    assert (health.driver_version, health.cuda_driver_version) == ("580.82.07", "13.0")
    # A Hopper GPU: the fabric call is not supported; a CPU torch has no NCCL. Both say why.
    assert health.skipped["fabric"].startswith("not supported (NVMLError_NotSupported")
    assert health.nccl_version is None and health.skipped["nccl"] == "CUDA not available: no NCCL"
    assert set(health.skipped) == {"fabric", "nccl"}
    assert nvml.inits == 0


def test_the_gpu_is_found_by_uuid_not_by_ordinal(monkeypatch):
    import torch

    props = SimpleNamespace(name="NVIDIA H200", uuid=gpu_uuid(2)[4:])  # torch's bare spelling
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda ordinal: props)
    health = read_health(0, FakeNvml(4))
    assert (health.device, health.nvml_index, health.uuid) == (0, 2, gpu_uuid(2))
    props.uuid = "ffffffff-0000-0000-0000-000000000001"  # a GPU NVML does not see: no guessing
    missing = read_health(0, FakeNvml(4))
    assert missing.skipped == {"gpu": "GPU not found: CUDA device 0 is none of the 4 GPU(s) NVML sees"}


def test_a_link_down_is_named_and_its_speed_is_not_asked():
    health = read_health(0, FakeNvml([FakeGpu(0, down={7})]))
    assert health.nvlink_inactive == (7,) and len(health.nvlink_active) == 17
    assert 7 not in health.nvlink_speed_MBps and health.nvlink_speed_MBps[8] == H100_LINK_MBPS


def test_the_common_speed_stands_in_where_per_link_speed_is_not_reported():
    health = read_health(0, FakeNvml([FakeGpu(0, per_link_speed=False)]))
    assert health.nvlink_speed_MBps == {} and health.nvlink_common_speed_MBps == H100_LINK_MBPS
    failing = FakeGpu(0, fail={"nvmlDeviceGetFieldValues": NVMLError_NotSupported})
    health = read_health(0, FakeNvml([failing]))
    assert health.skipped["nvlink_speed"].startswith(
        "NVLink speed not readable (per-link speed: not supported"
    )
    assert "nvlink" not in health.skipped and len(health.nvlink_active) == 18


@pytest.mark.parametrize(
    ("function", "error", "fact", "reason"),
    [
        ("nvmlDeviceGetEccMode", NVMLError_NoPermission, "ecc", "no permission (NVMLError_NoPermission: "),
        ("nvmlDeviceGetPersistenceMode", NVMLError_NotSupported, "persistence", "not supported (NVMLError_"),
        (
            "nvmlDeviceGetNvLinkState",
            NVMLError_NoPermission,
            "nvlink",
            "NVLink state not readable: no permis",
        ),
    ],
)
def test_a_call_nvml_refuses_is_a_skip_reason(function, error, fact, reason):
    health = read_health(0, FakeNvml([FakeGpu(0, fail={function: error})]))
    assert health.skipped[fact].startswith(reason)
    assert (health.ecc_current is None) == (fact == "ecc")
    assert (health.persistence is None) == (fact == "persistence")
    assert (health.nvlink_active == ()) == (fact == "nvlink")
    assert health.driver_version == "580.82.07"  # the other facts are still read


def test_a_registered_fabric_gives_cluster_and_clique():
    fabric = (NVML_GPU_FABRIC_STATE_COMPLETED, 0, CLUSTER, 42)
    health = read_health(0, FakeNvml([FakeGpu(0, fabric=fabric)]))
    assert (health.fabric_state, health.fabric_status) == ("completed", 0)
    assert (health.fabric_cluster_uuid, health.fabric_clique_id) == (CLUSTER_TEXT, 42)


def test_a_cpu_rank_and_a_machine_without_nvml_skip_everything_with_the_reason(monkeypatch):
    assert read_health(None).skipped == {"gpu": NO_GPU}
    assert read_health(None).device == -1
    missing = read_health(0, FakeNvml(init_error=NVMLError_LibraryNotFound))
    assert missing.skipped["gpu"].startswith("NVML not available: NVMLError_LibraryNotFound")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the default: import pynvml fails
    assert read_health(0).skipped["gpu"].startswith("NVML not available: ")
    broken = read_health(0, FakeNvml(fail={"nvmlDeviceGetCount": RuntimeError}))
    assert broken.skipped["gpu"].startswith("NVML query failed: RuntimeError")


def test_pynvml_is_imported_lazily_by_default(monkeypatch):
    nvml = FakeNvml(1)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert read_health(0).uuid == gpu_uuid(0) and nvml.inits == 0


def test_health_is_picklable_and_json_plain():
    health = read_health(0, FakeNvml([FakeGpu(0, down={3})]))
    assert pickle.loads(pickle.dumps(health)) == health
    text = json.dumps(health.to_dict())
    assert json.loads(text)["nvlink_inactive"] == [3]
    assert GpuHealth(**{**health.to_dict(), "nvlink_inactive": (3,)}).nvlink_inactive == (3,)


def test_counters_before_and_after_see_increments_xids_and_slowdowns():
    nvml = FakeNvml(2)
    watch = watch_counters(1, nvml)
    before = watch.before
    assert before.when == "before" and before.total("nvlink_replay") == 0
    assert set(before.nvlink) == set(NVLINK_COUNTERS) and len(before.nvlink["nvlink_crc_flit"]) == 18
    assert (before.ecc_corrected, before.ecc_uncorrected, before.slowdowns) == (0, 0, ())
    assert before.nvlink_active == tuple(range(18))
    # An NVLink 4 GPU: the NVLink 5 fields answer NVML_ERROR_NOT_SUPPORTED each, and say so.
    assert before.skipped == dict.fromkeys(NVLINK5_COUNTERS, NOT_SUPPORTED)
    nvml.bump(1, NVML_NVLINK_ERROR_DL_CRC_FLIT, link=7, by=2)
    nvml.bump(1, NVML_NVLINK_ERROR_DL_REPLAY, link=3)
    nvml.bump(0, NVML_NVLINK_ERROR_DL_REPLAY, link=3, by=5)  # another rank's GPU
    nvml.raise_xid(1, 79)
    nvml.raise_xid(0, 48)
    nvml.gpus[1].ecc_errors[1] = 1
    nvml.gpus[1].clocks = nvmlClocksEventReasonHwSlowdown | nvmlClocksEventReasonSwPowerCap
    after = watch.finish()
    assert after.when == "after" and after.uuid == gpu_uuid(1) and after.bus_id == "0000:29:00"
    assert after.nvlink["nvlink_crc_flit"][7] == 2 and after.total("nvlink_crc_flit") == 2
    assert after.total("nvlink_replay") == 1
    assert after.xid_events == (79,)
    assert after.ecc_uncorrected == 1 and after.slowdowns == ("HW slowdown",)  # the power cap is normal
    assert watch.finish() is after
    assert nvml.inits == 0 and nvml.gpus[1].event_sets == []


def test_xid_events_before_the_watch_are_not_counted_and_the_drain_never_blocks():
    nvml = FakeNvml(1)
    nvml.gpus[0].event_sets.clear()
    nvml.raise_xid(0, 13)  # nobody registered yet: NVML delivers it to no one
    watch = watch_counters(0, nvml)
    assert watch.finish().xid_events == ()  # FakeNvml asserts every wait has a 0 ms timeout


@pytest.mark.parametrize("error", [NVMLError_NoPermission, NVMLError_NotSupported])
def test_xid_watch_refused_is_a_skip_reason_and_the_counters_are_still_read(error):
    nvml = FakeNvml([FakeGpu(0, fail={"nvmlDeviceRegisterEvents": error})])
    watch = watch_counters(0, nvml)
    after = watch.finish()
    words = "no permission" if error is NVMLError_NoPermission else "not supported"
    assert after.skipped["xid"] == f"Xid events not watched: {words} ({error.__name__}: {error()})"
    assert set(after.skipped) == {"xid", *NVLINK5_COUNTERS}
    assert after.total("nvlink_replay") == 0 and nvml.inits == 0


def test_counters_nvml_does_not_answer_are_skipped_with_the_reason():
    gpu = FakeGpu(
        0,
        fail={
            "nvmlDeviceGetNvLinkErrorCounter": NVMLError_NotSupported,
            "nvmlDeviceGetTotalEccErrors": NVMLError_NoPermission,
            "nvmlDeviceGetCurrentClocksEventReasons": NVMLError_NotSupported,
            "nvmlDeviceGetCurrentClocksThrottleReasons": NVMLError_NotSupported,
        },
    )
    before = watch_counters(0, FakeNvml([gpu])).before
    assert before.nvlink == {} and before.total("nvlink_replay") is None
    assert before.skipped["nvlink_crc_data"].startswith("not supported (")
    assert before.skipped["ecc_uncorrected"].startswith("no permission (")
    assert before.skipped["clocks"].startswith("not supported (")


def test_counters_of_a_cpu_rank_or_without_nvml_are_skipped():
    cpu = watch_counters(None)
    assert cpu.before.skipped == {"gpu": NO_GPU} and cpu.finish().skipped == {"gpu": NO_GPU}
    missing = watch_counters(0, FakeNvml(init_error=NVMLError_LibraryNotFound)).finish()
    assert missing.skipped["gpu"].startswith("NVML not available: NVMLError_LibraryNotFound")
    assert pickle.loads(pickle.dumps(missing)) == missing


def test_clock_reasons_fall_back_to_the_older_throttle_call():
    gpu = FakeGpu(0, clocks=nvmlClocksEventReasonHwSlowdown)
    gpu.fail["nvmlDeviceGetCurrentClocksEventReasons"] = AttributeError  # a binding without the new name
    before = watch_counters(0, FakeNvml([gpu])).before
    assert before.slowdowns == ("HW slowdown",) and "clocks" not in before.skipped


def test_an_nvlink5_gpu_reports_its_errors_through_the_per_link_field_values():
    """NVLink 5 (Blackwell): nvmlDeviceGetNvLinkErrorCounter is not supported (DCGM 4.6
    modules/health/DcgmHealthWatch.cpp: "Old NVLink error fields (Pre-Blackwell only, deprecated on
    Blackwell+)"); the errors are the NVML_FI_DEV_NVLINK_COUNT_* fields (pynvml.py:772-794) read with
    nvmlDeviceGetFieldValues (pynvml.py:5004: an int or a (fieldId, scopeId) tuple per entry, a
    c_nvmlFieldValue_t array back, pynvml.py:1537) with scopeId = link (DCGM 4.6
    dcgmlib/src/DcgmCacheManager.cpp: "Query NVML with scopeId = linkIndex for per-link value")."""
    nvml = FakeNvml([FakeGpu(0, nvlink=5, down={17})])
    watch = watch_counters(0, nvml)
    before = watch.before
    assert set(before.nvlink) == set(NVLINK5_COUNTERS)
    assert before.nvlink["nvlink_symbol"] == dict.fromkeys(range(18), 0)  # inactive link 17 read too
    assert before.skipped == dict.fromkeys(NVLINK_COUNTERS, NOT_SUPPORTED)
    nvml.bump_field(0, NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS, link=4, by=3)
    nvml.bump_field(0, NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS, link=9)
    after = watch.finish()
    assert after.nvlink["nvlink_symbol"][4] == 3 and after.total("nvlink_symbol") == 3
    assert after.total("nvlink_recovery_failed") == 1 and after.total("nvlink_rx_errors") == 0
    assert nvml.inits == 0


def test_a_field_refused_for_some_links_keeps_the_others_and_a_refused_value_is_never_read():
    """dcgm_nvml.h (nvmlFieldValue_t): "value is undefined if nvmlReturn != NVML_SUCCESS": the fake fills
    GARBAGE there, which must never reach a counter."""
    refused = {(NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS, 3): NVML_ERROR_NO_PERMISSION}
    refused |= {
        (NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS, link): NVML_ERROR_NO_PERMISSION for link in range(18)
    }
    before = watch_counters(0, FakeNvml([FakeGpu(0, nvlink=5, field_errors=refused)])).before
    assert sorted(before.nvlink["nvlink_rx_errors"]) == [link for link in range(18) if link != 3]
    assert (
        before.skipped["nvlink_symbol"] == "no permission (NVMLError_NoPermission: Insufficient Permissions)"
    )
    assert all(GARBAGE not in links.values() for links in before.nvlink.values())


def test_an_nvidia_ml_py_without_the_nvlink5_fields_says_so():
    missing = tuple(NVLINK5_COUNTERS.values())
    before = watch_counters(0, FakeNvml([FakeGpu(0, nvlink=5)], missing=missing)).before
    assert before.nvlink == {}
    assert before.skipped["nvlink_symbol"] == (
        "not supported by this nvidia-ml-py (it lacks the NVLink 5 field constants)"
    )
    assert before.skipped["nvlink_replay"] == NOT_SUPPORTED


def test_a_gpu_without_nvlink_has_no_link_to_read():
    """nvml.h (dcgm_nvml.h nvmlDeviceGetNvLinkState): NVML_ERROR_NOT_SUPPORTED "if the device doesn't support
    this feature", NVML_ERROR_INVALID_ARGUMENT "if device or link is invalid"."""
    pcie = FakeGpu(0, links=0)
    health = read_health(0, FakeNvml([pcie]))
    assert health.skipped["nvlink"] == f"NVLink state not readable: {NOT_SUPPORTED}"
    before = watch_counters(0, FakeNvml([pcie])).before
    assert before.nvlink == {} and before.nvlink_active == ()
    assert {before.skipped[c] for c in (*NVLINK_COUNTERS, *NVLINK5_COUNTERS)} == {"no NVLink link to read"}


def test_the_fabric_is_read_through_the_versioned_call_with_its_health_mask():
    """pynvml.py:7321-7331: nvmlDeviceGetGpuFabricInfo is "DEPRECATED: Use nvmlDeviceGetGpuFabricInfoV";
    the versioned call takes c_nvmlGpuFabricInfoV_t (v2: version set by its constructor, healthMask)."""
    gpu = FakeGpu(0, fabric=(NVML_GPU_FABRIC_STATE_NOT_STARTED, 0, b"", 0), health_mask=0x10)
    health = read_health(0, FakeNvml([gpu]))
    assert (health.fabric_state, health.fabric_cluster_uuid, health.fabric_health_mask) == (
        "not started",
        "",
        16,
    )
    old_binding = read_health(0, FakeNvml([gpu], missing=("nvmlDeviceGetGpuFabricInfoV",)))
    assert (old_binding.fabric_state, old_binding.fabric_health_mask) == ("not started", None)
    gpu.fail["nvmlDeviceGetGpuFabricInfoV"] = NVMLError_FunctionNotFound  # an older driver
    assert read_health(0, FakeNvml([gpu])).fabric_state == "not started"
    gpu.fail["nvmlDeviceGetGpuFabricInfoV"] = NVMLError_NoPermission  # a real refusal is not retried
    assert read_health(0, FakeNvml([gpu])).skipped["fabric"].startswith("no permission (")

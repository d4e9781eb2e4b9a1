"""Health findings from fake-NVML GPUs' counters before and after a run: each finding exact, naming rank,
host, GPU, counter and link; health.csv."""

import pytest

from commbench.hardware.health import NO_GPU, watch_counters
from commbench.hardware.nvlink_counters import NVLINK5_COUNTERS
from commbench.report.judge.counters import counter_elements, health_frame
from tests.hardware.fake_nvml import (
    NVML_ERROR_NO_PERMISSION,
    NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS,
    NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS,
    NVML_NVLINK_ERROR_DL_CRC_FLIT,
    NVML_NVLINK_ERROR_DL_REPLAY,
    FakeGpu,
    FakeNvml,
    NVMLError_NoPermission,
    nvmlClocksEventReasonHwThermalSlowdown,
)
from tests.report.judge.gpus import by_status, gather, hgx, nvl72, run_suite


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_unchanged_counters_pass_once_per_kind():
    before, after = run_suite(hgx(hosts=1, gpus=4))
    elements = counter_elements(before, after)
    assert {e.status for e in elements} == {"PASS"} and {e.group for e in elements} == {"health"}
    assert [e.name for e in elements] == [
        "NVLink error counters",
        "NVLink replay errors",
        "NVLink recovery errors",
        "NVLink CRC flit errors",
        "NVLink CRC data errors",
        "ECC corrected errors",
        "ECC uncorrected errors",
        "Xid errors",
        "clock slowdowns",
    ]  # the NVLink 5 counters are not supported on these NVLink 4 GPUs: not theirs, no SKIP
    assert elements[0].message == (
        "4 NVLink error counters read per link (nvmlDeviceGetNvLinkErrorCounter): ranks 0-3"
    )
    assert elements[1].message == "NVLink replay errors: no increase above 0 during the run: ranks 0-3"


def test_nvlink5_gpus_are_judged_by_their_field_value_counters():
    def errors(hosts):
        hosts["h1"].bump_field(2, NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS, 11, 4)
        hosts["h1"].bump_field(2, NVML_FI_DEV_NVLINK_COUNT_LINK_RECOVERY_FAILED_EVENTS, 3)

    elements = counter_elements(*run_suite(nvl72(hosts=2), errors))
    names = [e.name for e in elements]
    assert "NVLink replay errors" not in names and "NVLink symbol errors" in names
    assert elements[0].message == (
        "10 NVLink error counters read per link (NVML_FI_DEV_NVLINK_COUNT_* fields): ranks 0-7"
    )
    assert [e.message for e in by_status(elements, "FAIL")] == [
        "rank 6 (host h1, GPU 2 [0000:39:00]): NVLink symbol errors +4 during the run (0 -> 4) (link 11 +4)",
        "rank 6 (host h1, GPU 2 [0000:39:00]): NVLink failed link recoveries (link down) +1 during the run "
        "(0 -> 1) (link 3 +1)",
    ]


def test_a_gpu_with_active_links_and_no_readable_nvlink_counter_warns_never_skips_silently():
    """An NVLink 5 GPU read through an nvidia-ml-py without the NVML_FI_DEV_NVLINK_COUNT_* constants
    (pynvml.py:772-794 added them): nvmlDeviceGetNvLinkErrorCounter is not supported there and no field can
    be asked, so nothing watches its 18 active links. That WARNs; a GPU without NVLink SKIPs."""
    old_binding = tuple(NVLINK5_COUNTERS.values())
    blackwell = FakeNvml([FakeGpu(0, nvlink=5), FakeGpu(1, links=0)], missing=old_binding)
    elements = counter_elements(*run_suite({"h0": blackwell}))
    assert not by_status(elements, "FAIL")
    warned = by_status(elements, "WARN")
    assert [e.name for e in warned] == ["NVLink error counters: rank 0"]
    assert warned[0].message == (
        "rank 0 (host h0, GPU 0 [0000:19:00]): none of the NVLink error counters readable on a GPU with 18 "
        "active NVLink links (nvmlDeviceGetNvLinkErrorCounter: not supported (NVMLError_NotSupported: Not "
        "Supported) | NVML_FI_DEV_NVLINK_COUNT_* fields: not supported by this nvidia-ml-py (it lacks the "
        "NVLink 5 field constants)): NVLink errors during the run not checked"
    )
    assert (warned[0].measured, warned[0].limit, warned[0].unit) == (0, 14, "counters")
    assert "nvidia-ml-py" in warned[0].remedy
    skipped = {e.name: e.message for e in by_status(elements, "SKIP")}
    assert skipped == {
        "NVLink error counters: not checked": "NVLink error counters not checked on rank 1: no active NVLink "
        "link: no NVLink error to watch"
    }
    assert not any(e.name.startswith(("NVLink symbol", "NVLink replay")) for e in elements)


def test_a_crc_increment_fails_naming_gpu_counter_and_link():
    before, after = run_suite(
        hgx(hosts=1, gpus=4), lambda h: h["h0"].bump(1, NVML_NVLINK_ERROR_DL_CRC_FLIT, 7, 2)
    )
    failed = by_status(counter_elements(before, after), "FAIL")
    assert [(e.name, e.message) for e in failed] == [
        (
            "NVLink CRC flit errors: rank 1",
            "rank 1 (host h0, GPU 1 [0000:29:00]): NVLink CRC flit errors +2 during the run (0 -> 2) "
            "(link 7 +2)",
        )
    ]
    assert (failed[0].measured, failed[0].limit, failed[0].unit) == (2, 0, "errors")


def test_a_replay_increment_fails_and_the_tolerance_is_respected():
    def errors(hosts):
        hosts["h0"].bump(2, NVML_NVLINK_ERROR_DL_REPLAY, 0, 2)
        hosts["h0"].bump(2, NVML_NVLINK_ERROR_DL_REPLAY, 5, 1)

    before, after = run_suite(hgx(hosts=1, gpus=4), errors)
    failed = by_status(counter_elements(before, after), "FAIL")
    assert [e.message for e in failed] == [
        "rank 2 (host h0, GPU 2 [0000:39:00]): NVLink replay errors +3 during the run (0 -> 3) "
        "(link 0 +2, link 5 +1)"
    ]
    assert not by_status(counter_elements(before, after, max_increase=3), "FAIL")
    assert by_status(counter_elements(before, after, max_increase=2), "FAIL")[0].limit == 2


def test_ecc_uncorrected_fails_and_corrected_warns():
    def ecc(hosts):
        hosts["h0"].gpus[0].ecc_errors = {0: 5, 1: 1}

    elements = counter_elements(*run_suite(hgx(hosts=1, gpus=2), ecc))
    assert [(e.status, e.message) for e in by_status(elements, "FAIL") + by_status(elements, "WARN")] == [
        ("FAIL", "rank 0 (host h0, GPU 0 [0000:19:00]): ECC uncorrected errors +1 during the run (0 -> 1)"),
        ("WARN", "rank 0 (host h0, GPU 0 [0000:19:00]): ECC corrected errors +5 during the run (0 -> 5)"),
    ]


def test_an_xid_fails_with_its_number():
    before, after = run_suite(hgx(hosts=1, gpus=2), lambda h: h["h0"].raise_xid(1, 79))
    failed = by_status(counter_elements(before, after), "FAIL")
    assert [(e.name, e.message) for e in failed] == [
        (
            "Xid errors: rank 1",
            "rank 1 (host h0, GPU 1 [0000:29:00]): Xid critical error(s) during the run: Xid 79 "
            "(GPU fallen off the bus)",
        )
    ]


def test_a_clock_slowdown_warns():
    def hot(hosts):
        hosts["h0"].gpus[1].clocks = nvmlClocksEventReasonHwThermalSlowdown

    elements = counter_elements(*run_suite(hgx(hosts=1, gpus=2), hot))
    assert [e.message for e in by_status(elements, "WARN")] == [
        "rank 1 (host h0, GPU 1 [0000:29:00]): clocks slowed: HW thermal slowdown active after the run"
    ]
    assert not by_status(elements, "FAIL")


def test_refused_counters_skip_with_the_reason_never_fail():
    refused = {(NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS, link): NVML_ERROR_NO_PERMISSION for link in range(18)}
    hosts = {
        "h0": FakeNvml(
            [
                FakeGpu(
                    0,
                    nvlink=5,
                    field_errors=refused,
                    fail={"nvmlDeviceRegisterEvents": NVMLError_NoPermission},
                ),
                FakeGpu(1, nvlink=5),
            ]
        )
    }
    elements = counter_elements(*run_suite(hosts))
    assert not by_status(elements, "FAIL") and not by_status(elements, "WARN")
    skipped = {e.name: e.message for e in by_status(elements, "SKIP")}
    assert skipped["NVLink symbol errors: not checked"] == (
        "NVLink symbol errors not checked on rank 0: no permission (NVMLError_NoPermission: Insufficient "
        "Permissions)"
    )
    assert skipped["Xid errors: not checked"].startswith(
        "Xid errors not checked on rank 0: Xid events not watched: no permission ("
    )
    assert next(e for e in elements if e.name == "NVLink symbol errors").message.endswith("rank 1")
    assert next(e for e in elements if e.name == "Xid errors").message.endswith("rank 1")


def test_cpu_ranks_and_no_counters_skip():
    before, after = run_suite({})
    assert counter_elements(before, after)[0].message == "no counters gathered before and after the run"
    watches = [watch_counters(None) for _ in range(2)]
    elements = counter_elements([w.before for w in watches], [w.finish() for w in watches])
    assert [(e.group, e.name, e.status, e.message) for e in elements] == [
        ("health", "GPU counters: not checked", "SKIP", f"GPU counters not checked on ranks 0-1: {NO_GPU}")
    ]


def test_health_frame_has_one_row_per_rank_with_facts_and_counters():
    hosts = hgx(hosts=1, gpus=2, g0={})
    hosts["h0"].gpus[1].down = {7}
    healths = gather(hosts)
    before, after = run_suite(
        hosts, lambda h: (h["h0"].bump(1, NVML_NVLINK_ERROR_DL_REPLAY, 3, 4), h["h0"].raise_xid(1, 74))
    )
    frame = health_frame(healths, before, after)
    assert list(frame["rank"]) == [0, 1] and list(frame["host"]) == ["h0", "h0"]
    row = frame.iloc[1]
    assert (row["nvlink_active"], row["nvlink_inactive_links"], row["nvlink_min_speed_MBps"]) == (
        17,
        "7",
        26562,
    )
    assert (row["nvlink_replay_before"], row["nvlink_replay_after"], row["xid_events"]) == (0, 4, "74")
    assert row["driver_version"] == "580.82.07" and row["bus_id"] == "0000:29:00"
    assert row["nvlink_symbol_before"] is None  # an NVLink 5 counter: not on this NVLink 4 GPU
    assert "fabric: not supported" in row["skipped"]

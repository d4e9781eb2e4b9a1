"""Preflight and health findings from fake-NVML GPUs: each finding exact, naming rank, host, GPU and link."""

from dataclasses import replace

import pytest

from commbench.hardware.health import NO_GPU, read_health, watch_counters
from commbench.inputs.specs import load_spec, no_spec
from commbench.report.judge.preflight import NO_SPEC, counter_elements, health_frame, preflight_elements
from tests.hardware.fake_nvml import (
    CLUSTER,
    CLUSTER_TEXT,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_GPU_FABRIC_STATE_IN_PROGRESS,
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
    NVML_NVLINK_ERROR_DL_CRC_FLIT,
    NVML_NVLINK_ERROR_DL_REPLAY,
    FakeGpu,
    FakeNvml,
    NVMLError_NoPermission,
    NVMLError_NotSupported,
    nvmlClocksEventReasonHwThermalSlowdown,
)

HGX = load_spec("hgx-h200")
NVL72 = load_spec("gb300-nvl72")
NVLINK5_LINK_MBPS = 53125  # what NVML reports per NVLink 5 link (one way, raw): above 900 / 18 = 50 GB/s


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def gather(hosts, driver=None, nccl="2.27.3"):
    """Every rank's GpuHealth, rank order = host order then GPU order: ``hosts`` is host -> FakeNvml (one
    rank per GPU); ``driver`` host -> another driver version. NCCL as a CUDA torch would report it."""
    out = []
    for host, nvml in hosts.items():
        nvml.driver = (driver or {}).get(host, nvml.driver)
        for ordinal in range(len(nvml.gpus)):
            health = read_health(ordinal, nvml)
            skipped = {k: v for k, v in health.skipped.items() if k != "nccl"}
            out.append(replace(health, host=host, nccl_version=nccl, skipped=skipped))
    return out


def hgx(hosts=2, gpus=8, **gpu_options):
    """HGX H200 hosts: ``gpu_options`` as index -> FakeGpu options for host h1's GPUs (the one to break)."""
    made = {}
    for n in range(hosts):
        options = gpu_options if n == 1 else {}
        made[f"h{n}"] = FakeNvml([FakeGpu(i, **options.get(f"g{i}", {})) for i in range(gpus)])
    return made


def nvl72(hosts=18, clique=lambda host, gpu: 42, **gpu_options):
    fabric = NVML_GPU_FABRIC_STATE_COMPLETED, 0, CLUSTER
    made = {}
    for n in range(hosts):
        options = gpu_options if n == 1 else {}
        default = {"speed_MBps": NVLINK5_LINK_MBPS}
        gpus = [
            FakeGpu(i, **{**default, "fabric": (*fabric, clique(n, i)), **options.get(f"g{i}", {})})
            for i in range(4)
        ]
        made[f"h{n}"] = FakeNvml(gpus)
    return made


def by_status(elements, status):
    return [e for e in elements if e.status == status]


def test_a_healthy_nvl72_rack_passes_every_check_once():
    elements = preflight_elements(gather(nvl72()), NVL72)
    assert {e.status for e in elements} == {"PASS"}
    assert [e.name for e in elements] == [
        "GPUs per host",
        "GPUs per NVLink domain",
        "fabric clique",
        "NVLink links",
        "NVLink speed",
        "ECC mode",
        "persistence mode",
        "NVLink fabric",
        "driver version",
        "CUDA driver version",
        "NCCL version",
    ]
    links = elements[3]
    assert links.message == "18 of 18 NVLink links up: ranks 0-71"
    assert elements[4].message.startswith(
        "every active NVLink link at >= 50 GB/s per link (gb300-nvl72: 900 GB/s"
    )


def test_healthy_hgx_hosts_pass_and_the_fabric_check_says_the_domain_is_the_host():
    elements = preflight_elements(gather(hgx()), HGX)
    assert [e.name for e in by_status(elements, "SKIP")] == ["NVLink fabric: not checked"]
    assert "fabric info not readable: not supported" in by_status(elements, "SKIP")[0].message
    assert not by_status(elements, "FAIL") and not by_status(elements, "WARN")
    no_fabric = {
        h: FakeNvml([FakeGpu(i, fabric=(NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, 0, b"", 0)) for i in range(8)])
        for h in ("h0", "h1")
    }
    fabric = [e for e in preflight_elements(gather(no_fabric), HGX) if e.name.startswith("NVLink fabric")]
    assert [(e.status, e.message) for e in fabric] == [
        (
            "SKIP",
            "NVLink fabric not checked on ranks 0-15: no multi-node NVLink fabric on this GPU: "
            "the NVLink domain is the host",
        )
    ]


def test_one_link_down_fails_exactly_that_gpu_naming_the_link():
    elements = preflight_elements(gather(hgx(g1={"down": {7}})), HGX)
    failed = by_status(elements, "FAIL")
    assert [(e.group, e.name) for e in failed] == [("preflight", "NVLink links: rank 9")]
    assert failed[0].message == "rank 9 (host h1, GPU 1 [0000:29:00]): 17 of 18 NVLink links up (link 7 down)"
    assert (failed[0].measured, failed[0].limit, failed[0].unit) == (17, 18, "links")
    assert "nvidia-smi nvlink -s" in failed[0].remedy
    passed = next(e for e in elements if e.name == "NVLink links")
    assert passed.message == "18 of 18 NVLink links up: ranks 0-8, 10-15"


def test_links_missing_below_the_spec_count_are_named_down_too():
    elements = preflight_elements(gather(hgx(g2={"links": 16, "down": {3}})), HGX)
    failed = by_status(elements, "FAIL")
    assert [e.message for e in failed] == [
        "rank 10 (host h1, GPU 2 [0000:39:00]): 15 of 18 NVLink links up (links 3, 16, 17 down)"
    ]


def test_without_a_spec_a_reported_down_link_still_fails_and_speed_is_skipped():
    elements = preflight_elements(gather(hgx(g0={"down": {0}})), no_spec("no GPU spec: unknown GPU"))
    assert [e.name for e in by_status(elements, "FAIL")] == ["NVLink links: rank 8"]
    skipped = {e.name: e.message for e in by_status(elements, "SKIP")}
    assert skipped["GPUs per host: not checked"] == f"GPUs per host not checked on every host: {NO_SPEC}"
    assert skipped["NVLink speed: not checked"] == f"NVLink speed not checked on ranks 0-15: {NO_SPEC}"


def test_a_slow_link_warns_with_its_speed():
    elements = preflight_elements(gather(hgx(g3={"slow": {4: 13281}})), HGX)
    warned = by_status(elements, "WARN")
    assert [e.message for e in warned] == [
        "rank 11 (host h1, GPU 3 [0000:49:00]): NVLink link 4 at 13.3 GB/s < 25 GB/s per link "
        "(hgx-h200: 450 GB/s / 18 links)"
    ]
    assert (warned[0].measured, warned[0].limit, warned[0].unit) == (13281, 25000, "MB/s")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ecc": (0, 0)}, "ECC off"),
        ({"ecc": (0, 1)}, "ECC off (on after the next GPU reset)"),
        ({"ecc": (1, 0)}, "ECC on, but off after the next GPU reset (a change is pending)"),
        ({"persistence": 0}, "persistence mode off (the driver may unload between jobs; slower starts)"),
    ],
)
def test_ecc_off_or_pending_and_persistence_off_warn(options, message):
    elements = preflight_elements(gather(hgx(g5=options)), HGX)
    assert [e.message for e in by_status(elements, "WARN")] == [
        f"rank 13 (host h1, GPU 5 [0000:69:00]): {message}"
    ]
    assert not by_status(elements, "FAIL")


def test_mixed_driver_versions_fail_naming_the_odd_host():
    elements = preflight_elements(gather(hgx(hosts=3), driver={"h2": "570.86.10"}), HGX)
    failed = by_status(elements, "FAIL")
    assert [e.name for e in failed] == ["driver version"]
    assert failed[0].message == (
        "mixed driver versions in one job: 570.86.10 on host h2 (ranks 16-23); 580.82.07 on the other 16 "
        "rank(s)"
    )
    assert (failed[0].measured, failed[0].limit) == ("570.86.10", "580.82.07")


def test_mixed_nccl_versions_fail_too():
    healths = gather(hgx())
    healths[3] = replace(healths[3], nccl_version="2.21.5")
    failed = by_status(preflight_elements(healths, HGX), "FAIL")
    assert [e.message for e in failed] == [
        "mixed NCCL versions in one job: 2.21.5 on host h0 (rank 3); 2.27.3 on the other 15 rank(s)"
    ]


def test_a_host_with_fewer_gpus_than_the_spec_fails():
    hosts = hgx()
    hosts["h1"].gpus.pop()  # a GPU fell off the bus: NVML sees 7
    failed = by_status(preflight_elements(gather(hosts), HGX), "FAIL")
    assert [(e.name, e.message) for e in failed] == [
        ("GPUs per host: host h1", "host h1: 7 GPU(s) visible to NVML, hgx-h200 has 8 per host")
    ]
    assert (failed[0].measured, failed[0].limit) == (7, 8)


def test_a_job_on_fewer_ranks_than_gpus_still_counts_the_host_gpus():
    healths = gather(hgx())[:4]  # 4 ranks on host h0's 8 GPUs
    assert not by_status(preflight_elements(healths, HGX), "FAIL")


@pytest.mark.parametrize(
    ("error", "words"), [(NVMLError_NoPermission, "no permission"), (NVMLError_NotSupported, "not supported")]
)
def test_refused_calls_skip_with_the_reason_never_fail(error, words):
    hosts = hgx(g0={"fail": {"nvmlDeviceGetEccMode": error, "nvmlDeviceGetNvLinkState": error}})
    elements = preflight_elements(gather(hosts), HGX)
    assert not by_status(elements, "FAIL") and not by_status(elements, "WARN")
    skipped = {e.name: e.message for e in by_status(elements, "SKIP")}
    assert skipped["ECC mode: not checked"].startswith(f"ECC mode not checked on rank 8: {words} (")
    assert skipped["NVLink links: not checked"].startswith(
        f"NVLink links not checked on rank 8: NVLink state not readable: {words} ("
    )


def test_a_cpu_run_skips_every_check_with_the_reason():
    healths = [read_health(None) for _ in range(4)]
    elements = preflight_elements(healths, None)
    assert [(e.group, e.name, e.status, e.message) for e in elements] == [
        ("preflight", "GPU health: not checked", "SKIP", f"GPU health not checked on ranks 0-3: {NO_GPU}")
    ]
    one_cpu_rank = [*gather(hgx(hosts=1, gpus=2)), read_health(None)]
    by_name = {e.name: e.message for e in preflight_elements(one_cpu_rank, HGX)}
    assert by_name["NVLink links: not checked"] == f"NVLink links not checked on rank 2: {NO_GPU}"
    assert by_name["NVLink links"] == "18 of 18 NVLink links up: ranks 0-1"
    assert by_name["driver version"] == "driver version 580.82.07 on ranks 0-1 (1 host(s))"
    assert preflight_elements([], None)[0].message == "no rank reported its GPU health"


def test_fabric_not_registered_fails():
    fabric = (NVML_GPU_FABRIC_STATE_IN_PROGRESS, 0, b"", 0)
    failed = by_status(preflight_elements(gather(nvl72(g2={"fabric": fabric})), NVL72), "FAIL")
    assert [e.message for e in failed] == [
        "rank 6 (host h1, GPU 2 [0000:39:00]): NVLink fabric registration in progress (not completed)"
    ]


def test_a_host_split_over_two_cliques_and_a_rack_split_in_two_fail():
    elements = preflight_elements(
        gather(nvl72(clique=lambda host, gpu: 7 if host == 1 and gpu == 3 else 42)), NVL72
    )
    failed = {e.name: e.message for e in by_status(elements, "FAIL")}
    assert failed["fabric clique: host h1"] == (
        f"host h1: its GPUs are in 2 NVLink cliques (clique {CLUSTER_TEXT}:42, clique {CLUSTER_TEXT}:7)"
    )
    halves = preflight_elements(gather(nvl72(clique=lambda host, gpu: 1 if host < 9 else 2)), NVL72)
    assert [e.message for e in by_status(halves, "FAIL")] == [
        f"clique {CLUSTER_TEXT}:1 (9 host(s)) holds 36 GPUs, gb300-nvl72 has 72 per NVLink domain",
        f"clique {CLUSTER_TEXT}:2 (9 host(s)) holds 36 GPUs, gb300-nvl72 has 72 per NVLink domain",
    ]


def test_a_partial_rack_is_not_judged_per_domain():
    elements = preflight_elements(gather(nvl72(hosts=2)), NVL72)
    assert [e.message for e in by_status(elements, "SKIP")] == [
        f"GPUs per NVLink domain not checked on clique {CLUSTER_TEXT}:42: the job's hosts hold 8 of the "
        "domain's 72 GPUs (part of a domain: not judged)"
    ]
    assert not by_status(elements, "FAIL")


def test_the_callers_rank_names_are_used():
    elements = preflight_elements(
        gather(hgx(g1={"down": {7}})), HGX, names={9: "host h1, GPU 1 [0000:29:00], pid 7"}
    )
    assert by_status(elements, "FAIL")[0].message.startswith(
        "rank 9 (host h1, GPU 1 [0000:29:00], pid 7): 17 of 18"
    )


# --- counters before and after ------------------------------------------------------------------------------


def run_suite(hosts, during=lambda hosts: None):
    """Snapshots before and after ``during`` changes the fake GPUs; one watch per rank, ranks as gather's."""
    watches = []
    for host, nvml in hosts.items():
        for ordinal in range(len(nvml.gpus)):
            watches.append((host, watch_counters(ordinal, nvml)))
    during(hosts)
    before = [replace(w.before, host=h) for h, w in watches]
    after = [replace(w.finish(), host=h) for h, w in watches]
    return before, after


def test_unchanged_counters_pass_once_per_kind():
    before, after = run_suite(hgx(hosts=1, gpus=4))
    elements = counter_elements(before, after)
    assert {e.status for e in elements} == {"PASS"} and {e.group for e in elements} == {"health"}
    assert [e.name for e in elements] == [
        "NVLink replay errors",
        "NVLink recovery errors",
        "NVLink CRC flit errors",
        "NVLink CRC data errors",
        "ECC corrected errors",
        "ECC uncorrected errors",
        "Xid errors",
        "clock slowdowns",
    ]
    assert elements[0].message == "NVLink replay errors: no increase above 0 during the run: ranks 0-3"


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


def test_unreadable_counters_skip_with_the_reason_never_fail():
    hosts = {
        "h0": FakeNvml(
            [
                FakeGpu(
                    0,
                    fail={
                        "nvmlDeviceGetNvLinkErrorCounter": NVMLError_NotSupported,
                        "nvmlDeviceRegisterEvents": NVMLError_NoPermission,
                    },
                ),
                FakeGpu(1),
            ]
        )
    }
    elements = counter_elements(*run_suite(hosts))
    assert not by_status(elements, "FAIL")
    skipped = {e.name: e.message for e in by_status(elements, "SKIP")}
    assert skipped["NVLink replay errors: not checked"].startswith(
        "NVLink replay errors not checked on rank 0: not supported ("
    )
    assert skipped["Xid errors: not checked"].startswith(
        "Xid errors not checked on rank 0: Xid events not watched: no permission ("
    )
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
    assert "fabric: not supported" in row["skipped"]

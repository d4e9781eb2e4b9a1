"""Preflight findings from fake-NVML GPUs: each finding exact, naming rank, host, GPU and link."""

from dataclasses import replace

import pytest

from commbench.hardware.health import NO_GPU, read_health
from commbench.report.judge.preflight import NO_SPEC, preflight_elements
from tests.hardware.fake_nvml import (
    CLUSTER_TEXT,
    NVML_GPU_FABRIC_STATE_IN_PROGRESS,
    NVML_GPU_FABRIC_STATE_NOT_STARTED,
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
    FakeGpu,
    FakeNvml,
    NVMLError_NoPermission,
    NVMLError_NotSupported,
)
from tests.report.judge.gpus import HGX, NO_SPEC_YET, NVL72, by_status, gather, hgx, nvl72


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


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
            "NVLink fabric not checked on ranks 0-15: no multi-node NVLink fabric on this GPU; hgx-h200's "
            "NVLink domain is one host: the NVLink domain is the host",
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


def test_without_a_spec_a_link_down_warns_never_fails_and_speed_is_skipped():
    elements = preflight_elements(gather(hgx(g0={"down": {0}})), NO_SPEC_YET)
    assert not by_status(elements, "FAIL")
    assert [e.message for e in by_status(elements, "WARN")] == [
        f"rank 8 (host h1, GPU 0 [0000:19:00]): 17 of 18 NVLink links up (link 0 down); {NO_SPEC}: not "
        "judged as a failure"
    ]
    passed = next(e for e in elements if e.name == "NVLink links")
    assert passed.message == f"all 18 present NVLink links up ({NO_SPEC}): ranks 0-7, 9-15"
    skipped = {e.name: e.message for e in by_status(elements, "SKIP")}
    assert skipped["GPUs per host: not checked"] == f"GPUs per host not checked on every host: {NO_SPEC}"
    assert skipped["NVLink speed: not checked"] == f"NVLink speed not checked on ranks 0-15: {NO_SPEC}"


def test_a_single_gpu_vm_with_inactive_links_and_no_fabric_passes_without_a_spec():
    """The H200 test box: one GPU whose 18 NVLinks exist but are inactive (nvmlDeviceGetNvLinkState answers
    NVML_FEATURE_DISABLED for each) and whose fabric registration is NVML_GPU_FABRIC_STATE_NOT_STARTED
    (pynvml.py:7194). Without a spec nothing says links or a fabric are expected: SKIPs that say why."""
    vm = FakeNvml([FakeGpu(0, down=set(range(18)), fabric=(NVML_GPU_FABRIC_STATE_NOT_STARTED, 0, b"", 0))])
    elements = preflight_elements(gather({"vm": vm}), NO_SPEC_YET)
    assert not by_status(elements, "FAIL") and not by_status(elements, "WARN")
    skipped = {e.name: e.message for e in by_status(elements, "SKIP")}
    assert skipped["NVLink links: not checked"] == (
        f"NVLink links not checked on rank 0: 18 NVLink links present, none active; {NO_SPEC} (NVLink not "
        "in use here?)"
    )
    assert skipped["NVLink fabric: not checked"] == (
        f"NVLink fabric not checked on rank 0: NVLink fabric registration not started; {NO_SPEC}: the "
        "fabric is not judged"
    )
    # A spec that states 18 links per GPU judges them: 0 of 18 up is a FAIL there; the fabric of a
    # one-host domain is still not judged.
    with_spec = preflight_elements(gather({"vm": vm}), HGX)
    assert [e.name for e in by_status(with_spec, "FAIL")] == [
        "GPUs per host: host vm",
        "NVLink links: rank 0",
    ]
    assert next(e for e in with_spec if e.name == "NVLink fabric: not checked").message.endswith(
        "not started; hgx-h200's NVLink domain is one host: the fabric is not judged"
    )


def test_a_fabric_not_started_fails_where_the_domain_spans_hosts():
    fabric = (NVML_GPU_FABRIC_STATE_NOT_STARTED, 0, b"", 0)
    failed = by_status(preflight_elements(gather(nvl72(g0={"fabric": fabric})), NVL72), "FAIL")
    assert [e.message for e in failed] == [
        "rank 4 (host h1, GPU 0 [0000:19:00]): NVLink fabric registration not started (not completed)"
    ]


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

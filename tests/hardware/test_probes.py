"""What the machine shows about itself: NVML GPUs, NVLink and fabric clique, sysfs NICs, environment."""

import os
import re

import pytest
import torch

from commbench.hardware.probes import (
    RankPlace,
    discover_local,
    local_place,
    probe_env,
    probe_gpus,
    probe_nics,
)
from commbench.inputs.layout import build_layout
from tests.hardware.conftest import cuda_props, gpu_uuid
from tests.hardware.fake_nvml import CLUSTER_TEXT


def test_probe_gpus_reads_names_nvlink_and_the_fabric_clique(install_nvml):
    install_nvml(gpus=2)
    found = probe_gpus()
    assert found["nvml"] and "error" not in found
    assert (found["driver_version"], found["cuda_driver_version"]) == ("580.82.07", "13.0")
    first = found["gpus"][0]
    assert (first["index"], first["name"], first["uuid"]) == (0, "NVIDIA GB300", gpu_uuid(0))
    assert first["pci_bus_id"] == "00000000:19:00.0"
    # NVML's enum NVML_NVLINK_VERSION_5_0 is 7 (pynvml.py: 5 is NVLINK_VERSION_3_1): the probe says "5.0".
    assert (first["nvlink_links"], first["nvlink_links_active"], first["nvlink_version"]) == (3, 2, "5.0")
    assert (first["fabric_state"], first["fabric_cluster_uuid"], first["fabric_clique_id"]) == (
        "completed",
        CLUSTER_TEXT,
        42,
    )


@pytest.mark.parametrize(
    "options",
    [{"state": 2}, {"uuid": b""}, {"status": 1}],
    ids=["registration in progress", "zero cluster uuid", "bad status"],
)
def test_a_gpu_without_a_registered_clique_has_none(install_nvml, options):
    install_nvml(**options)
    gpu = probe_gpus()["gpus"][0]
    assert gpu["fabric_cluster_uuid"] == "" and gpu["fabric_clique_id"] == -1


def test_fabric_info_not_supported_and_no_links(install_nvml):
    install_nvml(links={}, fabric=False)  # NotSupported from both fabric calls and every link's state
    gpu = probe_gpus()["gpus"][0]
    assert gpu["fabric"] == "not reported (NVMLError_NotSupported: Not Supported)"
    assert (gpu["nvlink_links"], gpu["nvlink_links_active"], gpu["nvlink_version"]) == (0, 0, None)


def test_without_nvml_nothing_is_seen_and_the_notes_say_so(install_nvml):
    install_nvml(absent=True)
    found = probe_gpus()
    assert not found["nvml"] and found["gpus"] == [] and "NVML unavailable" in found["error"]
    local = discover_local()
    assert local["gpus"] == []
    assert any("cannot be seen" in note for note in local["notes"])
    assert local["nvlink_domains"] == [f"host:{local['host']}"]
    assert isinstance(local["env"], dict) and "torch" in local["libraries"]
    assert local_place(0).domain_key == f"host:{local['host']}"


def test_the_fabric_clique_is_the_nvlink_domain(install_nvml, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    install_nvml(gpus=4)
    found = discover_local()
    assert found["nvlink_domains"] == [f"fabric:{CLUSTER_TEXT}:42"]
    place = local_place(3)  # torch says nothing here (CPU build): ordinal 3 is NVML index 3
    assert (place.gpu_uuid, place.fabric_clique_id, place.bus_id) == (gpu_uuid(3), 42, "0000:49:00")
    assert place.domain_key == f"fabric:{CLUSTER_TEXT}:42"


def test_local_place_without_device_is_a_cpu_rank():
    place = local_place()
    assert place.gpu_uuid == "" and place.domain_key == f"host:{place.host}"
    assert (place.pid, place.device, place.bus_id, place.gpu_name) == (os.getpid(), -1, "", "")


@pytest.mark.parametrize("spelling", ["bare", "prefixed"])
def test_cuda_visible_devices_ordinals_are_matched_to_nvml_gpus_by_uuid(
    install_nvml, install_cuda, monkeypatch, spelling
):
    # Slurm gave this job physical GPUs 3 and 1: CUDA ordinal 0 is NVML index 3, ordinal 1 is NVML index 1.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    install_nvml(gpus=4)
    install_cuda({0: cuda_props(3, spelling), 1: cuda_props(1, spelling)})
    first, second = local_place(0), local_place(1)
    assert (first.device, first.gpu_uuid, first.bus_id) == (0, gpu_uuid(3), "0000:49:00")
    assert (second.device, second.gpu_uuid, second.bus_id) == (1, gpu_uuid(1), "0000:29:00")
    assert (first.gpu_name, first.pid, first.fabric_clique_id) == ("NVIDIA H200", os.getpid(), 42)


def test_the_pci_bus_id_finds_the_gpu_when_torch_has_no_uuid(install_nvml, install_cuda, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    install_nvml(gpus=4)
    install_cuda({0: cuda_props(2, uuid=None)})  # a torch without ``uuid``: domain/bus/device ids decide
    place = local_place(0)
    assert (place.gpu_uuid, place.bus_id, place.fabric_clique_id) == (gpu_uuid(2), "0000:39:00", 42)
    install_cuda({0: cuda_props(2, uuid="00000000-0000-0000-0000-000000000000")})  # all zero: none
    assert local_place(0).gpu_uuid == gpu_uuid(2)


def test_a_device_nvml_does_not_list_is_not_guessed(install_nvml, install_cuda, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    install_nvml(gpus=4)
    mig = "MIG-0c1d2e3f-4a5b-6c7d-8e9f-0a1b2c3d4e5f"  # a MIG instance: NVML's index handles are whole GPUs
    install_cuda({0: cuda_props(0, uuid=mig, pci=False)})
    place = local_place(0)
    assert (place.gpu_uuid, place.fabric_cluster_uuid, place.bus_id) == (mig, "", "")
    assert place.domain_key == f"host:{place.host}"


def test_without_torch_cuda_visible_devices_decides(install_nvml, monkeypatch):
    install_nvml(gpus=4)  # and torch answers nothing (the CPU build)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert local_place(0).gpu_uuid == gpu_uuid(3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000001")  # a UUID prefix, as CUDA accepts
    assert local_place(0).gpu_uuid == gpu_uuid(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0000000")  # ambiguous prefix: no guess
    assert local_place(0).gpu_uuid == ""
    assert local_place(5).gpu_uuid == ""  # beyond the visible devices


def test_rank_places_survive_the_layout_meta_round_trip():
    places = [
        RankPlace("a", gpu_uuid(r), pid=100 + r, device=r, bus_id="0000:19:00", gpu_name="NVIDIA H200")
        for r in range(2)
    ] + [RankPlace("b", pid=7)]
    layout = build_layout(3, discovered=places)
    meta = layout.to_meta()
    assert meta["places"][0] == {
        "host": "a",
        "gpu_uuid": gpu_uuid(0),
        "fabric_cluster_uuid": "",
        "fabric_clique_id": -1,
        "pid": 100,
        "device": 0,
        "bus_id": "0000:19:00",
        "gpu_name": "NVIDIA H200",
    }
    again = build_layout(3, discovered=meta["places"])
    assert list(again.places) == places and again.to_meta() == meta
    assert [p.domain_key for p in again.places] == ["host:a", "host:a", "host:b"]
    # A folder written before ranks said their pid and device: the fields take their defaults.
    old = build_layout(1, discovered=[{"host": "a", "gpu_uuid": "GPU-1"}]).places[0]
    assert (old.pid, old.device, old.bus_id, old.gpu_name) == (0, -1, "", "")


@pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA device")
def test_a_real_gpu_is_found_by_its_uuid():
    place = local_place(0)
    props = torch.cuda.get_device_properties(0)
    assert (place.device, place.pid, place.gpu_name) == (0, os.getpid(), props.name)
    assert re.fullmatch(r"[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}", place.bus_id), place.bus_id
    assert re.fullmatch(r"(GPU|MIG)-[0-9a-f-]+", place.gpu_uuid), place.gpu_uuid
    found = probe_gpus()
    if found["nvml"]:  # the NVML GPU with that UUID is at the same PCI address torch reports
        same = [g for g in found["gpus"] if g.get("uuid") == place.gpu_uuid]
        assert len(same) == 1, (place, found["gpus"])
        domain, bus, device = same[0]["pci_bus_id"].split(".")[0].split(":")
        assert f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}" == place.bus_id


def test_probe_nics_reads_sysfs(tmp_path):
    port = tmp_path / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    eth = tmp_path / "net" / "eth0"
    eth.mkdir(parents=True)
    (eth / "operstate").write_text("up\n")
    (eth / "speed").write_text("100000\n")
    (tmp_path / "net" / "lo").mkdir()
    nics = probe_nics(str(tmp_path))
    assert nics["rdma"] == [
        {
            "device": "mlx5_0",
            "port": "1",
            "state": "4: ACTIVE",
            "rate": "400 Gb/sec (4X NDR)",
            "link_layer": "InfiniBand",
        }
    ]
    assert nics["net"] == [{"name": "eth0", "state": "up", "speed_Mbps": 100000}]
    assert "rdma_note" not in nics
    assert "no RDMA devices" in probe_nics(str(tmp_path / "empty"))["rdma_note"]


def test_probe_env_keeps_relevant_variables():
    env = {"NCCL_DEBUG": "INFO", "NVSHMEM_BOOTSTRAP": "uid", "UCX_TLS": "rc", "HOME": "/root", "PATH": "/bin"}
    assert probe_env(env) == {"NCCL_DEBUG": "INFO", "NVSHMEM_BOOTSTRAP": "uid", "UCX_TLS": "rc"}

"""What the machine shows about itself: NVML GPUs, NVLink and fabric clique, sysfs NICs, environment."""

import pytest

from commbench.hardware.probes import discover_local, local_place, probe_env, probe_gpus, probe_nics

CLUSTER_TEXT = "01020304-0506-0708-090a-0b0c0d0e0f10"  # conftest.CLUSTER as NVML tools print it


def test_probe_gpus_reads_names_nvlink_and_the_fabric_clique(install_nvml):
    install_nvml(gpus=2)
    found = probe_gpus()
    assert found["nvml"] and "error" not in found
    assert (found["driver_version"], found["cuda_driver_version"]) == ("580.82.07", "13.0")
    first = found["gpus"][0]
    assert (first["index"], first["name"], first["uuid"]) == (0, "NVIDIA GB300", "GPU-0")
    assert (first["nvlink_links"], first["nvlink_links_active"], first["nvlink_version"]) == (3, 2, 5)
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
    install_nvml(links={}, fabric_error=RuntimeError("Not Supported"))
    gpu = probe_gpus()["gpus"][0]
    assert gpu["fabric"].startswith("not reported") and gpu["nvlink_links"] == 0


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


def test_the_fabric_clique_is_the_nvlink_domain(install_nvml):
    install_nvml(gpus=4)
    found = discover_local()
    assert found["nvlink_domains"] == [f"fabric:{CLUSTER_TEXT}:42"]
    place = local_place(3)
    assert (place.gpu_uuid, place.fabric_clique_id) == ("GPU-3", 42)
    assert place.domain_key == f"fabric:{CLUSTER_TEXT}:42"


def test_local_place_without_device_is_the_host():
    place = local_place()
    assert place.gpu_uuid == "" and place.domain_key == f"host:{place.host}"


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

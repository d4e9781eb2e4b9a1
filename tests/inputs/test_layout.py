import ctypes

import numpy as np
import pytest
import torch

from commbench.errors import UsageError
from commbench.hardware.probes import (
    RankPlace,
    _fabric_info,
    _nvlink_links,
    discover_local,
    local_place,
    probe_env,
    probe_nics,
)
from commbench.inputs.layout import build_layout, domain_of_rank, host_of_rank


def test_ranks_per_domain_override_stands_four_ranks_for_two_domains():
    layout = build_layout(4, ranks_per_domain=2)
    assert layout.domain_of_rank.tolist() == [0, 0, 1, 1]
    assert layout.host_of_rank.tolist() == [0, 0, 1, 1]  # a domain is one host unless told otherwise
    assert layout.source == "override" and layout.num_domains == 2
    assert domain_of_rank(4, ranks_per_domain=2).tolist() == [0, 0, 1, 1]


def test_hosts_nest_inside_domains():
    layout = build_layout(8, ranks_per_domain=4, ranks_per_host=2)
    assert layout.domain_of_rank.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.host_of_rank.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert host_of_rank(4, ranks_per_host=2).tolist() == [0, 0, 1, 1]
    with pytest.raises(UsageError, match="not a multiple of --ranks-per-host"):
        build_layout(8, ranks_per_domain=4, ranks_per_host=3)


def test_partial_last_domain_and_bad_sizes():
    assert domain_of_rank(4, ranks_per_domain=3).tolist() == [0, 0, 0, 1]
    with pytest.raises(UsageError, match="positive"):
        build_layout(4, ranks_per_domain=0)
    with pytest.raises(UsageError, match="world size"):
        build_layout(0)


def test_default_is_one_host_one_domain():
    layout = build_layout(3)
    assert layout.domain_of_rank.tolist() == [0, 0, 0] and layout.source == "default"


def test_discovered_fabric_clique_spans_hosts():
    cluster = "11111111-2222-3333-4444-555555555555"
    places = [
        RankPlace(host=h, fabric_cluster_uuid=cluster, fabric_clique_id=7) for h in ("a", "a", "b", "b")
    ]
    layout = build_layout(4, discovered=places)
    assert layout.domain_of_rank.tolist() == [0, 0, 0, 0]  # one NVL72-style domain over two hosts
    assert layout.host_of_rank.tolist() == [0, 0, 1, 1]
    other = [*places[:2], *(RankPlace(host="b", fabric_cluster_uuid=cluster, fabric_clique_id=8),) * 2]
    assert domain_of_rank(4, discovered=other).tolist() == [0, 0, 1, 1]  # another clique: another domain


def test_discovered_without_fabric_uses_hosts_and_accepts_dicts():
    places = [{"host": h} for h in ("n1", "n2", "n1", "n2")]
    assert domain_of_rank(4, discovered=places).tolist() == [0, 1, 0, 1]
    with pytest.raises(UsageError, match="got 3 rank places"):
        build_layout(4, discovered=places[:3])
    # An override wins over what was discovered.
    assert domain_of_rank(4, ranks_per_domain=4, discovered=places).tolist() == [0, 0, 0, 0]


def test_layout_describe():
    assert "2 x 2 ranks" in build_layout(4, ranks_per_domain=2).describe()
    assert "2 x 3 + 1 x 1" in build_layout(7, ranks_per_domain=3).describe()


class _FakeNvml:
    """Just enough of pynvml for the fabric and NVLink probes."""

    NVML_GPU_FABRIC_STATE_COMPLETED = 3
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, uuid=b"", clique=0, state=3, status=0, fabric_error=None, links=None):
        import pynvml

        self.c_nvmlGpuFabricInfo_t = pynvml.c_nvmlGpuFabricInfo_t
        self.byref = ctypes.byref
        self._fill = (uuid, clique, state, status)
        self._error = fabric_error
        self._links = links or {}

    def nvmlDeviceGetGpuFabricInfo(self, handle, ref):
        if self._error:
            raise self._error
        info = ref._obj
        uuid, clique, state, status = self._fill
        ctypes.memmove(info.clusterUuid, uuid.ljust(16, b"\0"), 16)
        info.cliqueId, info.state, info.status = clique, state, status

    def nvmlDeviceGetNvLinkState(self, handle, link):
        if link not in self._links:
            raise RuntimeError("NotSupported")
        return self._links[link]

    def nvmlDeviceGetNvLinkVersion(self, handle, link):
        return 5


def test_fabric_info_registered_clique():
    nvml = _FakeNvml(uuid=bytes(range(1, 17)), clique=42)
    info = _fabric_info(nvml, None)
    assert info["fabric_state"] == "completed"
    assert info["fabric_cluster_uuid"] == "01020304-0506-0708-090a-0b0c0d0e0f10"
    assert info["fabric_clique_id"] == 42


def test_fabric_info_not_registered_or_not_supported():
    assert _fabric_info(_FakeNvml(uuid=b"\1" * 16, state=2), None)["fabric_cluster_uuid"] == ""
    assert _fabric_info(_FakeNvml(uuid=b""), None)["fabric_clique_id"] == -1  # zero UUID: no fabric
    info = _fabric_info(_FakeNvml(fabric_error=RuntimeError("Not Supported")), None)
    assert info["fabric"].startswith("not reported")


def test_nvlink_link_counts():
    nvml = _FakeNvml(links={0: 1, 1: 1, 2: 0})
    assert _nvlink_links(nvml, None) == {"nvlink_links": 3, "nvlink_links_active": 2, "nvlink_version": 5}
    assert _nvlink_links(_FakeNvml(), None)["nvlink_links"] == 0


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


def test_local_place_without_device_is_the_host():
    place = local_place()
    assert place.gpu_uuid == "" and place.domain_key == f"host:{place.host}"


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the CPU-machine report")
def test_discover_local_on_cpu_says_what_it_cannot_see():
    found = discover_local()
    assert found["gpus"] == []
    assert any("cannot be seen" in note for note in found["notes"])
    assert found["nvlink_domains"] == [f"host:{found['host']}"]
    assert isinstance(found["env"], dict) and "torch" in found["libraries"]


def test_layout_arrays_are_int64():
    layout = build_layout(5, ranks_per_domain=2)
    assert layout.domain_of_rank.dtype == np.int64 and layout.host_of_rank.dtype == np.int64

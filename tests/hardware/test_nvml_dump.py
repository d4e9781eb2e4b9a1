"""The NVML dump (what a device check keeps of a real box) over the fake NVML: every link, counter, field
and fabric answer as NVML gives it, JSON-plain, never raising."""

import json

from commbench.hardware.nvml_dump import dump_nvml
from tests.hardware.fake_nvml import (
    H100_LINK_MBPS,
    NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS,
    NVML_GPU_FABRIC_STATE_NOT_STARTED,
    NVML_NVLINK_ERROR_DL_REPLAY,
    FakeGpu,
    FakeNvml,
    NVMLError_LibraryNotFound,
    gpu_uuid,
)


def test_the_nvml_dump_shows_every_link_counter_and_field_as_nvml_answers():
    """An NVLink 4 GPU with link 7 down: link states for the links NVML has (the rest InvalidArgument, as
    nvml.h says for an invalid link), the old error counters per link, the NVLink 5 fields NotSupported, the
    fabric NotSupported from both calls (pynvml.py:7321 and 7327)."""
    nvml = FakeNvml([FakeGpu(0, down={7})])
    nvml.bump(0, NVML_NVLINK_ERROR_DL_REPLAY, link=3, by=2)
    dump = dump_nvml(nvml)
    assert json.loads(json.dumps(dump)) == dump and nvml.inits == 0
    gpu = dump["gpus"][0]
    assert (gpu["name"], gpu["uuid"], gpu["ecc_mode"], gpu["persistence_mode"]) == (
        "NVIDIA H200",
        gpu_uuid(0),
        [1, 1],
        1,
    )
    assert sorted(gpu["links"], key=int) == [str(n) for n in range(18)]
    assert gpu["link_state_refused"] == {"InvalidArgument": list(range(18, 36))}
    assert gpu["links"]["7"]["active"] is False and gpu["links"]["3"]["version"] == "4.0"
    assert gpu["links"]["3"]["error_counters"] == {
        "replay": 2,
        "recovery": 0,
        "crc_flit": 0,
        "crc_data": 0,
        "ecc_data": 0,
    }
    fields = gpu["field_values"]
    assert fields["NVML_FI_DEV_NVLINK_GET_SPEED@0"] == H100_LINK_MBPS
    assert fields["NVML_FI_DEV_NVLINK_GET_STATE@7"] == 0 and fields["NVML_FI_DEV_NVLINK_LINK_COUNT@0"] == 18
    assert fields["NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS@0"] == "NotSupported"
    assert fields["NVML_FI_DEV_NVLINK_COUNT_SYMBOL_ERRORS@4294967295"] == "NotSupported"
    assert (gpu["fabric_v"], gpu["fabric"]) == ("NotSupported", "NotSupported")


def test_the_nvml_dump_of_an_nvlink5_gpu_has_the_count_fields_per_link_and_summed():
    gpu = FakeGpu(0, nvlink=5, fabric=(NVML_GPU_FABRIC_STATE_NOT_STARTED, 0, b"", 0), health_mask=4)
    nvml = FakeNvml([gpu])
    nvml.bump_field(0, NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS, link=2, by=3)
    nvml.bump_field(0, NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS, link=5, by=1)
    found = dump_nvml(nvml)["gpus"][0]
    fields = found["field_values"]
    assert fields["NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS@2"] == 3
    assert fields["NVML_FI_DEV_NVLINK_COUNT_RCV_ERRORS@4294967295"] == 4
    assert found["links"]["0"]["version"] == "5.0"
    assert set(found["links"]["0"]["error_counters"].values()) == {"NotSupported"}
    assert found["fabric_v"] == {
        "state": 1,
        "status": 0,
        "cluster_uuid": "0" * 32,
        "clique_id": 0,
        "health_mask": 4,
    }
    assert "health_mask" not in found["fabric"] and found["fabric"]["state"] == 1


def test_the_nvml_dump_without_nvml_or_nvlink_says_why():
    missing = dump_nvml(FakeNvml(init_error=NVMLError_LibraryNotFound))
    assert missing["nvml"] is False and missing["error"].startswith(
        "NVML unavailable (NVMLError_LibraryNotFound"
    )
    pcie = dump_nvml(FakeNvml([FakeGpu(0, links=0)]))["gpus"][0]
    assert pcie["links"] == {} and pcie["link_state_refused"] == {"NotSupported": list(range(36))}
    assert pcie["field_values"]["NVML_FI_DEV_NVLINK_GET_STATE@0"] == "NotSupported"

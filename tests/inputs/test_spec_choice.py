"""The spec chosen from detected hardware facts, and the line that says how."""

from __future__ import annotations

import pytest

from commbench.inputs.spec_choice import (
    CPU_RUN_TEXT,
    HardwareFacts,
    choose_spec,
    describe_choice,
    facts_from_probe,
)
from commbench.inputs.specs import list_specs

CLIQUE = "5b3c1d2e-0000-4000-8000-000000000001"


def _facts(name: str, count: int, links: int = 18, clique: str = "", per_host: int = 0) -> HardwareFacts:
    return HardwareFacts(
        gpu_names=(name,) * count,
        nvlink_links=(links,) * count,
        fabric_cluster_uuids=(clique,) * count,
        gpus_per_host=per_host or count,
    )


@pytest.mark.parametrize(
    ("facts", "spec", "said"),
    [
        (_facts("NVIDIA GB300", 4, clique=CLIQUE), "gb300-nvl72", "in an NVLink fabric clique (NVL72)"),
        (_facts("NVIDIA GB300", 4), "gb300-nvl72", "NO NVLink fabric clique reported"),
        (_facts("NVIDIA GB200", 4, clique=CLIQUE), "gb200-nvl72", "4 x NVIDIA GB200, 18 NVLink links"),
        (_facts("NVIDIA B200", 4, clique=CLIQUE), "gb200-nvl72", "4 per host (a tray)"),
        (_facts("NVIDIA B200", 8), "hgx-b200", "8 x NVIDIA B200, 18 NVLink links per GPU -> hgx-b200"),
        (_facts("NVIDIA H100 80GB HBM3", 8), "hgx-h100", "8 x NVIDIA H100 80GB HBM3"),
        (_facts("NVIDIA H100 SXM5 80GB", 8, links=0), "hgx-h100", "NVLink links not reported"),
        (_facts("NVIDIA H200", 8), "hgx-h200", "-> hgx-h200"),
        (_facts("NVIDIA H800", 8, links=8), "hgx-h800", "8 NVLink links per GPU -> hgx-h800"),
    ],
)
def test_known_gpus_choose_their_spec(facts, spec, said):
    choice = choose_spec(facts)
    assert choice.name == spec and spec in list_specs()
    assert said in choice.how and "\n" not in choice.how


@pytest.mark.parametrize(
    ("facts", "said"),
    [
        (_facts("NVIDIA A100-SXM4-80GB", 8, links=12), "8 x NVIDIA A100-SXM4-80GB: no catalogue spec"),
        (_facts("NVIDIA GH200 480GB", 1), "NVIDIA GH200 480GB: no catalogue spec"),
        (_facts("NVIDIA B300 SXM6 AC", 8), "NVIDIA B300 SXM6 AC: no catalogue spec"),
        (_facts("NVIDIA L40S", 4, links=0), "NVIDIA L40S: no catalogue spec"),
        (_facts("Tesla V100-SXM2-32GB", 8, links=6), "Tesla V100-SXM2-32GB: no catalogue spec"),
        (_facts("NVIDIA H100 PCIe", 2, links=0), "a PCIe/NVL card"),
        (_facts("NVIDIA H100 NVL", 2, links=12), "a PCIe/NVL card"),
        (_facts("NVIDIA H200 NVL", 2, links=12), "a PCIe/NVL card"),
        (_facts("NVIDIA H800 PCIe", 8, links=0), "a PCIe/NVL card"),
        (_facts("NVIDIA H100 80GB HBM3", 8, links=8), "8 NVLink links per GPU, but hgx-h100 has 18"),
        (
            HardwareFacts(gpu_names=("NVIDIA H100 80GB HBM3", "NVIDIA H200")),
            "mixed GPUs (NVIDIA H100 80GB HBM3, NVIDIA H200)",
        ),
    ],
)
def test_unknown_or_ambiguous_gpus_choose_none_and_say_use_spec(facts, said):
    choice = choose_spec(facts)
    assert choice.name is None
    assert said in choice.how and "--spec" in choice.how


def test_no_gpu_is_a_cpu_run_with_no_spec():
    choice = choose_spec(HardwareFacts())
    assert choice == (None, CPU_RUN_TEXT)
    assert CPU_RUN_TEXT == (
        "CPU run: no GPU found, figures measure this host's memory and loopback, not a GPU fabric"
    )
    assert describe_choice(choice) == f"spec: none ({CPU_RUN_TEXT})"


def test_cuda_devices_that_nvml_cannot_name_are_not_a_cpu_run():
    choice = choose_spec(
        HardwareFacts(cuda_devices=2, nvml_error="NVML unavailable (NVMLError_LibraryNotFound)")
    )
    assert choice.name is None
    assert "2 CUDA device(s) but NVML named none" in choice.how and "LibraryNotFound" in choice.how
    assert "pass --spec" in choice.how


def test_spec_option_overrides_and_keeps_what_was_detected():
    choice = choose_spec(_facts("NVIDIA H100 80GB HBM3", 8), override="gb300-nvl72")
    assert choice.name == "gb300-nvl72"
    assert choice.how == "--spec gb300-nvl72 (given; detected: hgx-h100)"
    cpu = choose_spec(HardwareFacts(), override="hgx-h200")
    assert cpu.name == "hgx-h200" and CPU_RUN_TEXT in cpu.how
    assert describe_choice(choice).startswith("spec: gb300-nvl72 (--spec gb300-nvl72")


def test_facts_from_the_nvml_probe():
    probe = {
        "nvml": True,
        "gpus": [
            {"index": 0, "name": "NVIDIA GB300", "nvlink_links": 18, "fabric_cluster_uuid": CLIQUE},
            {"index": 1, "name": "NVIDIA GB300", "nvlink_links": 18, "fabric_cluster_uuid": CLIQUE},
            {"index": 2, "name": "? (NVMLError: Unknown)", "nvlink_links": 0},
        ],
    }
    facts = facts_from_probe(probe, cuda_devices=3)
    assert facts.gpu_names == ("NVIDIA GB300", "NVIDIA GB300")
    assert facts.fabric_cluster_uuids == (CLIQUE, CLIQUE) and facts.gpus_per_host == 3
    assert choose_spec(facts).name == "gb300-nvl72"
    cpu = facts_from_probe({"nvml": False, "gpus": [], "error": "NVML unavailable (no driver)"})
    assert choose_spec(cpu) == (None, CPU_RUN_TEXT)

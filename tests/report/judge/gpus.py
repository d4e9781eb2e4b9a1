"""Fake-NVML GPU jobs for the preflight and health judges: HGX H200 hosts and GB300 NVL72 trays, each rank's
GpuHealth as the rank reads it, and counter snapshots before and after a change to the fake GPUs."""

from dataclasses import replace

from commbench.hardware.health import read_health, watch_counters
from commbench.inputs.specs import load_spec, no_spec
from tests.hardware.fake_nvml import (
    CLUSTER,
    NVLINK5_LINK_MBPS,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    FakeGpu,
    FakeNvml,
)

HGX = load_spec("hgx-h200")
NVL72 = load_spec("gb300-nvl72")
NO_SPEC_YET = no_spec("no GPU spec: unknown GPU")


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
        default = {"speed_MBps": NVLINK5_LINK_MBPS, "nvlink": 5, "name": "NVIDIA GB300"}
        gpus = [
            FakeGpu(i, **{**default, "fabric": (*fabric, clique(n, i)), **options.get(f"g{i}", {})})
            for i in range(4)
        ]
        made[f"h{n}"] = FakeNvml(gpus)
    return made


def by_status(elements, status):
    return [e for e in elements if e.status == status]


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

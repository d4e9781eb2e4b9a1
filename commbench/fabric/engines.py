"""Transfer engines and the model's physical parameters (``calibration.yaml``'s ``parameters``, each sourced).

An engine is how a library moves a phase's bytes (docs/fabric-model.md, "Transfer engines"):

- ``nccl``: host-initiated collectives (NCCL all-to-all(v) as grouped send/recv). Every peer costs a
  per-message latency in sequence on each resource, plus one fixed phase latency.
- ``normal``: GPU-initiated throughput kernels (DeepEP normal, Hybrid-EP, UCCL-EP normal), which send each
  token once per destination node over the NIC and fan it out over NVLink there (``--send-mode node``). All
  peers are in flight at once, so the per-peer latency overlaps (one message latency, not one per peer);
  the kernel runs on ``sms`` SMs, each moving at most ``per_sm_GBps``. A phase that crosses the NIC also pays
  the internode notify (``normal.scaleout_latency_us``: counts exchanged over RDMA, the nodes synchronized).
- ``low-latency``: GPU-initiated per-selection messages (DeepEP low-latency, pplx, UCCL-EP low-latency):
  one message per (token, expert), issued in parallel, each from the GPU's own NIC (no PXN hop). Latency is
  a fixed kernel latency + the busiest link's bytes, nearly flat in EP size.

Each library's kernels (``LIBRARIES``) run an engine with their own fixed latency and SM speed, factors on
DeepEP's: pplx-kernels' low-latency kernels take several times DeepEP's fixed time, Hybrid-EP moves about
twice DeepEP's bytes per SM. A library's combine kernel may have its own fixed latency, a factor on its
dispatch's: TensorRT-LLM's one-sided NVLink combine takes ~1.7x its dispatch at one token, where both move
next to no bytes (its combine waits for every expert's output, then reduces the top-k rows).

The scale-out transport sets the NIC efficiency and a per-message cost: InfiniBand and RoCE messages are
posted by the NIC's hardware queues (negligible per message at these sizes); EFA is driven through a CPU proxy
(UCCL-EP) or libfabric, which pays a per-message cost, shared by the GPU's NICs in parallel. A CUDA-graph
replay has no per-call launch cost. Every value, its unit and its source live in ``calibration.yaml``; the
fitted ones say what they were fitted on.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from commbench.inputs.userfiles import load_package_yaml

KERNELS = ("nccl", "normal", "low-latency")
# The libraries whose kernels the GPU-initiated engines stand for. DeepEP is the reference: the engines'
# own latency and SM figures are its kernels' (most of the published figures); every other library's kernel
# has its own fixed latency (notify, barriers, its proxy) and its own bytes per SM, each a factor on
# DeepEP's (``library.<name>.latency_factor``, ``library.<name>.sm_speed`` in calibration.yaml, 1 where no
# figure of the library constrains it).
LIBRARIES = ("deepep", "deepep-v2", "hybrid-ep", "uccl-ep", "pplx", "trtllm", "nccl-ep")
REFERENCE_LIBRARY = LIBRARIES[0]
# The send mode each engine moves (traffic.pattern.SEND_MODES): what its bytes per link are.
KERNEL_SEND_MODE = {"nccl": "token", "normal": "node", "low-latency": "selection"}


@dataclass(frozen=True)
class Parameter:
    """One physical parameter: its value in SI units (seconds, bytes/s as GB/s, fractions), and its source."""

    name: str
    value: float
    unit: str
    source: str
    fitted: bool = False  # fitted on the calibration cases (the source names them) rather than a datasheet


def _read_parameters() -> dict[str, Parameter]:
    table = {}
    entries = load_package_yaml("commbench.fabric", "calibration.yaml").get("parameters") or {}
    for name, entry in entries.items():
        table[name] = Parameter(
            name, float(entry["value"]), str(entry["unit"]), str(entry["source"]), bool(entry.get("fitted"))
        )
    return table


@functools.lru_cache(maxsize=1)
def parameters() -> dict[str, Parameter]:
    """The parameter table of ``calibration.yaml`` by name (``scaleout_efficiency.efa``, ...)."""
    return _read_parameters()


def table_values() -> dict[str, float]:
    """Every parameter's value by name, in the unit calibration.yaml states (us, GB/s, fraction, count)."""
    return {name: entry.value for name, entry in parameters().items()}


class LibraryFactors(NamedTuple):
    """A library's kernels against DeepEP's: fixed latency and bytes per SM, its combine's fixed latency
    against its own dispatch's, and its combine's bytes per SM against DeepEP's combine's."""

    latency: float = 1.0
    sm_speed: float = 1.0
    combine_latency: float = 1.0
    combine_sm_speed: float = 1.0  # x DeepEP's combine_sm_speed


def library_factors(library: str, values: Mapping[str, float]) -> LibraryFactors:
    """``library``'s factors from ``values`` (calibration.yaml's ``library.<name>.*``); all 1 for DeepEP and
    for a factor the table does not carry."""
    if library == REFERENCE_LIBRARY:
        return LibraryFactors()
    return LibraryFactors(
        float(values.get(f"library.{library}.latency_factor", 1.0)),
        float(values.get(f"library.{library}.sm_speed", 1.0)),
        float(values.get(f"library.{library}.combine_latency_factor", 1.0)),
        float(values.get(f"library.{library}.combine_sm_speed", 1.0)),
    )


def engine_defaults(
    kernel: str,
    transport: str,
    table: Mapping[str, float] | None = None,
    library: str = REFERENCE_LIBRARY,
) -> dict[str, Any]:
    """FabricParams values of an engine on a transport as ``library``'s kernels run it (us -> s), from
    ``table`` (a fit's values) or the parameter table of ``calibration.yaml``."""
    values = table_values() if table is None else {**table_values(), **table}

    def value(name: str) -> float:
        return values[name]

    us = 1e-6
    factors = library_factors(library, values) if kernel != "nccl" else LibraryFactors()
    return {
        "nvlink_efficiency": value("nvlink_efficiency"),
        "scaleout_efficiency": value(f"scaleout_efficiency.{transport}"),
        "phase_latency_s": value("nccl.phase_latency_us") * us,
        "nvlink_peer_latency_s": value("nccl.nvlink_peer_latency_us") * us,
        "scaleout_peer_latency_s": value("nccl.scaleout_peer_latency_us") * us,
        "kernel_latency_s": (
            value(f"{kernel}.kernel_latency_us") * us * factors.latency if kernel != "nccl" else 0.0
        ),
        # A phase over the NIC: the kernel's internode notify (only normal kernels state one).
        "scaleout_kernel_latency_s": values.get(f"{kernel}.scaleout_latency_us", 0.0) * us * factors.latency,
        "combine_latency_factor": factors.combine_latency,
        "sms": int(value(f"{kernel}.sms")) if kernel != "nccl" else 0,
        "per_sm_GBps": value("per_sm_GBps") * factors.sm_speed,
        "row_cost_s": value("row_cost_us") * us / factors.sm_speed,
        "combine_sm_speed": value("combine_sm_speed") * factors.combine_sm_speed,
        "message_cost_s": value(f"message_cost_us.{transport}") * us,
        "launch_s": value("launch_us") * us,
        "rows_per_message": value("normal.rows_per_message") if kernel == "normal" else 1.0,
    }

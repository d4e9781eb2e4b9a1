"""What this machine shows about itself: GPUs (NVML), NVLink, fabric clique, NICs, libraries.

Every probe here is lazy (``pynvml`` is imported only when called) and failure tolerant: what cannot be seen
is reported as such, never raised.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

ENV_PREFIXES = (
    "NCCL_",
    "NVSHMEM_",
    "UCX_",
    "CUDA_VISIBLE_DEVICES",
    "TORCH_NCCL_",
    "GLOO_",
    "MASTER_",
    "OMPI_",
)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs, as that rank sees it (gathered from every rank by the harness)."""

    host: str
    gpu_uuid: str = ""
    fabric_cluster_uuid: str = ""  # multi-node NVLink domain (NVL72 rack); "" when the GPU reports none
    fabric_clique_id: int = -1

    @property
    def domain_key(self) -> str:
        """Ranks with equal keys share an NVLink domain: the fabric clique where one exists, else the host."""
        if self.fabric_cluster_uuid:
            return f"fabric:{self.fabric_cluster_uuid}:{self.fabric_clique_id}"
        return f"host:{self.host}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nvml() -> Any:
    import pynvml  # lazy: absent or useless on CPU machines

    pynvml.nvmlInit()
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fabric_info(nvml: Any, handle: Any) -> dict[str, Any]:
    """GPU fabric (multi-node NVLink) registration: cluster UUID + clique id identify the NVLink domain."""
    try:
        info = nvml.c_nvmlGpuFabricInfo_t()
        nvml.nvmlDeviceGetGpuFabricInfo(handle, nvml.byref(info))
    except Exception as exc:  # NotSupported on GPUs without a multi-node NVLink fabric
        return {"fabric": f"not reported ({_error_text(exc)})"}
    states = {
        getattr(nvml, "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED", 0): "not supported",
        getattr(nvml, "NVML_GPU_FABRIC_STATE_NOT_STARTED", 1): "not started",
        getattr(nvml, "NVML_GPU_FABRIC_STATE_IN_PROGRESS", 2): "in progress",
        getattr(nvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3): "completed",
    }
    uuid_bytes = bytes(info.clusterUuid)
    cluster = uuid_bytes.hex() if any(uuid_bytes) else ""
    if cluster:
        h = cluster
        cluster = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    state = states.get(int(info.state), str(int(info.state)))
    registered = state == "completed" and int(info.status) == 0 and bool(cluster)
    return {
        "fabric_state": state,
        "fabric_cluster_uuid": cluster if registered else "",
        "fabric_clique_id": int(info.cliqueId) if registered else -1,
    }


def _nvlink_links(nvml: Any, handle: Any) -> dict[str, Any]:
    """Links that exist (state query answered) and how many are active, with the NVLink version."""
    present = active = 0
    version = None
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except Exception:
            continue
        present += 1
        if int(state) == 1:
            active += 1
            if version is None:
                try:
                    version = int(nvml.nvmlDeviceGetNvLinkVersion(handle, link))
                except Exception:
                    version = None
    return {"nvlink_links": present, "nvlink_links_active": active, "nvlink_version": version}


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().rstrip(":")


def probe_gpus() -> dict[str, Any]:
    """GPUs seen by NVML with NVLink state and fabric info: the one NVML probe (topology and report).

    ``nvml`` says whether NVML started at all; ``error`` says why nothing, or not everything, could be seen.
    """
    try:
        nvml = _nvml()
    except Exception as exc:
        return {
            "nvml": False,
            "gpus": [],
            "error": f"NVML unavailable ({_error_text(exc)}); no NVIDIA driver on this machine?",
        }
    out: dict[str, Any] = {"nvml": True, "gpus": []}
    try:
        out["driver_version"] = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
            out["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except Exception:
            pass
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpu: dict[str, Any] = {"index": index}
            for key, fn in (
                ("name", nvml.nvmlDeviceGetName),
                ("uuid", nvml.nvmlDeviceGetUUID),
                ("pci_bus_id", lambda h: nvml.nvmlDeviceGetPciInfo(h).busId),
            ):
                try:
                    gpu[key] = _text(fn(handle))
                except Exception as exc:
                    gpu[key] = f"? ({_error_text(exc)})"
            gpu.update(_nvlink_links(nvml, handle))
            gpu.update(_fabric_info(nvml, handle))
            out["gpus"].append(gpu)
    except Exception as exc:
        out["error"] = f"NVML query failed ({_error_text(exc)})"
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return out


def local_place(device_index: int | None = None) -> RankPlace:
    """This process's place: host name, and the GPU's UUID and fabric clique when NVML can see them."""
    host = socket.gethostname()
    if device_index is None:
        return RankPlace(host=host)
    gpus = probe_gpus().get("gpus", [])
    gpu = next((g for g in gpus if g.get("index") == device_index), None)
    if gpu is None:
        return RankPlace(host=host)
    return RankPlace(
        host=host,
        gpu_uuid=str(gpu.get("uuid", "")),
        fabric_cluster_uuid=str(gpu.get("fabric_cluster_uuid", "")),
        fabric_clique_id=int(gpu.get("fabric_clique_id", -1)),
    )


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def probe_nics(sys_root: str = "/sys/class") -> dict[str, Any]:
    """RDMA devices (/sys/class/infiniband: port state and rate) and network interfaces (/sys/class/net)."""
    rdma = []
    for device in sorted(glob.glob(os.path.join(sys_root, "infiniband", "*"))):
        for port in sorted(glob.glob(os.path.join(device, "ports", "*"))):
            rdma.append(
                {
                    "device": os.path.basename(device),
                    "port": os.path.basename(port),
                    "state": _read(os.path.join(port, "state")),
                    "rate": _read(os.path.join(port, "rate")),
                    "link_layer": _read(os.path.join(port, "link_layer")),
                }
            )
    net = []
    for iface in sorted(glob.glob(os.path.join(sys_root, "net", "*"))):
        name = os.path.basename(iface)
        if name == "lo":
            continue
        speed = _read(os.path.join(iface, "speed"))  # Mb/s; unreadable for virtual or down links
        net.append(
            {
                "name": name,
                "state": _read(os.path.join(iface, "operstate")),
                "speed_Mbps": int(speed) if speed.lstrip("-").isdigit() and int(speed) > 0 else None,
            }
        )
    out: dict[str, Any] = {"rdma": rdma, "net": net}
    if not rdma:
        out["rdma_note"] = f"no RDMA devices under {sys_root}/infiniband (no InfiniBand/RoCE NIC visible)"
    return out


def _module_version(module: str, attribute: str = "__version__") -> str | None:
    try:
        value = getattr(importlib.import_module(module), attribute, None)
    except Exception:
        return None
    return None if value is None else str(value)


def nccl_version() -> str | None:
    """The NCCL version torch carries ("2.27.3"); None without torch, on CPU builds or when unreadable."""
    try:
        import torch

        version = torch.cuda.nccl.version()
    except Exception:  # CPU build, CUDA build without NCCL, or no driver
        return None
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def probe_libraries() -> dict[str, Any]:
    """torch/CUDA/NCCL/NVSHMEM versions visible from Python, each None when absent."""
    out: dict[str, Any] = {"torch": _module_version("torch")}
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
        out["cuda_devices"] = torch.cuda.device_count()
        out["nccl"] = nccl_version() if torch.cuda.is_available() else None
        try:
            from torch.distributed import _symmetric_memory as symm

            out["torch_nvshmem_available"] = (
                bool(symm.is_nvshmem_available()) and torch.cuda.device_count() > 0
            )
        except Exception:
            out["torch_nvshmem_available"] = False
    except Exception:
        out["torch_cuda"] = None
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13"):
            try:
                out[dist] = version(dist)
            except PackageNotFoundError:
                continue
    except Exception:
        pass
    out["nvshmem4py"] = _module_version("nvshmem") or _module_version("nvshmem.core")
    return out


def probe_env(
    environ: Mapping[str, str] | None = None, prefixes: tuple[str, ...] = ENV_PREFIXES
) -> dict[str, str]:
    """Environment variables whose names start with ``prefixes`` (by default those that change
    NCCL/NVSHMEM/UCX behaviour and rank launch), sorted by name."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith(prefixes)}


def discover_local() -> dict[str, Any]:
    """Everything this machine shows about its GPUs, NVLink, fabric, NICs, libraries and environment.

    ``notes`` lists what could not be seen (on a CPU machine: no GPUs, NVLink or fabric clique).
    """
    gpus = probe_gpus()
    nics = probe_nics()
    out: dict[str, Any] = {
        "host": socket.gethostname(),
        "gpus": gpus.get("gpus", []),
        "driver_version": gpus.get("driver_version"),
        "cuda_driver_version": gpus.get("cuda_driver_version"),
        "nics": nics,
        "libraries": probe_libraries(),
        "env": probe_env(),
        "notes": [],
    }
    if gpus.get("error"):
        out["notes"].append(gpus["error"])
    if not out["gpus"]:
        out["notes"].append("no GPUs visible: NVLink state, link counts and the fabric clique cannot be seen")
    elif not any(g.get("fabric_cluster_uuid") for g in out["gpus"]):
        out["notes"].append(
            "no GPU reports a multi-node NVLink fabric clique: the NVLink domain is this host"
        )
    if nics.get("rdma_note"):
        out["notes"].append(nics["rdma_note"])
    domain_keys = {
        RankPlace(
            host=out["host"],
            fabric_cluster_uuid=str(g.get("fabric_cluster_uuid", "")),
            fabric_clique_id=int(g.get("fabric_clique_id", -1)),
        ).domain_key
        for g in out["gpus"]
    } or {f"host:{out['host']}"}
    out["nvlink_domains"] = sorted(domain_keys)
    return out

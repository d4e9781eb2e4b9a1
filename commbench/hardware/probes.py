"""What this machine shows about itself: GPUs (NVML), NVLink, fabric clique, NICs, libraries.

Every probe here is lazy (``pynvml`` is imported only when called) and failure tolerant: what cannot be seen
is reported as such, never raised. A rank's CUDA device is found among NVML's GPUs by its UUID (else its PCI
bus id), never by its ordinal: under CUDA_VISIBLE_DEVICES (Slurm, containers) or CUDA's default
fastest-first order, CUDA ordinal N is not NVML index N.
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
    """Where one rank runs, as that rank sees it (gathered from every rank by the harness): what nccl-tests
    prints per rank ("#  Rank  0 Group  0 Pid  1234 on  host device  0 [0000:19:00] NVIDIA H200") and the
    GPU's NVLink fabric clique."""

    host: str
    gpu_uuid: str = ""  # "GPU-xxxxxxxx-...", as nvidia-smi and NVML print it
    fabric_cluster_uuid: str = ""  # multi-node NVLink domain (NVL72 rack); "" when the GPU reports none
    fabric_clique_id: int = -1
    pid: int = 0
    device: int = -1  # CUDA ordinal in the rank's process; -1 = a CPU rank
    bus_id: str = ""  # PCI domain:bus:device in hex as nccl-tests prints it ("0000:19:00"); "" when unknown
    gpu_name: str = ""  # "NVIDIA H200"; "" on a CPU rank
    # The launcher's node rank (torchrun's GROUP_RANK, which srun tasks get from SLURM_NODEID); -1 for ranks
    # commbench spawned. Tells apart nodes that share a hostname (two torchrun agents on one machine).
    node: int = -1

    @property
    def domain_key(self) -> str:
        """Ranks with equal keys share an NVLink domain: the fabric clique where one exists, else the host."""
        if self.fabric_cluster_uuid:
            return f"fabric:{self.fabric_cluster_uuid}:{self.fabric_clique_id}"
        return f"host:{self.host}"

    def to_dict(self) -> dict[str, Any]:
        """The place as meta.json records it; ``node`` only when a launcher set it, so a spawned run's
        meta.json stays as it was (readers take a missing ``node`` as -1)."""
        values = asdict(self)
        if self.node < 0:
            del values["node"]
        return values


def _nvml() -> Any:
    import pynvml  # lazy: absent or useless on CPU machines

    pynvml.nvmlInit()
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_fabric(nvml: Any, handle: Any) -> Any:
    """The GPU's fabric info structure: ``nvmlDeviceGetGpuFabricInfoV`` (``nvmlGpuFabricInfo_v2``, with the
    health mask) where the binding and the driver have it, else ``nvmlDeviceGetGpuFabricInfo`` (deprecated
    in pynvml.py, "will be removed in CUDA 14.0"). Raises what NVML raises (NotSupported: no fabric)."""
    versioned = getattr(nvml, "nvmlDeviceGetGpuFabricInfoV", None)
    struct = getattr(nvml, "c_nvmlGpuFabricInfoV_t", None)
    if versioned is not None and struct is not None:
        info = struct()  # its constructor sets the version field NVML checks
        try:
            versioned(handle, nvml.byref(info))
            return info
        except Exception as exc:  # a driver without the versioned call: the older one below
            kinds = (getattr(nvml, name, None) for name in _OLD_DRIVER_ERRORS)
            if not any(isinstance(kind, type) and isinstance(exc, kind) for kind in kinds):
                raise
    info = nvml.c_nvmlGpuFabricInfo_t()
    nvml.nvmlDeviceGetGpuFabricInfo(handle, nvml.byref(info))
    return info


_OLD_DRIVER_ERRORS = ("NVMLError_FunctionNotFound", "NVMLError_ArgumentVersionMismatch")


def _fabric_info(nvml: Any, handle: Any) -> dict[str, Any]:
    """GPU fabric (multi-node NVLink) registration: cluster UUID + clique id identify the NVLink domain."""
    try:
        info = read_fabric(nvml, handle)
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


def nvlink_version_text(nvml: Any, value: int) -> str:
    """NVML's NVLink version enum as its number: NVML_NVLINK_VERSION_5_0 (7) -> "5.0" (the enum value is
    not the version: 5 is NVLink 3.1)."""
    for name in dir(nvml):
        if name.startswith("NVML_NVLINK_VERSION_") and getattr(nvml, name) == value:
            text = name[len("NVML_NVLINK_VERSION_") :]
            return text.replace("_", ".") if text[:1].isdigit() else text.lower()
    return f"enum {value}"


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
                    version = nvlink_version_text(nvml, int(nvml.nvmlDeviceGetNvLinkVersion(handle, link)))
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


@dataclass(frozen=True)
class CudaDevice:
    """What CUDA (torch) says about one device ordinal of this process: the keys that find it among NVML's
    GPUs. Empty fields: torch could not say (a CPU build, no driver, an older torch)."""

    ordinal: int
    uuid: str = ""  # "GPU-xxxxxxxx-...", NVML's spelling
    pci: tuple[int, int, int] | None = None  # (domain, bus, device)
    name: str = ""


def _uuid_key(text: str) -> str:
    """A GPU UUID without its "GPU-" / "MIG-" prefix, lower case: NVML prints "GPU-8f6e...", torch's
    ``uuid`` prints the bare hex."""
    key = str(text).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def pci_tuple(text: Any) -> tuple[int, int, int] | None:
    """(domain, bus, device) of a PCI bus id: NVML's "00000000:19:00.0", nccl-tests' "0000:19:00", or
    "19:00" without a domain (domain 0); None for anything else."""
    parts = str(text).strip().split(".")[0].split(":")
    if len(parts) == 2:
        parts = ["0", *parts]
    if len(parts) != 3:
        return None
    try:
        domain, bus, device = (int(part, 16) for part in parts)
    except ValueError:
        return None
    return domain, bus, device


def bus_id_text(pci: tuple[int, int, int]) -> str:
    """A PCI (domain, bus, device) as nccl-tests prints it (src/common.cu: "%04x:%02x:%02x"): "0000:19:00"."""
    domain, bus, device = pci
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def cuda_device(ordinal: int) -> CudaDevice:
    """UUID, PCI location and name of CUDA device ``ordinal`` from torch's device properties (``uuid``; the
    ``pci_domain_id`` / ``pci_bus_id`` / ``pci_device_id`` integers); what torch cannot say stays empty."""
    try:
        import torch

        props = torch.cuda.get_device_properties(ordinal)
    except Exception:  # CPU build, no driver, bad ordinal
        return CudaDevice(ordinal)
    raw = getattr(props, "uuid", None)
    text = "" if raw is None else str(raw).strip()
    if not _uuid_key(text).strip("0-"):  # absent, or all zero: none
        uuid = ""
    elif text[:4].upper() in ("GPU-", "MIG-"):
        uuid = text[:4].upper() + text[4:].lower()
    else:
        uuid = f"GPU-{text.lower()}"
    fields = [getattr(props, f"pci_{name}_id", None) for name in ("domain", "bus", "device")]
    pci = tuple(int(v) for v in fields) if all(isinstance(v, int) for v in fields) else None
    return CudaDevice(ordinal, uuid, pci, str(getattr(props, "name", "") or ""))  # type: ignore[arg-type]


def _known(value: Any) -> str:
    """An NVML field, "" for one it could not read (recorded as "? (error)")."""
    text = "" if value is None else str(value)
    return "" if text.startswith("?") else text


def _nvml_gpu_of(
    device: CudaDevice, gpus: list[dict[str, Any]], visible: str | None
) -> dict[str, Any] | None:
    """The NVML GPU that is CUDA device ``device``: by UUID, else by PCI bus id; only when torch knows
    neither, by CUDA_VISIBLE_DEVICES (an index, or a UUID prefix as CUDA accepts) or else the same index
    (best effort: CUDA orders fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID). None when none matches."""
    if device.uuid:
        found = [g for g in gpus if _uuid_key(_known(g.get("uuid"))) == _uuid_key(device.uuid)]
        if found:
            return found[0]
    if device.pci is not None:
        found = [g for g in gpus if pci_tuple(_known(g.get("pci_bus_id"))) == device.pci]
        if found:
            return found[0]
    if device.uuid or device.pci is not None:
        return None  # known keys matched nothing (a MIG instance, a GPU NVML cannot see): no guessing
    entries = [entry.strip() for entry in visible.split(",")] if visible is not None else None
    if entries is None:
        index = device.ordinal
    elif device.ordinal < len(entries) and entries[device.ordinal].isdigit():
        index = int(entries[device.ordinal])
    elif device.ordinal < len(entries) and entries[device.ordinal]:
        prefix = entries[device.ordinal].lower()
        found = [g for g in gpus if _known(g.get("uuid")).lower().startswith(prefix)]
        return found[0] if len(found) == 1 else None
    else:
        return None
    return next((g for g in gpus if g.get("index") == index), None)


def launcher_node() -> int:
    """This rank's node in its launch: GROUP_RANK (set by torchrun, and from SLURM_NODEID for srun tasks by
    ``run.launch_env``); -1 when absent or not a number (spawned ranks)."""
    text = os.environ.get("GROUP_RANK", "").strip()
    return int(text) if text.isdigit() else -1


def local_place(device_index: int | None = None) -> RankPlace:
    """This process's place: host, pid and launcher node, and for CUDA device ``device_index`` (an ordinal of
    this process) its UUID, PCI bus id and name, and the fabric clique of the NVML GPU with that UUID (or bus
    id)."""
    host, pid, node = socket.gethostname(), os.getpid(), launcher_node()
    if device_index is None:
        return RankPlace(host=host, pid=pid, node=node)
    device = cuda_device(device_index)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = _nvml_gpu_of(device, probe_gpus().get("gpus", []), visible) or {}
    pci = device.pci or pci_tuple(_known(gpu.get("pci_bus_id")))
    return RankPlace(
        host=host,
        gpu_uuid=_known(gpu.get("uuid")) or device.uuid,
        fabric_cluster_uuid=str(gpu.get("fabric_cluster_uuid", "")),
        fabric_clique_id=int(gpu.get("fabric_clique_id", -1)),
        pid=pid,
        device=int(device_index),
        bus_id=bus_id_text(pci) if pci is not None else "",
        gpu_name=device.name or _known(gpu.get("name")),
        node=node,
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

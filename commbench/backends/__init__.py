"""Backend registry. Modules are imported lazily so GPU-only dependencies never load on a CPU machine."""

from __future__ import annotations

import importlib

from commbench.errors import UsageError

# name -> "module:Class"; "auto" is resolved by the CLI (nccl with GPUs, gloo without).
BACKENDS: dict[str, str] = {
    "nccl": "commbench.backends.torchdist:TorchDistBackend",
    "gloo": "commbench.backends.torchdist:TorchDistBackend",
    "mock": "commbench.backends.mock:MockBackend",
    "sim": "commbench.backends.sim:SimBackend",
    "shmem-emu": "commbench.backends.shmem.emu:ShmemEmuBackend",
    "nvshmem": "commbench.backends.shmem.nvshmem:NvshmemBackend",
}


def get_backend(name: str) -> type:
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    module_name, class_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)

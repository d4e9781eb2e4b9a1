"""Which GPU kernels are communication: a registry of kernel names by library, not a substring search.

Each backend declares the names of the kernels it launches (``Backend.kernel_patterns``, e.g. NCCL's in
``backends.torchdist``, DeepEP's in ``backends.adapters.deep_ep``); ``kernel_registry`` assembles those of
every registered backend, plug-ins included. Copies and fills belong to no backend and are classified here.

Profilers' overlap recipes (HTA, Nsight's) call a kernel communication when its name contains ``nccl``, so
DeepEP's, NVSHMEM's, torch symmetric memory's and commbench's own put kernels count as compute there. Here
each library's kernels are named by a regular expression anchored at the start of the demangled kernel name
as CUPTI/Kineto report it (``void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, ...)``: template
functions carry their return type, plain functions do not, so a leading ``void `` is optional). The first
entry that matches decides: every compute carve-out (kernels of a communication library that only touch
local memory) comes before every communication entry, each group in registry order.

Rules (binding):

- A kernel that matches no entry is **compute**: library ``other``. Names that do not demangle (mangled
  ``_Z...`` names) match nothing and so count as compute too.
- Copies (Kineto category ``gpu_memcpy``, named ``Memcpy <kind> (<src> -> <dst>)``) are communication only
  when peer-to-peer: the copy kind is ``PtoP`` (CUPTI's ``CUPTI_ACTIVITY_MEMCPY_KIND_PTOP``), or the event's
  ``fromDevice`` and ``toDevice`` arguments (Kineto's peer-copy record) name two different GPUs. Every other
  copy (host to device, device to host, within one GPU) is compute: library ``memcpy``.
- Fills (category ``gpu_memset``, ``Memset (Device)``) write one GPU's own memory: always compute, library
  ``memset``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from commbench.run.describe import COMMUNICATION, COMPUTE, KINDS, KernelPattern

__all__ = [
    "COMMUNICATION",
    "COMPUTE",
    "KINDS",
    "MEMCPY_LIBRARY",
    "MEMSET_LIBRARY",
    "UNMATCHED_LIBRARY",
    "KernelPattern",
    "classify_event",
    "classify_kernel",
    "communication_libraries",
    "is_peer_copy",
    "kernel_registry",
]

UNMATCHED_LIBRARY = "other"  # what classify_kernel says of a name no entry matches (a compute kernel)
MEMCPY_LIBRARY = "memcpy"
MEMSET_LIBRARY = "memset"


def kernel_registry() -> tuple[KernelPattern, ...]:
    """Every registered backend's ``kernel_patterns`` (``backends.loaded_backends``), compute carve-outs
    first, each pattern once (UCCL-EP shares DeepEP's)."""
    from commbench.backends import ENTRIES

    return _assembled(tuple((name, entry.target) for name, entry in ENTRIES.items()))


@functools.lru_cache(maxsize=4)
def _assembled(registered: tuple[tuple[str, str], ...]) -> tuple[KernelPattern, ...]:
    """The registry for these registered (name, target) pairs: a backend added or removed makes a new one."""
    from commbench.backends import loaded_backends

    declared = [
        pattern
        for _, backend_class in loaded_backends()
        for pattern in getattr(backend_class, "kernel_patterns", ())
        if isinstance(pattern, KernelPattern) and pattern.kind in KINDS
    ]
    unique = list(dict.fromkeys(declared))
    return tuple(sorted(unique, key=lambda pattern: pattern.kind != COMPUTE))  # stable: registry order kept


_PEER_COPY = re.compile(r"^Memcpy PtoP\b")


def classify_kernel(name: str) -> tuple[str, str]:
    """(library, kind) of a GPU kernel by its demangled name: the first registry entry that matches; a name
    no entry matches is compute of library ``other``."""
    for entry in kernel_registry():
        if entry.pattern.match(name):
            return entry.library, entry.kind
    return UNMATCHED_LIBRARY, COMPUTE


def classify_event(category: str, name: str, args: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """(library, kind) of a Kineto GPU event: a kernel by ``classify_kernel``, a copy or fill by the rules of
    this module's docstring (``args`` are the event's, for a copy's ``fromDevice`` / ``toDevice``)."""
    if category == "gpu_memcpy":
        return MEMCPY_LIBRARY, COMMUNICATION if is_peer_copy(name, args) else COMPUTE
    if category == "gpu_memset":
        return MEMSET_LIBRARY, COMPUTE
    return classify_kernel(name)


def is_peer_copy(name: str, args: Mapping[str, Any] | None = None) -> bool:
    """True for a GPU-to-GPU copy: kind ``PtoP`` in the name, or two different devices in ``args``."""
    if _PEER_COPY.match(name):
        return True
    if not args:
        return False
    source, target = args.get("fromDevice"), args.get("toDevice")
    return source is not None and target is not None and source != target


def communication_libraries() -> tuple[str, ...]:
    """The libraries with a communication entry, in registry order (the peer copies' ``memcpy`` last)."""
    names = [entry.library for entry in kernel_registry() if entry.kind == COMMUNICATION]
    return tuple(dict.fromkeys([*names, MEMCPY_LIBRARY]))

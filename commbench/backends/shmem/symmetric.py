"""torch symmetric memory as the NVSHMEM backend uses it: the torch version gate, groups, the heap.

Verified against the torch wheels' ``torch/distributed/_symmetric_memory/__init__.py``:

- 2.8 has ``is_nvshmem_available`` but no ``set_backend``: NVSHMEM could only be chosen through the
  ``TORCH_SYMMMEM`` variable before start-up. ``set_backend`` / ``get_backend`` arrive in 2.9, the first
  version commbench runs on.
- 2.9 and 2.10: the NVSHMEM allocator bootstraps from the group info of group "0" (the default group), which
  only ``enable_symm_mem_for_group`` registers (their ``rendezvous`` calls it, ``empty`` does not), so the
  first ``empty`` fails with "get_group_info: no group info associated with the group name 0".
- 2.11 deprecates ``enable_symm_mem_for_group`` ("There is no need to call this function anymore.",
  FutureWarning): it is not called there, unless an allocation still names missing group info (then once,
  with exactly that warning silenced).

``set_backend`` (torch/csrc/distributed/c10d/symm_mem/SymmetricMemory.cpp, ``AllocatorMap::set_backend``)
returns at once when the backend is already the one chosen, fails with "SymmetricMemory does not find
allocation backend NVSHMEM" when no NVSHMEM allocator registered itself (torch's NVSHMEM library did not
load), and with "Backend can not be changed after use." when another backend already allocated: both are
one-line errors here, with torch's own words.

The heap NVSHMEM reserves per GPU (``NVSHMEM_SYMMETRIC_SIZE``, read once, when NVSHMEM starts at the first
symmetric allocation) is sized from the symmetric bytes a setup allocates (``default_symmetric_size``); the
launch's memory estimate counts the same figure (``symmetric_size``), from the same function of the traffic.
torch's rendezvous of each symmetric tensor takes a signal pad from that heap as well
(``NVSHMEMPeerAllocInfo``: ``nvshmem_malloc(get_signal_pad_size())``, by default 32 blocks x 72 ranks x 4 B,
CUDASymmetricMemoryTypes.hpp), counted in ``ALLOCATION_OVERHEAD_BYTES``.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from commbench.backends.shmem import protocol as proto
from commbench.backends.shmem.vdev2d import vdev2d_buffers, vdev2d_result_bytes
from commbench.errors import UsageError
from commbench.run.interface import ExchangeShape

MIN_TORCH = (2, 9)  # symm_mem.set_backend("NVSHMEM")
GROUP_SETUP_DEPRECATED_FROM = (2, 11)  # enable_symm_mem_for_group emits a FutureWarning from here on
_DEPRECATION = r"`enable_symm_mem_for_group` is deprecated"
_MISSING_GROUP = "no group info associated with the group name"
# Words of NVSHMEM / CUDA / torch errors that mean the heap (or the GPU) had no room: only then does the
# message suggest a larger NVSHMEM_SYMMETRIC_SIZE.
_HEAP_WORDS = (
    "out of memory",
    "outofmemory",
    "memoryallocation",
    "symmetric size",
    "symmetric_size",
    "heap",
    "nvshmem_malloc",
    "not enough memory",
)


NEEDS = (
    "needs CUDA GPUs and NVSHMEM (a CUDA build of torch with NVSHMEM, Triton and the nvidia-nvshmem wheel)"
)


def check_available() -> None:
    """UsageError (one line, exit 2) unless this host has CUDA devices and torch >= 2.9 with NVSHMEM (the
    NVSHMEM backend's pre-launch check)."""
    if torch.cuda.device_count() < 1:
        raise UsageError(
            f"--backend nvshmem {NEEDS}; this host has no CUDA device (use --backend shmem-emu on CPU)"
        )
    check_torch_version(str(torch.__version__))
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        raise UsageError(f"--backend nvshmem {NEEDS}; torch symmetric memory is missing: {exc}") from None
    check_torch_version(str(torch.__version__), symm_mem)
    if not symm_mem.is_nvshmem_available():
        raise UsageError(f"--backend nvshmem {NEEDS}; this torch build reports no NVSHMEM")


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version ("2.10.0+cu128" -> (2, 10)); None when it has no such prefix."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_torch_version(version: str, symm_mem: Any = None) -> None:
    """UsageError (one line, exit 2) when this torch predates symmetric memory's ``set_backend``."""
    release = torch_release(version)
    too_old = release is not None and release < MIN_TORCH
    if too_old or (symm_mem is not None and not hasattr(symm_mem, "set_backend")):
        raise UsageError(
            f"--backend nvshmem needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (symmetric memory's NVSHMEM "
            f"backend, set_backend), found torch {version}; install a newer CUDA build of torch"
        )


def error_summary(exc: BaseException) -> str:
    """First and last lines of an error (Triton puts the cause last), without torch's C++ frame dump."""
    lines: list[str] = []
    for line in str(exc).splitlines():
        if line.strip().startswith(("Exception raised from", "frame #")):
            break
        if line.strip():
            lines.append(line.strip())
    lines = lines or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(exc).__name__}: {text}"[:400]


def is_heap_size_error(exc: BaseException) -> bool:
    """Whether an allocation error says the symmetric heap or the GPU memory was too small."""
    text = f"{type(exc).__name__} {exc}".lower()
    return any(word in text for word in _HEAP_WORDS)


def enable_groups(symm_mem: Any, group_names: Iterable[str]) -> None:
    """``enable_symm_mem_for_group`` for each group not yet set up, silencing only its FutureWarning."""
    enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", lambda name: False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=FutureWarning)
        for name in dict.fromkeys(group_names):  # once each, in order
            if not enabled(name):
                symm_mem.enable_symm_mem_for_group(name)


def needs_group_setup(version: str) -> bool:
    """Whether this torch's NVSHMEM allocator needs ``enable_symm_mem_for_group`` before ``empty``."""
    release = torch_release(version)
    return release is None or release < GROUP_SETUP_DEPRECATED_FROM


SYMMETRIC_SIZE_VARIABLE = "NVSHMEM_SYMMETRIC_SIZE"
MIN_SYMMETRIC_SIZE = 1 << 30  # NVSHMEM's own default is of this order (about 1 GiB)
# NVSHMEM's own allocations from the heap (team and collective work arrays) beside commbench's.
NVSHMEM_RESERVED_BYTES = 256 << 20
# Per symmetric tensor: torch's signal pad of its rendezvous (9 KiB by default) and nvshmem_malloc's rounding.
ALLOCATION_OVERHEAD_BYTES = 64 << 10
# NVSHMEM_SYMMETRIC_SIZE's suffixes (NVSHMEM's environment variable documentation): binary multipliers.
_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_TEXT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGtT]?)")


def default_symmetric_size(nbytes: int) -> int:
    """The NVSHMEM_SYMMETRIC_SIZE commbench sets for setups of ``nbytes`` symmetric bytes, unless the user
    set one: twice that (a later, larger setup of the same process allocates its heap before the old one's
    space is reused, and NVSHMEM fixes the size when it starts) plus NVSHMEM's own, at least 1 GiB."""
    return max(MIN_SYMMETRIC_SIZE, 2 * int(nbytes) + NVSHMEM_RESERVED_BYTES)


def parse_symmetric_size(text: str) -> int | None:
    """NVSHMEM_SYMMETRIC_SIZE as NVSHMEM reads it: a number (integer or decimal, ".5" allowed) with an
    optional k, m, g or t (binary, either case; what follows the multiplier is ignored), rounded up; None
    when it is not such a value (NVSHMEM then refuses it itself)."""
    match = _SIZE_TEXT.match(text)
    if match is None:
        return None
    scale = _SIZE_SUFFIXES.get(match.group(2).lower(), 1)
    return math.ceil(float(match.group(1)) * scale)


def symmetric_size(nbytes: int, environ: Mapping[str, str] | None = None) -> int:
    """The heap NVSHMEM will reserve per GPU for setups of ``nbytes`` symmetric bytes: the user's
    NVSHMEM_SYMMETRIC_SIZE where it is set (and readable), else ``default_symmetric_size``."""
    given = (os.environ if environ is None else environ).get(SYMMETRIC_SIZE_VARIABLE, "")
    parsed = parse_symmetric_size(given) if given.strip() else None
    return parsed if parsed is not None else default_symmetric_size(nbytes)


def setup_symmetric_bytes(shape: ExchangeShape) -> int:
    """The symmetric bytes one NVSHMEM backend setup for ``shape`` allocates, the most over its variants and
    options: the put heap (``protocol.widest_heap``, the busiest rank's capacity), or vdev2d's tensors
    (``vdev2d_buffers``), each with torch's per-rendezvous overhead."""
    rows = np.asarray(shape.rows)
    world = rows.shape[0]
    heap = proto.widest_heap(
        rows, shape.dispatch_row_bytes, shape.combine_row_bytes, world, shape.slots
    ).nbytes
    capacity = proto.buffer_capacity(rows)
    tensors = vdev2d_buffers(capacity, shape.slots, world, shape.dispatch_row_bytes, shape.combine_row_bytes)
    vdev = sum(
        math.prod(max(1, n) for n in dims) * torch.empty((), dtype=dtype).element_size()
        + ALLOCATION_OVERHEAD_BYTES
        for dims, dtype in tensors.values()
    )
    return max(heap + ALLOCATION_OVERHEAD_BYTES, vdev)


def device_bytes(shape: ExchangeShape, environ: Mapping[str, str] | None = None) -> int:
    """GPU bytes per rank an NVSHMEM backend holds for ``shape``: the heap NVSHMEM reserves
    (``symmetric_size`` of ``setup_symmetric_bytes``), at least what is allocated in it, and vdev2d's one
    ordinary buffer beside it (dispatch's rows in source order)."""
    allocated = setup_symmetric_bytes(shape)
    result = vdev2d_result_bytes(proto.buffer_capacity(np.asarray(shape.rows)), shape.dispatch_row_bytes)
    return max(symmetric_size(allocated, environ), allocated) + result


def prepare_environment(nbytes: int) -> None:
    """NVSHMEM reads these when it initializes (the first symmetric allocation); a user's values win.
    ``nbytes``: the symmetric bytes of the setup that starts NVSHMEM (``default_symmetric_size``)."""
    os.environ.setdefault(SYMMETRIC_SIZE_VARIABLE, str(default_symmetric_size(nbytes)))
    # torch >= 2.11 pools symmetric allocations unless told not to: plain nvshmem_malloc keeps the same
    # offsets on all PEs (older versions ignore the variable).
    os.environ.setdefault("TORCH_SYMMMEM_IMPLICIT_POOL", "0")


def select_nvshmem(symm_mem: Any) -> None:
    """``set_backend("NVSHMEM")``; its failure is a one-line UsageError with torch's words and what they
    mean (module docstring), never swallowed: the rest of the set-up would fail with a later, vaguer error."""
    try:
        symm_mem.set_backend("NVSHMEM")
    except RuntimeError as exc:
        if "can not be changed" in str(exc):
            hint = (
                "another symmetric memory backend allocated first in this process; run commbench on its own"
            )
        else:
            hint = (
                "torch's NVSHMEM allocator is not there: its NVSHMEM library (libtorch_nvshmem.so and the "
                "nvidia-nvshmem wheel this torch pins) did not load; see docs/nvshmem.md"
            )
        raise UsageError(
            f"nvshmem: torch symmetric memory cannot use NVSHMEM ({error_summary(exc)}); {hint}"
        ) from None


def allocate_heap(
    symm_mem: Any,
    nbytes: int,
    device: torch.device,
    group_name: str,
    world_group_name: str,
    reserve_bytes: int | None = None,
) -> torch.Tensor:
    """One symmetric uint8 tensor of ``nbytes`` on ``device``, rendezvoused over ``group_name``
    (``allocate_symmetric``)."""
    return allocate_symmetric(
        symm_mem, (nbytes,), torch.uint8, device, group_name, world_group_name, reserve_bytes
    )


def allocate_symmetric(
    symm_mem: Any,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    group_name: str,
    world_group_name: str,
    reserve_bytes: int | None = None,
) -> torch.Tensor:
    """One symmetric tensor on ``device``, rendezvoused over ``group_name``: every symmetric allocation of
    the NVSHMEM backend goes through here.

    Sizes NVSHMEM's heap from ``reserve_bytes`` (the setup's symmetric bytes; this tensor's own when None)
    before the first allocation starts NVSHMEM, selects NVSHMEM, sets up the default group (NVSHMEM's
    bootstrap) and ``group_name`` where this torch needs it, and turns a failure into a one-line UsageError
    with the error's own words; the NVSHMEM_SYMMETRIC_SIZE advice comes only when the error is about memory.
    """
    nbytes = math.prod(max(1, int(n)) for n in shape) * torch.empty((), dtype=dtype).element_size()
    reserve = int(reserve_bytes) if reserve_bytes is not None else nbytes
    prepare_environment(reserve)
    select_nvshmem(symm_mem)
    groups = (world_group_name, group_name)
    set_up_first = needs_group_setup(str(torch.__version__))
    try:
        if set_up_first:
            enable_groups(symm_mem, groups)
        try:
            heap = symmetric_tensor(symm_mem, shape, dtype, device, group_name)
        except RuntimeError as exc:
            if set_up_first or _MISSING_GROUP not in str(exc):
                raise
            enable_groups(symm_mem, groups)  # a torch that still needs it despite its version: once more
            heap = symmetric_tensor(symm_mem, shape, dtype, device, group_name)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        raise allocation_error(exc, nbytes, reserve) from None
    # The kernels address the heap through NVSHMEM: memory of another symmetric backend would fault.
    backend = getattr(symm_mem, "get_backend", lambda device: "NVSHMEM")(device)
    if backend not in (None, "NVSHMEM"):
        raise UsageError(
            f"nvshmem: torch symmetric memory uses the {backend} backend in this process, not NVSHMEM "
            "(set_backend must come before any other symmetric allocation); run commbench on its own"
        )
    return heap


def allocation_error(exc: BaseException, nbytes: int, reserve_bytes: int | None = None) -> UsageError:
    """The one-line error of a failed symmetric allocation: its real cause; heap advice only for memory
    (``reserve_bytes``: the setup's symmetric bytes, which the heap must hold)."""
    message = f"nvshmem: could not allocate a {nbytes / 2**20:.1f} MiB symmetric heap ({error_summary(exc)})"
    if is_heap_size_error(exc):
        size = os.environ.get(SYMMETRIC_SIZE_VARIABLE, "unset")
        need = (reserve_bytes if reserve_bytes is not None else nbytes) + NVSHMEM_RESERVED_BYTES
        current = parse_symmetric_size(size)
        if current is None or current < need:
            message += (
                f"; NVSHMEM_SYMMETRIC_SIZE is {size}: set it to at least {need} bytes (and within GPU "
                "memory) or use fewer tokens"
            )
        else:
            message += (
                f"; NVSHMEM_SYMMETRIC_SIZE ({size}) holds the {need} bytes this setup needs, so the GPU has "
                "no room for the heap: use fewer tokens"
            )
    return UsageError(message)


def symmetric_tensor(
    symm_mem: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group_name: str
) -> torch.Tensor:
    """``symm_mem.empty`` then ``rendezvous`` over ``group_name`` (collective: every rank calls it alike)."""
    tensor = symm_mem.empty(*(max(1, n) for n in shape), dtype=dtype, device=device)
    symm_mem.rendezvous(tensor, group_name)
    return tensor

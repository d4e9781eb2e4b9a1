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
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from commbench.errors import UsageError

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


def prepare_environment(nbytes: int) -> None:
    """NVSHMEM reads these when it initializes (the first symmetric allocation); a user's values win."""
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, 2 * nbytes + (256 << 20))))
    # torch >= 2.11 pools symmetric allocations unless told not to: plain nvshmem_malloc keeps the same
    # offsets on all PEs (older versions ignore the variable).
    os.environ.setdefault("TORCH_SYMMMEM_IMPLICIT_POOL", "0")


def allocate_heap(
    symm_mem: Any, nbytes: int, device: torch.device, group_name: str, world_group_name: str
) -> torch.Tensor:
    """One symmetric uint8 tensor of ``nbytes`` on ``device``, rendezvoused over ``group_name``.

    Selects NVSHMEM, sets up the default group (NVSHMEM's bootstrap) and ``group_name`` where this torch
    needs it, and turns a failure into a one-line UsageError with the error's own words; the
    NVSHMEM_SYMMETRIC_SIZE advice comes only when the error is about memory.
    """
    prepare_environment(nbytes)
    refused = choose_nvshmem(symm_mem)
    groups = (world_group_name, group_name)
    set_up_first = needs_group_setup(str(torch.__version__))
    try:
        if set_up_first:
            enable_groups(symm_mem, groups)
        try:
            heap = symmetric_tensor(symm_mem, (nbytes,), torch.uint8, device, group_name)
        except RuntimeError as exc:
            if set_up_first or _MISSING_GROUP not in str(exc):
                raise
            enable_groups(symm_mem, groups)  # a torch that still needs it despite its version: once more
            heap = symmetric_tensor(symm_mem, (nbytes,), torch.uint8, device, group_name)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        raise allocation_error(exc, nbytes, refused) from None
    # The kernels address the heap through NVSHMEM: memory of another symmetric backend would fault.
    backend = getattr(symm_mem, "get_backend", lambda device: "NVSHMEM")(device)
    if backend not in (None, "NVSHMEM"):
        cause = f": set_backend('NVSHMEM') said {error_summary(refused)}" if refused is not None else ""
        raise UsageError(
            f"nvshmem: torch symmetric memory uses the {backend} backend in this process, not NVSHMEM"
            f"{cause} (set_backend must come before any other symmetric allocation); run commbench on its own"
        )
    return heap


def choose_nvshmem(symm_mem: Any) -> RuntimeError | None:
    """``set_backend("NVSHMEM")``; the error it raised, kept (None when it took). An earlier set-up in this
    process may have chosen it already, which torch refuses harmlessly; any other refusal (NVSHMEM not built
    in, a backend fixed by an earlier allocation) is the real cause of what fails next, so the caller's
    message quotes it instead of losing it."""
    try:
        symm_mem.set_backend("NVSHMEM")
    except RuntimeError as exc:
        return exc
    return None


def allocation_error(exc: BaseException, nbytes: int, refused: BaseException | None = None) -> UsageError:
    """The one-line error of a failed symmetric allocation: its real cause (and ``set_backend``'s refusal
    before it, when there was one); heap advice only for memory."""
    first = f"; set_backend('NVSHMEM') had said {error_summary(refused)}" if refused is not None else ""
    message = (
        f"nvshmem: could not allocate a {nbytes / 2**20:.1f} MiB symmetric heap ({error_summary(exc)}{first})"
    )
    if is_heap_size_error(exc):
        size = os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "unset")
        message += (
            f"; NVSHMEM_SYMMETRIC_SIZE is {size}: set it above {2 * nbytes} bytes (and within GPU memory) "
            "or use fewer tokens"
        )
    return UsageError(message)


def symmetric_tensor(
    symm_mem: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group_name: str
) -> torch.Tensor:
    """``symm_mem.empty`` then ``rendezvous`` over ``group_name`` (collective: every rank calls it alike)."""
    tensor = symm_mem.empty(*(max(1, n) for n in shape), dtype=dtype, device=device)
    symm_mem.rendezvous(tensor, group_name)
    return tensor

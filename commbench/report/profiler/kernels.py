"""Which GPU kernels are communication: a registry of kernel names by library, not a substring search.

Profilers' overlap recipes (HTA, Nsight's) call a kernel communication when its name contains ``nccl``, so
DeepEP's, NVSHMEM's, torch symmetric memory's and commbench's own put kernels count as compute there. Here
each library's kernels are named by a regular expression anchored at the start of the demangled kernel name
as CUPTI/Kineto report it (``void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, ...)``: template
functions carry their return type, plain functions do not, so a leading ``void `` is optional). The first
entry that matches decides (compute carve-outs of a library come before its communication entry).

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

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COMMUNICATION = "communication"
COMPUTE = "compute"
KINDS = (COMMUNICATION, COMPUTE)
UNMATCHED_LIBRARY = "other"  # what classify_kernel says of a name no entry matches (a compute kernel)
MEMCPY_LIBRARY = "memcpy"
MEMSET_LIBRARY = "memset"

# commbench's own Triton kernels (commbench/backends/shmem/kernels.py): Triton names the compiled kernel after
# the @triton.jit function, without parameters. tests/report/test_kernels.py checks these against that file.
COMMBENCH_TRITON_KERNELS = ("commbench_put_items", "commbench_wait_signals")


@dataclass(frozen=True)
class KernelPattern:
    """One registry entry: kernels of ``library`` whose demangled name matches ``pattern`` are ``kind``."""

    library: str
    kind: str
    pattern: re.Pattern[str]
    source: str  # where the names come from (repository and file), to re-check when a library changes


def _anchored(body: str) -> re.Pattern[str]:
    """``body`` at the very start of the name (after an optional return type ``void``), followed by the end
    of the name, template arguments or the parameter list: ``dispatch`` must not match ``dispatch_layout``."""
    return re.compile(rf"^(?:void )?(?:{body})(?:<|\(|$)")


_DEEPEP_NAMESPACES = r"deep_ep::(?:legacy::)?"  # DeepEP moved its first kernels under deep_ep::legacy
_DEEPEP_ELASTIC = "deep_ep::elastic::"

REGISTRY: tuple[KernelPattern, ...] = (
    # Compute carve-outs first: kernels of communication libraries that only touch local memory.
    KernelPattern(
        "deepep",
        COMPUTE,
        _anchored(
            rf"{_DEEPEP_NAMESPACES}(?:layout|internode)::get_dispatch_layout"
            rf"|{_DEEPEP_ELASTIC}(?:dispatch_copy_epilogue|combine_reduce_epilogue)_impl"
        ),
        "deepseek-ai/DeepEP csrc/kernels/{layout,internode}.cu (get_dispatch_layout reads topk_idx only; "
        "deep_ep::internode in the first release, deep_ep::layout later); "
        "deep_ep/include/deep_ep/impls/*_epilogue.cuh (local copy / reduce of received rows)",
    ),
    KernelPattern(
        "nvshmem",
        COMPUTE,
        _anchored(r"nvshmemi_init_array_kernel"),
        "NVIDIA/nvshmem src/host/team/team_internal_cuda.cu (fills a local array at team creation)",
    ),
    # Communication.
    KernelPattern(
        "nccl",
        COMMUNICATION,
        # ncclDevKernel_<coll>... (2.19+: SendRecv, AllReduce_Sum_f32_RING_LL, Generic, ...), ncclKernel_...
        # (before 2.19), ncclSymDevKernel_... (2.27 symmetric), ncclSymkDevKernel_...[_profile] (2.28+).
        _anchored(r"nccl(?:Dev|SymDev|SymkDev)?Kernel_\w+"),
        "NVIDIA/nccl src/device/generate.py (ncclDevKernel_), src/device/symmetric/generate.py "
        "(ncclSymDevKernel_, ncclSymkDevKernel_); NCCL_KERN_NAME in src/collectives/device/common.h of NCCL "
        "before 2.19 (ncclKernel_)",
    ),
    KernelPattern(
        "nvshmem",
        COMMUNICATION,
        _anchored(
            r"(?:nvshmem|nvshmemi|nvshmemx)_\w+"
            r"|(?:alltoall|broadcast|fcollect|rdxn|reducescatter)_on_stream_kernel"
            r"|(?:barrier|sync)_on_stream_kernel_threadgroup"
        ),
        "NVIDIA/nvshmem src/include/internal/non_abi/nvshmemi_h_to_d_{coll,rma,sync}_defs.cuh (on-stream "
        "collectives, proxy RMA entry points, wait/signal kernels), src/host/team/team_internal_cuda.cu and "
        "src/host/stream/coll/rdxn/reduce_team.cu (team creation: puts, barriers, reductions across PEs)",
    ),
    KernelPattern(
        "commbench",
        COMMUNICATION,
        _anchored("|".join(COMMBENCH_TRITON_KERNELS)),
        "commbench/backends/shmem/kernels.py (@triton.jit put and wait kernels of --backend nvshmem)",
    ),
    KernelPattern(
        "torch_symm_mem",
        COMMUNICATION,
        # allToAllV (all_to_all_vdev), allToAllV_2d (all_to_all_vdev_2d and _2d_offset), the split exchanges
        # (exchangeSplitAndOffset[Kernel|_2d]) and makeExchangePlan: every kernel of this namespace moves data
        # or counts between ranks through NVSHMEM.
        _anchored(r"c10d::nvshmem_extension::\w+"),
        "pytorch/pytorch torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu",
    ),
    KernelPattern(
        "deepep",
        COMMUNICATION,
        _anchored(
            rf"{_DEEPEP_NAMESPACES}intranode::(?:barrier|notify_dispatch|cached_notify_dispatch|dispatch"
            r"|cached_notify_combine|combine)"
            rf"|{_DEEPEP_NAMESPACES}internode::(?:notify_dispatch|dispatch|cached_notify|combine)"
            rf"|{_DEEPEP_NAMESPACES}internode_ll::(?:clean_low_latency_buffer|dispatch|combine)"
            rf"|{_DEEPEP_ELASTIC}(?:dispatch|combine|hybrid_dispatch|hybrid_combine|barrier|engram_fetch"
            r"|engram_fetch_wait|pp_send|pp_recv)_impl"
        ),
        "deepseek-ai/DeepEP csrc/kernels/{intranode,internode,internode_ll}.cu (csrc/kernels/legacy/ in "
        "later versions), deep_ep/include/deep_ep/impls/*.cuh (deep_ep::elastic)",
    ),
    KernelPattern(
        "pplx",
        COMMUNICATION,
        # Template arguments are part of the pattern: these names are generic, pplx's signatures are not.
        _anchored(
            r"(?:\(anonymous namespace\)::)?dispatchKernel<\d+u?, (?:true|false), (?:true|false)>"
            r"|(?:\(anonymous namespace\)::)?combineKernel<[\w: ]+, [\w: ]+, \d+u?l*, (?:true|false), "
            r"(?:true|false)>"
        ),
        "perplexityai/pplx-kernels csrc/all_to_all/{intranode,internode}_{dispatch,combine}.cu",
    ),
)

_PEER_COPY = re.compile(r"^Memcpy PtoP\b")


def classify_kernel(name: str) -> tuple[str, str]:
    """(library, kind) of a GPU kernel by its demangled name: the first registry entry that matches; a name
    no entry matches is compute of library ``other``."""
    for entry in REGISTRY:
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
    names = [entry.library for entry in REGISTRY if entry.kind == COMMUNICATION]
    return tuple(dict.fromkeys([*names, MEMCPY_LIBRARY]))

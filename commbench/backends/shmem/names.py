"""What the NVSHMEM backend's kernels are called: commbench's Triton kernels, and every kernel a run of it
launches as CUPTI/Kineto name them (``NvshmemBackend.kernel_patterns``, read by report.profiler.kernels).
Kept apart from shmem/kernels.py, which needs Triton: these are read on any machine."""

from __future__ import annotations

from commbench.run.describe import COMMUNICATION, COMPUTE, KernelPattern, kernel_names

# commbench's own Triton kernels (shmem/kernels.py): Triton names a compiled kernel after its @triton.jit
# function, without parameters (tests/report/test_kernels.py checks these against that file).
TRITON_KERNELS = ("commbench_put_items", "commbench_wait_signals")
# The kernels a run of this backend launches, as CUPTI/Kineto name them (report.profiler.kernels): NVSHMEM's
# own (a compute carve-out first), commbench's put and wait kernels, torch symmetric memory's (vdev2d).
KERNELS = (
    KernelPattern(
        "nvshmem",
        COMPUTE,
        kernel_names(r"nvshmemi_init_array_kernel"),
        "NVIDIA/nvshmem src/host/team/team_internal_cuda.cu (fills a local array at team creation)",
    ),
    KernelPattern(
        "nvshmem",
        COMMUNICATION,
        kernel_names(
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
        kernel_names("|".join(TRITON_KERNELS)),
        "commbench/backends/shmem/kernels.py (@triton.jit put and wait kernels of --backend nvshmem)",
    ),
    KernelPattern(
        "torch_symm_mem",
        COMMUNICATION,
        # allToAllV (all_to_all_vdev), allToAllV_2d (all_to_all_vdev_2d and _2d_offset), the split exchanges
        # (exchangeSplitAndOffset[Kernel|_2d]) and makeExchangePlan: every kernel of this namespace moves data
        # or counts between ranks through NVSHMEM.
        kernel_names(r"c10d::nvshmem_extension::\w+"),
        "pytorch/pytorch torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu",
    ),
)

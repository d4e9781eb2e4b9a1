"""The kernel registry, assembled from the backends' own kernel names: every entry matches its libraries' real
kernel names and none of their look-alikes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from commbench.backends.shmem.names import TRITON_KERNELS
from commbench.report.profiler.kernels import (
    COMMUNICATION,
    COMPUTE,
    UNMATCHED_LIBRARY,
    classify_event,
    classify_kernel,
    communication_libraries,
    is_peer_copy,
    kernel_registry,
)

REGISTRY = kernel_registry()

# Demangled names as CUPTI/Kineto report them, written from the kernels' declarations in each library's
# source (see each entry's ``source``), per registry entry (by position: compute carve-outs first, each kind
# in the order of the backend registry: nccl, nvshmem, deep-ep, pplx).
REAL_NAMES: dict[int, list[str]] = {
    0: ["void nvshmemi_init_array_kernel<long>(long*, int, long)"],  # nvshmem compute
    1: [  # deepep compute
        "void deep_ep::layout::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int, "
        "int, int, int)",
        "void deep_ep::legacy::layout::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, "
        "int, int, int, int)",
        "void deep_ep::internode::get_dispatch_layout<256, 32, 8>(long const*, int*, int*, int*, bool*, int, "
        "int, int, int)",
        "void deep_ep::elastic::dispatch_copy_epilogue_impl<true, false, false, 24, 4, 16, 1, 8, 7168, 56, "
        "4096, 256, 8, 128, 8, 512, 512, false>(void*, void*, int*, int*, void*, int*, long*, float*, int*, "
        "int*, int*, int, int, int, int, int)",
        "void deep_ep::elastic::combine_reduce_epilogue_impl<false, 24, 8, 7168>(__nv_bfloat16*, int)",
    ],
    2: [  # nccl
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)",
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
        "ncclSymDevKernel_AllReduce_AGxLL_R_sum_bf16(ncclSymDevArgs)",
        "ncclSymkDevKernel_AllGather_LL(ncclSymkDevWorkArgs4K)",
        "ncclSymkDevKernel_ReduceScatter_LDMC_sum_f32_profile(ncclSymkDevWorkArgs4K)",
        "ncclDevKernel_SendRecv",  # a trace that drops the parameter list
    ],
    3: [  # nvshmem communication
        "void alltoall_on_stream_kernel<int>(int, int*, int const*, unsigned long)",
        "void barrier_on_stream_kernel_threadgroup<(threadgroup_t)3>(int, int)",
        "void sync_on_stream_kernel_threadgroup<(threadgroup_t)3>(int, int)",
        "void rdxn_on_stream_kernel<float, (rdxn_ops)0>(int, float*, float const*, unsigned long)",
        "void fcollect_on_stream_kernel<__nv_bfloat16>(int, __nv_bfloat16*, __nv_bfloat16 const*, "
        "unsigned long)",
        "nvshmemi_proxy_rma_entrypoint(void*, void*, rma_bytesdesc_t, int, nvshmemi_op_t)",
        "nvshmemi_signal_wait_until_on_stream_kernel(unsigned long volatile*, int, unsigned long)",
        "nvshmemi_int64_wait_until_on_stream_kernel(long volatile*, int, long)",
        "void nvshmemi_team_index_kernel<(threadgroup_t)0>(nvshmemi_team*, nvshmemi_team_creation_psync*, "
        "int)",
        "void nvshmemi_reduce_kernel<int, (rdxn_ops)4>(int, int, int, int*, int const*, unsigned long, int*, "
        "long volatile*, long volatile*)",
    ],
    4: list(TRITON_KERNELS),  # commbench (Triton names kernels without parameters)
    5: [  # torch symmetric memory
        "c10d::nvshmem_extension::allToAllV(void*, void*, long*, unsigned long, int)",
        "c10d::nvshmem_extension::allToAllV_2d(void*, void*, long*, long*, unsigned long, int, int, long, "
        "bool, int)",
        "void c10d::nvshmem_extension::exchangeSplitAndOffset_2d<false>(long*, long*, int, int, unsigned "
        "long, bool)",
        "c10d::nvshmem_extension::exchangeSplitAndOffsetKernel(long*, long*, long*, int)",
        "c10d::nvshmem_extension::makeExchangePlan(long*, long*, long*, long*, int)",
    ],
    6: [  # deepep communication
        "void deep_ep::intranode::dispatch<8, 768, 8192>(int4*, float*, int*, long*, float*, int*, int*, "
        "int const*, int4 const*, float const*, long const*, float const*, bool const*, int, int, int, int, "
        "int, int, int, int, int, int, void**, int, int, int)",
        "void deep_ep::intranode::combine<__nv_bfloat16, 8, 768, 4096>(__nv_bfloat16*, float*, int*)",
        "void deep_ep::intranode::notify_dispatch<8>(int const*, int*, int, int const*, int*, int, int, "
        "bool const*, int*, int*, int, int, void**, int**, int)",
        "void deep_ep::intranode::cached_notify_dispatch<8>(int const*, int, void**, int**, int)",
        "void deep_ep::intranode::cached_notify_combine<8>(void**, int*, int, int, int, int**, int)",
        "void deep_ep::intranode::barrier<8>(int**, int)",
        "void deep_ep::internode::notify_dispatch<false, 2>(int const*, int*, int, int const*, int*, int)",
        "void deep_ep::internode::cached_notify<false, 0>(int, int, int, int, int, int, int*, int*, int*)",
        "void deep_ep::internode::dispatch<false, 2, true, 24, 16>(int4*, float*, long*, float*)",
        "void deep_ep::internode::combine<__nv_bfloat16, 2, false, 0, 24, 8, 10, 20>(int4*, float*)",
        "void deep_ep::internode_ll::dispatch<true, false, 7168>(void*, float*, int*, int*, long*)",
        "void deep_ep::internode_ll::combine<false, 7168, 9, 4>(void*, void*, int*, void const*)",
        "void deep_ep::internode_ll::clean_low_latency_buffer<32>(int*, int, int*, int)",
        "void deep_ep::legacy::intranode::dispatch<8, 768, 8192, 0>(int4*, float*, int*)",
        "void deep_ep::legacy::internode_ll::combine<false, 7168, 9, 4>(void*, void*, int*)",
        "void deep_ep::elastic::dispatch_impl<true, false, false, 24, 1, 8, 8, 7168, 56, 4096, 256, 8, 128, "
        "0, 0>(void*, float*, long*, float*)",
        "void deep_ep::elastic::hybrid_combine_impl<false, 24, 8, 2, 4, 7168, 4096, 8>(__nv_bfloat16*)",
        "void deep_ep::elastic::pp_send_impl<1024>(ncclDevComm, ncclWindow_vidmem*, void*, int)",
    ],
    7: [  # pplx-kernels
        "void (anonymous namespace)::dispatchKernel<32u, true, true>(int*, unsigned long, unsigned int*, "
        "unsigned long)",
        "void (anonymous namespace)::combineKernel<__nv_bfloat16, __nv_bfloat16, 16ul, true, false>"
        "(__nv_bfloat16*, unsigned long)",
        "void combineKernel<float, __nv_bfloat16, 10ul, false, true>(__nv_bfloat16*, unsigned long)",
        "void dispatchKernel<10u, false, true>(int*, unsigned long)",
    ],
}

# Names that share words with a library's kernels but are not its kernels: each is compute of "other".
LOOK_ALIKES = [
    "void at::native::fused_ncclDevKernel_pack<float>(float*, float const*, long)",  # "nccl" elsewhere
    "void nccl_pack_kernel<float>(float*)",
    "ncclKernels_helper(int)",  # no underscore after ncclKernel
    "ncclDevKernelLauncher(int)",
    "my_ncclSymDevKernel_AllGather_LL(ncclSymDevArgs)",
    "void cutlass::Kernel<nvshmem_gemm>(cutlass::Params)",
    "void gemm_nvshmem_fused<float>(float*)",
    "void alltoall_on_stream_kernel_v2<int>(int)",
    "commbench_put_items_v2",
    "triton_poi_fused_commbench_put_items_0",
    "c10d::symmetric_memory::one_shot_all_reduce(float*)",
    "void deep_ep::intranode::dispatch_helper<1>(int)",
    "void deep_ep::internode_ll::query_mask_buffer<32>(int*, int, int*)",  # reads a local buffer
    "void deep_ep::layout::get_dispatch_layout_v2<1>(int)",
    "void my::deep_ep::intranode::dispatch<8>(int4*)",
    "void dispatchKernel<float>(float*)",
    "void at::native::(anonymous namespace)::combineKernel<1>(int)",
    "_ZN6deep_ep10intranode8dispatchILi8ELi768ELi8192EEEvP4int4",  # mangled: not demangled, so unmatched
    "",
]


def test_every_registry_entry_has_real_names_here():
    assert sorted(REAL_NAMES) == list(range(len(REGISTRY)))


@pytest.mark.parametrize(
    ("index", "name"), [(index, name) for index, names in REAL_NAMES.items() for name in names]
)
def test_real_names_are_classified_by_their_entry(index, name):
    entry = REGISTRY[index]
    assert entry.pattern.match(name), f"{entry.library} {entry.kind} does not match {name!r}"
    assert classify_kernel(name) == (entry.library, entry.kind)


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alikes_are_compute_of_no_library(name):
    assert classify_kernel(name) == (UNMATCHED_LIBRARY, COMPUTE)


def test_kinds_and_sources():
    assert {entry.kind for entry in REGISTRY} == {COMMUNICATION, COMPUTE}
    assert all(entry.source and entry.pattern.pattern.startswith("^") for entry in REGISTRY)
    assert communication_libraries() == (
        "nccl", "nvshmem", "commbench", "torch_symm_mem", "deepep", "pplx", "memcpy",
    )  # fmt: skip


def test_commbench_names_are_the_triton_kernels_of_the_nvshmem_backend():
    """The registry names commbench's @triton.jit functions exactly (read from the source: no triton here)."""
    source = Path(__file__).resolve().parents[3] / "commbench" / "backends" / "shmem" / "kernels.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))

    def is_triton_jit(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return ast.unparse(target) == "triton.jit"

    jitted = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and any(is_triton_jit(d) for d in node.decorator_list)
    }
    assert jitted == set(TRITON_KERNELS)


@pytest.mark.parametrize(
    ("category", "name", "args", "expected"),
    [
        (
            "gpu_memcpy",
            "Memcpy PtoP (Device -> Device)",
            {"fromDevice": 0, "toDevice": 1},
            ("memcpy", COMMUNICATION),
        ),
        ("gpu_memcpy", "Memcpy PtoP (Device -> Device)", None, ("memcpy", COMMUNICATION)),
        (
            "gpu_memcpy",
            "Memcpy DtoD (Device -> Device)",
            {"fromDevice": 2, "toDevice": 3},
            ("memcpy", COMMUNICATION),
        ),
        ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", {"device": 0}, ("memcpy", COMPUTE)),
        (
            "gpu_memcpy",
            "Memcpy DtoD (Device -> Device)",
            {"fromDevice": 1, "toDevice": 1},
            ("memcpy", COMPUTE),
        ),
        ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", {"device": 0}, ("memcpy", COMPUTE)),
        ("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", None, ("memcpy", COMPUTE)),
        ("gpu_memset", "Memset (Device)", {"device": 0}, ("memset", COMPUTE)),
        ("kernel", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", {}, ("nccl", COMMUNICATION)),
        ("kernel", "Memcpy PtoP (Device -> Device)", {}, (UNMATCHED_LIBRARY, COMPUTE)),  # a kernel's name
    ],
)
def test_copies_are_communication_only_between_two_gpus(category, name, args, expected):
    assert classify_event(category, name, args) == expected


def test_peer_copy_rule_needs_both_devices():
    assert not is_peer_copy("Memcpy DtoD (Device -> Device)", {"fromDevice": 0})
    assert is_peer_copy("Memcpy PtoP (Device -> Device)")

"""What DeepEP-compatible buffers accept, read at their source, as checks that refuse in one line.

DeepEP (deepseek-ai/DeepEP dd758ca) and UCCL-EP (uccl-project/uccl da914a2, DeepEP's kernels with narrower
tables) assert their preconditions deep in Python and C++; ``LegacyLimits`` holds each library's tables and
the functions here refuse what they would assert, before the library is called, naming the source and
the fix: the normal kernels' rank counts, buffer alignment, the NVLink groups and allow_mnnvl from where the
ranks run, the low-latency kernels' hidden sizes and top-k, the NVSHMEM queue depth they need, DeepEP's own
device checks and V2's (ElasticBuffer) requirements. The knobs of such a buffer are ``deep_ep_options``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from commbench.backends.adapters.common import (
    MAX_BUFFER_BYTES,
    MAX_QPS,
    MAX_SMS,
    PeerShape,
    group_reach,
    next_power_of_two,
    peer_groups,
)
from commbench.backends.options import BackendOption
from commbench.errors import UsageError
from commbench.inputs.layout import Layout

NORMAL, LOW_LATENCY, HYBRID, ELASTIC = "normal", "low_latency", "hybrid", "elastic"
# Send modes whose rows are one per (token, destination rank) / one per (token, expert) selection.
PER_RANK_SEND_MODES = ("token", "balanced")
PER_SELECTION_SEND_MODES = ("selection", "balanced")
BUFFER_ALIGN_BYTES = 128  # LEGACY_NUM_BUFFER_ALIGNMENT_BYTES (csrc/kernels/legacy/compiled.cuh:9)
NVL_PEERS = 8  # LEGACY_NUM_MAX_NVL_PEERS (compiled.cuh:5): the normal kernels' NVLink group
LL_MESSAGE_HEADER_BYTES = 16  # sizeof(int4) before each low-latency message (internode_ll.cu:180)
LL_DEFAULT_QP_DEPTH = 1024  # legacy.py:113: NVSHMEM_QP_DEPTH unless the environment sets it
ELASTIC_MAX_TOPK = 32  # csrc/elastic/buffer.hpp:662 ("lots of `kNumTopk <= 32` restrictions")
ELASTIC_MAX_SMS = 160  # csrc/elastic/buffer.hpp:58 kNumMaxSMs, asserted at :853
ELASTIC_MIN_TORCH = (2, 10)  # README.md, Requirements (DeepEP V2)
ELASTIC_MIN_NCCL = (2, 30, 4)  # README.md, Requirements: "NCCL 2.30.4 and above"
LL_WARPS_PER_SM = 32  # internode_ll.cu:494-497: ceil(experts / SMs) warp groups of 32 / groups warps
# The NVSHMEM_QP_DEPTH value this process set (``DeepEpBackend._qp_depth``), told apart from a user's: a
# later job of the same process may need a deeper one.
_QP_DEPTH_SET: dict[str, str] = {}


@dataclass(frozen=True)
class LegacyLimits:
    """What a DeepEP-compatible legacy ``Buffer`` accepts, read at its source (``source``): the rank counts
    its normal kernels compile for (``SWITCH_RANKS`` in one NVLink group, ``SWITCH_RDMA_RANKS`` groups of 8
    across them) and its config table covers, and its low-latency kernels' hidden sizes and top-k."""

    library: str
    intranode_ranks: tuple[int, ...]
    rdma_groups: tuple[int, ...]
    config_ranks: tuple[int, ...]
    ll_hidden: tuple[int, ...]
    ll_max_topk: int
    ll_qp_depth: bool  # the low-latency calls assert NVSHMEM_QP_DEPTH >= 2 x (max tokens + 1)
    ll_tokens_of_four: bool  # ranks x max tokens a multiple of 4 (UCCL-EP's TMA)
    source: str

    def normal_ranks(self) -> tuple[int, ...]:
        """Rank counts both the kernels and the config table support."""
        kernels = {*self.intranode_ranks, *(NVL_PEERS * groups for groups in self.rdma_groups)}
        return tuple(sorted(kernels & set(self.config_ranks)))


DEEP_EP_LIMITS = LegacyLimits(
    library="DeepEP",
    intranode_ranks=(2, 4, 8),  # csrc/kernels/legacy/launch.cuh:53-64 SWITCH_RANKS
    rdma_groups=(2, 3, 4, 6, 8, 12, 16, 18, 20),  # launch.cuh:66-89 SWITCH_RDMA_RANKS
    config_ranks=(2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160),  # deep_ep/buffers/legacy.py:245-259
    ll_hidden=(2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192),  # launch.cuh:113-134 SWITCH_HIDDEN
    ll_max_topk=11,  # csrc/kernels/legacy/internode_ll.cu:493, 1166 kNumMaxTopK
    ll_qp_depth=True,  # deep_ep/buffers/legacy.py:609, 665
    ll_tokens_of_four=False,
    source="deepseek-ai/DeepEP dd758ca",
)


def deep_ep_options(modes: tuple[str, ...], mnnvl: bool = True) -> tuple[BackendOption, ...]:
    """The knobs of a DeepEP-compatible ``Buffer`` (DeepEP's own, UCCL-EP's without ``allow_mnnvl``)."""
    options = (
        BackendOption("mode", str, NORMAL, f"kernels: {', '.join(modes)}", choices=modes),
        BackendOption(
            "num_sms",
            int,
            0,
            "SMs of the normal kernels (even); 0 = library default",
            minimum=0,
            maximum=MAX_SMS,
        ),
        BackendOption(
            "num_nvl_bytes",
            int,
            0,
            "NVLink buffer bytes (x 128); 0 = the library's hint",
            minimum=0,
            maximum=MAX_BUFFER_BYTES,
        ),
        BackendOption(
            "num_rdma_bytes",
            int,
            0,
            "RDMA buffer bytes (x 128); 0 = the library's hint",
            minimum=0,
            maximum=MAX_BUFFER_BYTES,
        ),
        BackendOption(
            "num_qps_per_rank",
            int,
            0,
            "low_latency QPs per rank; 0 = local experts",
            minimum=0,
            maximum=MAX_QPS,
        ),
        BackendOption("allow_nvlink", bool, True, "low_latency: NVLink allowed for peers on it"),
    )
    if not mnnvl:
        return options
    return (
        *options,
        BackendOption(
            "allow_mnnvl",
            bool,
            None,
            "multi-node NVLink (fabric handles); unset = on across one clique's hosts",
        ),
    )


def normal_ranks(limits: LegacyLimits, lib: Any) -> tuple[int, ...]:
    """The rank counts ``mode=normal`` runs: the kernels' tables (``limits``), narrowed to what the installed
    library's config table holds where it imports (its get_dispatch_config / get_combine_config assert the
    count is in their config_map)."""
    sizes = limits.normal_ranks()
    buffer_class = getattr(lib, "Buffer", None)
    if buffer_class is None:
        return sizes
    kept = []
    for size in sizes:
        try:
            buffer_class.get_dispatch_config(size)
            buffer_class.get_combine_config(size)
        except AssertionError:
            continue
        kept.append(size)
    return tuple(kept)


def check_buffer_options(name: str, limits: LegacyLimits, settings: dict[str, Any]) -> None:
    """The knobs DeepEP asserts on whatever the job: an even SM count for the normal kernels, buffer sizes
    aligned to 128 bytes."""
    if settings["mode"] == NORMAL and settings["num_sms"] % 2:
        raise UsageError(
            f"backend {name} option num_sms={settings['num_sms']} must be even ({limits.library}'s normal "
            "kernels run two SMs per channel)"
        )
    for key in ("num_nvl_bytes", "num_rdma_bytes"):
        if settings[key] % BUFFER_ALIGN_BYTES:
            raise UsageError(
                f"backend {name} option {key}={settings[key]} must be a multiple of {BUFFER_ALIGN_BYTES} "
                f"({limits.library}'s buffer alignment, csrc/legacy/buffer.hpp:107-110)"
            )


def check_world(name: str, limits: LegacyLimits, settings: dict[str, Any], world: int, lib: Any) -> None:
    """UsageError (one line, before launch) for a rank count the chosen mode cannot run."""
    mode, library = settings["mode"], limits.library
    if mode == NORMAL:
        sizes = normal_ranks(limits, lib)
        if world not in sizes:
            inside = [n for n in sizes if n <= NVL_PEERS]
            across = [n for n in sizes if n > NVL_PEERS]
            below = [n for n in sizes if n < world]
            instead = f"--world-size {below[-1] if below else sizes[0]}" if sizes else "another mode"
            raise UsageError(
                f"--backend {name} mode=normal cannot run {world} ranks: {library}'s normal kernels run "
                f"{', '.join(map(str, inside))} ranks in one NVLink group and {', '.join(map(str, across))} "
                f"as groups of {NVL_PEERS} (SWITCH_RANKS / SWITCH_RDMA_RANKS, csrc/kernels/legacy/"
                f"launch.cuh, and Buffer.get_dispatch_config's table); use {instead}"
                f"{_instead_of_normal(limits, world, lib)}"
            )
        if settings["num_rdma_bytes"] and world <= NVL_PEERS:
            raise UsageError(
                f"backend {name} option num_rdma_bytes={settings['num_rdma_bytes']}: mode=normal on "
                f"{world} <= {NVL_PEERS} ranks has no RDMA buffer (csrc/legacy/buffer.hpp:115-116); leave "
                "it 0"
            )
    if mode == LOW_LATENCY and world > NVL_PEERS and world % NVL_PEERS:
        raise UsageError(
            f"--backend {name} mode=low_latency cannot run {world} ranks: {library}'s Buffer takes "
            f"fewer than {NVL_PEERS} ranks or a multiple of {NVL_PEERS} (csrc/legacy/buffer.hpp:114); use "
            f"--world-size {world // NVL_PEERS * NVL_PEERS}"
        )
    if mode == ELASTIC and lib is not None and not hasattr(lib, "ElasticBuffer"):
        raise missing(name, ELASTIC, "ElasticBuffer (DeepEP V2, main from 2.1.0)")
    if mode == HYBRID and lib is not None and not hasattr(lib, "HybridEPBuffer"):
        raise missing(name, HYBRID, "HybridEPBuffer (DeepEP's hybrid-ep branch)")


def _instead_of_normal(limits: LegacyLimits, world: int, lib: Any) -> str:
    """What else runs ``world`` ranks: the low-latency kernels (any multiple of 8), DeepEP V2's
    ElasticBuffer where the installed version has it (an NVL72 rack's 72 ranks)."""
    options = []
    if world < NVL_PEERS or world % NVL_PEERS == 0:
        options.append("mode=low_latency (--send-mode selection)")
    if limits.library == DEEP_EP_LIMITS.library and lib is not None:
        if hasattr(lib, "ElasticBuffer"):
            options.append("mode=elastic (DeepEP V2's ElasticBuffer, which the installed deep_ep has)")
        else:
            options.append("DeepEP V2 (main from 2.1.0), whose ElasticBuffer runs mode=elastic")
    return "".join(f", or {option}" for option in options)


def missing(name: str, mode: str, what: str) -> UsageError:
    return UsageError(
        f"--backend {name} mode={mode} needs {what}, which the installed deep_ep does not have; use "
        "mode=normal or mode=low_latency"
    )


def check_elastic_versions(name: str, device: torch.device) -> None:
    """DeepEP V2's requirements (README): PyTorch 2.10 and NCCL 2.30.4 (its NCCL Gin backend)."""
    from commbench.backends.shmem.symmetric import torch_release

    release = torch_release(str(torch.__version__))
    if release is not None and release < ELASTIC_MIN_TORCH:
        raise UsageError(
            f"--backend {name} mode=elastic needs torch >= 2.10 (DeepEP V2's requirement, README), found "
            f"torch {torch.__version__}"
        )
    if device.type == "cuda":
        nccl = tuple(torch.cuda.nccl.version())
        if nccl < ELASTIC_MIN_NCCL:
            raise UsageError(
                f"--backend {name} mode=elastic needs NCCL >= 2.30.4 (DeepEP V2's NCCL Gin backend, README), "
                f"torch's is {'.'.join(map(str, nccl))}: install nvidia-nccl-cu13>=2.30.4"
            )


def send_mode_refusal(name: str, mode: str, send_mode: str) -> str:
    if mode == LOW_LATENCY:
        return (
            f"--backend {name} mode=low_latency sends one message per (token, expert) selection, as a "
            "model's "
            f"top-k routing makes it; --send-mode {send_mode} hands it the routing de-duplicated per "
            "destination rank, so it would send fewer messages than the model's: use --send-mode selection"
        )
    return (
        f"--backend {name} mode={mode} sends a token once per destination rank: use --send-mode token (or "
        "mode=low_latency for one row per (token, expert))"
    )


def check_device(name: str, library: str, world: int, device: torch.device) -> None:
    """What DeepEP's own checks refuse on this GPU (deep_ep/utils/envs.py): PCIe GPUs pair only two ranks
    (check_nvlink_connections, :155-156); deterministic algorithms with filled uninitialized memory race
    its streams (check_torch_deterministic, :189)."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        raise UsageError(
            f"--backend {name}: {library} refuses torch's deterministic algorithms with "
            "fill_uninitialized_memory (deep_ep/utils/envs.py:189); turn one of them off"
        )
    if device.type == "cuda" and "PCIE" in torch.cuda.get_device_name(device) and world > 2:
        raise UsageError(
            f"--backend {name}: PCIe GPUs have pairwise NVLink only and {library} runs them 2 ranks at most "
            "(deep_ep/utils/envs.py:155-156); use --world-size 2"
        )


def mnnvl_normal(name: str, layout: Layout, world: int, wanted: bool | None) -> bool:
    """allow_mnnvl for the normal kernels, from where the ranks run: each 8 consecutive ranks (all of them,
    up to 8) join one NVLink group through CUDA IPC handles (csrc/legacy/buffer.hpp:236-245), which open
    only on the same host, or through fabric handles with allow_mnnvl (its ``use_fabric``, the constructor's
    last argument, legacy.py:92-93), which need one GPU fabric clique. ``wanted``: the knob (None = unset)."""
    needed = False
    for group in peer_groups(world, NVL_PEERS):
        domains, hosts = group_reach(layout, group)
        if domains > 1:
            raise UsageError(
                f"--backend {name} mode=normal joins each {NVL_PEERS} consecutive ranks through NVLink "
                f"(LEGACY_NUM_MAX_NVL_PEERS); ranks {group[0]}-{group[-1]} span {domains} NVLink domains on "
                f"{hosts} host(s): run {NVL_PEERS} GPUs of one NVLink domain per group of {NVL_PEERS} ranks, "
                "or use mode=low_latency (RDMA between domains)"
            )
        needed |= hosts > 1
    if needed and wanted is False:
        raise UsageError(
            f"--backend {name} mode=normal: the ranks of one NVLink group sit on several hosts of one GPU "
            "fabric "
            "clique, where CUDA IPC handles do not open; drop allow_mnnvl=false (fabric handles)"
        )
    return needed if wanted is None else bool(wanted)


def mnnvl_low_latency(layout: Layout, wanted: bool | None) -> bool:
    """allow_mnnvl for the low-latency kernels: on where one NVLink domain spans several hosts (NVSHMEM's
    multi-node NVLink P2P; without it DeepEP sets NVSHMEM_DISABLE_MNNVL=1, legacy.py:124-126)."""
    if wanted is not None:
        return bool(wanted)
    domains = range(layout.num_domains)
    return any(len(set(layout.host_of_rank[layout.domain_of_rank == d].tolist())) > 1 for d in domains)


def check_low_latency(name: str, limits: LegacyLimits, shape: PeerShape, device: torch.device) -> None:
    """The low-latency kernels' limits: hidden sizes (SWITCH_HIDDEN), top-k, UCCL-EP's multiple of 4 and
    the warp groups per SM (internode_ll.cu:494-497)."""
    library, hidden = limits.library, shape.row_bytes // 2
    if hidden not in limits.ll_hidden:
        raise UsageError(
            f"--backend {name} mode=low_latency runs hidden sizes {', '.join(map(str, limits.ll_hidden))} "
            "only "
            f"(SWITCH_HIDDEN, {library}'s low-latency kernels); this model's rows are {hidden} BF16 "
            "elements: "
            "use a model of one of those hidden sizes, or mode=normal"
        )
    if shape.topk > limits.ll_max_topk:
        raise UsageError(
            f"--backend {name} mode=low_latency takes at most {limits.ll_max_topk} experts per token "
            f"(kNumMaxTopK, {library}'s internode_ll.cu); this routing has {shape.topk}: use a model with a "
            "smaller top-k"
        )
    if limits.ll_tokens_of_four and (shape.world_size * shape.max_tokens) % 4:
        raise UsageError(
            f"--backend {name} mode=low_latency needs ranks x tokens per rank to be a multiple of 4 "
            f"({library}'s "
            f"TMA, uccl_ep.cc:1322); {shape.world_size} x {shape.max_tokens} is not: use --tokens a "
            "multiple of 4"
        )
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if shape.num_experts > LL_WARPS_PER_SM * sms:
            raise UsageError(
                f"--backend {name} mode=low_latency launches one warp group per ceil(experts / SMs) and at "
                "most "
                f"{LL_WARPS_PER_SM} of them (internode_ll.cu:494-497): {shape.num_experts} experts exceed "
                f"{LL_WARPS_PER_SM} x {sms} SMs; use a model with fewer experts"
            )


def qp_depth(name: str, max_tokens: int) -> int:
    """NVSHMEM_QP_DEPTH for ``max_tokens`` per rank: DeepEP asserts depth >= 2 x (max tokens + 1)
    (legacy.py:609, 665) and reads it from the environment, 1024 by default (legacy.py:113), so 511 tokens at
    most unless it is raised. Set here (the next power of two) when the user has not; a user's value too
    small is refused with the fix."""
    need = 2 * (max_tokens + 1)
    given = os.environ.get("NVSHMEM_QP_DEPTH")
    if given is not None and given != _QP_DEPTH_SET.get("value"):
        try:
            depth = int(given)
        except ValueError:
            raise UsageError(f"NVSHMEM_QP_DEPTH={given!r} is not an integer; unset it") from None
        if depth < need:
            raise UsageError(
                f"--backend {name} mode=low_latency with {max_tokens} tokens per rank needs "
                "NVSHMEM_QP_DEPTH >= "
                f"{need} (DeepEP asserts 2 x (tokens + 1), deep_ep/buffers/legacy.py:609); it is set to "
                f"{given}: set it to {next_power_of_two(need)}, unset it (commbench then sets it), or use "
                f"--tokens {max(1, depth // 2 - 1)} or fewer"
            )
        return depth
    depth = max(LL_DEFAULT_QP_DEPTH, next_power_of_two(need))
    os.environ["NVSHMEM_QP_DEPTH"] = _QP_DEPTH_SET["value"] = str(depth)
    return depth


def check_elastic(name: str, shape: PeerShape, sms: int, device: torch.device) -> None:
    """ElasticBuffer's limits: top-k entries (csrc/elastic/buffer.hpp:662) and SMs (:58, :853, :979)."""
    if shape.topk > ELASTIC_MAX_TOPK:
        raise UsageError(
            f"--backend {name} mode=elastic takes at most {ELASTIC_MAX_TOPK} top-k entries per token "
            f"(csrc/elastic/buffer.hpp:662); this routing has {shape.topk}"
        )
    limit = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    if sms > ELASTIC_MAX_SMS or (limit is not None and sms > limit):
        raise UsageError(
            f"backend {name} option num_sms={sms}: mode=elastic runs at most {ELASTIC_MAX_SMS} SMs "
            "(kNumMaxSMs, "
            f"csrc/elastic/buffer.hpp:58, 853) and this GPU's own ({limit if limit is not None else 'all'}, "
            ":979); lower it or leave it 0"
        )

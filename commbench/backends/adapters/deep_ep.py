"""DeepEP adapter (``--backend deep-ep``): DeepEP's own dispatch and combine kernels, chosen by ``mode``.

Follows the API of DeepEP 2.1.0 (github.com/deepseek-ai/DeepEP, main at dd758ca:
``deep_ep/buffers/legacy.py``, ``Buffer``; ``deep_ep/buffers/elastic.py``, ``ElasticBuffer``, DeepEP V2)
and, for ``mode=hybrid``, the hybrid-ep branch at 94a9f8f (``deep_ep/hybrid_ep_buffer.py``,
``HybridEPBuffer``), read at the source; not run here (no GPU).

- ``normal``: ``Buffer(group, num_nvl_bytes, num_rdma_bytes, allow_mnnvl=...)``; per dispatch
  ``get_dispatch_layout(topk_idx, num_experts)`` then ``dispatch(x, num_tokens_per_rank=...,
  is_token_in_rank=..., num_tokens_per_expert=..., topk_idx=..., topk_weights=..., config=...)``, per combine
  ``combine(x, handle, config=...)`` (a sum without weights: the expert side weights its rows with the
  received ``recv_topk_weights``). A token goes once to each destination rank: ``--send-mode token`` (or the
  balanced all-to-all). Rank counts: the kernels' tables (``NormalLimits``), refused before launch otherwise.
- ``low_latency``: ``Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=...)``;
  ``low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=False)`` into
  per-expert buffers, ``low_latency_combine(y, topk_idx, topk_weights, handle)`` (weighted on the token's
  side). One message per (token, expert) selection, as a model's routing makes the kernel send:
  ``--send-mode selection`` (token mode's de-duplicated routing would send fewer messages than the model's).
  ``use_fp8=False``: with FP8 the kernel quantizes BF16 tokens itself, which cannot be checked byte for byte;
  rows then travel as BF16 of the combine's hidden size both ways (``dispatch_dtype: bf16``).
- ``hybrid``: ``HybridEPBuffer(group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts)``;
  ``dispatch(hidden=x, probs=..., routing_map=...)`` (the dense routing map: the index form cannot mark an
  unused top-k entry), ``combine(hidden, None, handle)`` (a sum, weighted on the expert side from the
  dispatched probs). Only where the installed ``deep_ep`` has ``HybridEPBuffer``; token mode; BF16 rows.
- ``elastic``: DeepEP V2's ``ElasticBuffer(group, num_max_tokens_per_rank, hidden, num_topk)`` over NCCL
  (any rank count the NCCL communicator spans: an NVL72 rack's 72); ``dispatch(x, topk_idx, topk_weights,
  num_experts, num_max_tokens_per_rank)`` (a token once per destination rank, with its top-k ids and
  weights), ``combine(x, handle)`` (a sum: the expert side weights). Only where the installed ``deep_ep``
  has ``ElasticBuffer``; token mode.

Knobs (``--backend-option``, all in every row): ``mode``, ``num_sms`` (normal: ``Buffer.set_num_sms``, even;
hybrid: the dispatch and combine SMs; elastic: the calls' ``num_sms``; 0 = the library's default),
``num_nvl_bytes`` / ``num_rdma_bytes`` (0 = the library's size hints for this job), ``num_qps_per_rank``
(low_latency; 0 = the local experts, as DeepEP requires), ``allow_nvlink`` (low_latency), ``allow_mnnvl``
(normal, low_latency: unset = on when the ranks DeepEP joins through NVLink sit on several hosts of one GPU
fabric clique, an NVL72's trays). The rows also carry ``deep_ep_version``, the effective ``allow_mnnvl``,
``nvshmem_qp_depth`` (low_latency) and ``token_meta_bytes`` (elastic: the top-k ids and weights each
dispatched token carries, which DeepEP's figure counts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from commbench.backends.adapters.bandwidth import DEEP_EP
from commbench.backends.adapters.common import (
    ANY_ORDER,
    MAX_BUFFER_BYTES,
    MAX_QPS,
    MAX_SMS,
    SOURCE_ORDER,
    DispatcherBackend,
    PeerShape,
    group_reach,
    local_weights,
    next_power_of_two,
    peer_groups,
    scatter_rows,
)
from commbench.backends.base import grown_buffer
from commbench.backends.options import BackendOption
from commbench.errors import UsageError
from commbench.run.describe import COMMUNICATION, COMPUTE, KernelPattern, kernel_names
from commbench.traffic.plan import RankPlan

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


_NAMESPACES = r"deep_ep::(?:legacy::)?"  # DeepEP moved its first kernels under deep_ep::legacy
_ELASTIC = "deep_ep::elastic::"
# DeepEP's kernels as CUPTI/Kineto name them (report.profiler.kernels): the carve-outs that only touch local
# memory first, then the ones that move data between ranks.
KERNELS = (
    KernelPattern(
        "deepep",
        COMPUTE,
        kernel_names(
            rf"{_NAMESPACES}(?:layout|internode)::get_dispatch_layout"
            rf"|{_ELASTIC}(?:dispatch_copy_epilogue|combine_reduce_epilogue)_impl"
        ),
        "deepseek-ai/DeepEP csrc/kernels/{layout,internode}.cu (get_dispatch_layout reads topk_idx only; "
        "deep_ep::internode in the first release, deep_ep::layout later); "
        "deep_ep/include/deep_ep/impls/*_epilogue.cuh (local copy / reduce of received rows)",
    ),
    KernelPattern(
        "deepep",
        COMMUNICATION,
        kernel_names(
            rf"{_NAMESPACES}intranode::(?:barrier|notify_dispatch|cached_notify_dispatch|dispatch"
            r"|cached_notify_combine|combine)"
            rf"|{_NAMESPACES}internode::(?:notify_dispatch|dispatch|cached_notify|combine)"
            rf"|{_NAMESPACES}internode_ll::(?:clean_low_latency_buffer|dispatch|combine)"
            rf"|{_ELASTIC}(?:dispatch|combine|hybrid_dispatch|hybrid_combine|barrier|engram_fetch"
            r"|engram_fetch_wait|pp_send|pp_recv)_impl"
        ),
        "deepseek-ai/DeepEP csrc/kernels/{intranode,internode,internode_ll}.cu (csrc/kernels/legacy/ in "
        "later versions), deep_ep/include/deep_ep/impls/*.cuh (deep_ep::elastic)",
    ),
)


class DeepEpBackend(DispatcherBackend):
    name = "deep-ep"
    LIBRARY = "deep_ep"
    DISPLAY = "DeepEP"
    INSTALL = "build and install github.com/deepseek-ai/DeepEP"
    API_VERSION = "DeepEP 2.1.0 (main dd758ca; V2 ElasticBuffer); Hybrid-EP: hybrid-ep branch 94a9f8f"
    bandwidth_vocabulary = DEEP_EP
    kernel_patterns = KERNELS  # UCCL-EP (a subclass) builds DeepEP's kernels
    MODES: ClassVar[tuple[str, ...]] = (NORMAL, LOW_LATENCY, HYBRID, ELASTIC)
    OPTIONS: ClassVar[tuple[BackendOption, ...]] = deep_ep_options(MODES)
    LIMITS: ClassVar[LegacyLimits] = DEEP_EP_LIMITS
    # Whether its Buffer takes allow_mnnvl and its normal kernels join each 8 consecutive ranks by NVLink.
    MNNVL: ClassVar[bool] = True

    @classmethod
    def import_library(cls) -> Any:
        module = super().import_library()
        if hasattr(module, "initialize_uccl"):  # UCCL-EP installs its drop-in wrapper under the same name
            raise UsageError(
                "--backend deep-ep: the deep_ep importable here is UCCL-EP's wrapper, not DeepEP; use "
                "--backend uccl-ep"
            )
        return module

    @classmethod
    def _installed(cls) -> Any:
        """The library where it imports (the parent's pre-launch check, the ranks), else None (a host
        without it: ``check_available`` says so)."""
        try:
            return cls.import_library()
        except UsageError:
            return None

    @classmethod
    def check_options(cls, options: Any, world_size: int | None = None) -> dict[str, Any]:
        settings = super().check_options(options, world_size)
        if settings["mode"] == NORMAL and settings["num_sms"] % 2:
            raise UsageError(
                f"backend {cls.name} option num_sms={settings['num_sms']} must be even (DeepEP's normal "
                "kernels run two SMs per channel)"
            )
        for key in ("num_nvl_bytes", "num_rdma_bytes"):
            if settings[key] % BUFFER_ALIGN_BYTES:
                raise UsageError(
                    f"backend {cls.name} option {key}={settings[key]} must be a multiple of "
                    f"{BUFFER_ALIGN_BYTES} ({cls.LIMITS.library}'s buffer alignment, "
                    "csrc/legacy/buffer.hpp:107-110)"
                )
        if world_size is not None:
            cls.check_world(settings, world_size, cls._installed())
        return settings

    @classmethod
    def normal_ranks(cls, lib: Any) -> tuple[int, ...]:
        """The rank counts ``mode=normal`` runs: the kernels' tables (``LIMITS``), narrowed to what the
        installed library's config table holds where it imports (its get_dispatch_config /
        get_combine_config assert the count is in their config_map)."""
        sizes = cls.LIMITS.normal_ranks()
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

    @classmethod
    def check_world(cls, settings: dict[str, Any], world: int, lib: Any) -> None:
        """UsageError (one line, before launch) for a rank count the chosen mode cannot run."""
        mode, library = settings["mode"], cls.LIMITS.library
        if mode == NORMAL:
            sizes = cls.normal_ranks(lib)
            if world not in sizes:
                inside = [n for n in sizes if n <= NVL_PEERS]
                across = [n for n in sizes if n > NVL_PEERS]
                below = [n for n in sizes if n < world]
                instead = f"--world-size {below[-1] if below else sizes[0]}" if sizes else "another mode"
                raise UsageError(
                    f"--backend {cls.name} mode=normal cannot run {world} ranks: {library}'s normal kernels "
                    f"run {', '.join(map(str, inside))} ranks in one NVLink group and "
                    f"{', '.join(map(str, across))} as groups of {NVL_PEERS} (SWITCH_RANKS / "
                    "SWITCH_RDMA_RANKS, csrc/kernels/legacy/launch.cuh, and Buffer.get_dispatch_config's "
                    f"table); use {instead}{cls._instead_of_normal(world, lib)}"
                )
            if settings["num_rdma_bytes"] and world <= NVL_PEERS:
                raise UsageError(
                    f"backend {cls.name} option num_rdma_bytes={settings['num_rdma_bytes']}: mode=normal on "
                    f"{world} <= {NVL_PEERS} ranks has no RDMA buffer (csrc/legacy/buffer.hpp:115-116); "
                    "leave it 0"
                )
        if mode == LOW_LATENCY and world > NVL_PEERS and world % NVL_PEERS:
            raise UsageError(
                f"--backend {cls.name} mode=low_latency cannot run {world} ranks: {library}'s Buffer takes "
                f"fewer than {NVL_PEERS} ranks or a multiple of {NVL_PEERS} (csrc/legacy/buffer.hpp:114); "
                f"use --world-size {world // NVL_PEERS * NVL_PEERS}"
            )
        if mode == ELASTIC and lib is not None and not hasattr(lib, "ElasticBuffer"):
            raise cls._missing(ELASTIC, "ElasticBuffer (DeepEP V2, main from 2.1.0)")
        if mode == HYBRID and lib is not None and not hasattr(lib, "HybridEPBuffer"):
            raise cls._missing(HYBRID, "HybridEPBuffer (DeepEP's hybrid-ep branch)")

    @classmethod
    def _instead_of_normal(cls, world: int, lib: Any) -> str:
        """What else runs ``world`` ranks: the low-latency kernels (any multiple of 8), DeepEP V2's
        ElasticBuffer where the installed version has it (an NVL72 rack's 72 ranks)."""
        options = []
        if world < NVL_PEERS or world % NVL_PEERS == 0:
            options.append("mode=low_latency (--send-mode selection)")
        if cls.name == DeepEpBackend.name:
            if lib is not None and hasattr(lib, "ElasticBuffer"):
                options.append("mode=elastic (DeepEP V2's ElasticBuffer, which the installed deep_ep has)")
            elif lib is not None:
                options.append("DeepEP V2 (main from 2.1.0), whose ElasticBuffer runs mode=elastic")
        return "".join(f", or {option}" for option in options)

    @classmethod
    def _missing(cls, mode: str, what: str) -> UsageError:
        return UsageError(
            f"--backend {cls.name} mode={mode} needs {what}, which the installed {cls.LIBRARY} does not "
            "have; "
            "use mode=normal or mode=low_latency"
        )

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.mode: str = self.settings["mode"]
        self.buffer: Any = None
        self._buffer_key: tuple[Any, ...] = ()
        self._sizes: dict[str, Any] = {}
        self._handle: Any = None
        self._permutation: torch.Tensor | None = None
        self._recv_weights = torch.zeros(0)
        self._index = torch.zeros(0, dtype=torch.int64)
        self._library_rows: torch.Tensor | None = None
        self._expert_y: torch.Tensor | None = None
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.mode == HYBRID and not hasattr(self.lib, "HybridEPBuffer"):
            raise self._missing(HYBRID, "HybridEPBuffer (DeepEP's hybrid-ep branch)")
        if self.mode == ELASTIC:
            self._check_elastic_versions()

    def _check_elastic_versions(self) -> None:
        if not hasattr(self.lib, "ElasticBuffer"):
            raise self._missing(ELASTIC, "ElasticBuffer (DeepEP V2, main from 2.1.0)")
        from commbench.backends.shmem.symmetric import torch_release

        release = torch_release(str(torch.__version__))
        if release is not None and release < ELASTIC_MIN_TORCH:
            raise UsageError(
                f"--backend {self.name} mode=elastic needs torch >= 2.10 (DeepEP V2's requirement, README), "
                f"found torch {torch.__version__}"
            )
        if self.comm.device.type == "cuda":
            nccl = tuple(torch.cuda.nccl.version())
            if nccl < ELASTIC_MIN_NCCL:
                raise UsageError(
                    f"--backend {self.name} mode=elastic needs NCCL >= 2.30.4 (DeepEP V2's NCCL Gin backend, "
                    f"README), torch's is {'.'.join(map(str, nccl))}: install nvidia-nccl-cu13>=2.30.4"
                )

    @property
    def label(self) -> str:
        return f"{self.name} {self.mode}"

    def library_order(self) -> str:
        # The normal kernels lay rows out by source rank, each source's tokens ascending (its prefix
        # matrices; deep_ep/utils/refs.py dispatch: "sorted by rank and then by token"): checked at set-up.
        return SOURCE_ORDER if self.mode == NORMAL else ANY_ORDER

    def index_dtype(self) -> torch.dtype:
        # deep_ep.topk_idx_t: int64 unless DeepEP was built with EP_NUM_TOPK_IDX_BITS=32 (compiled.cuh:54-72).
        return getattr(self.lib, "topk_idx_t", torch.int64)

    def knobs(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            **self._sizes,
            f"{self.LIBRARY}_version": self.library_version,
        }

    # -- set-up (untimed, collective) ---------------------------------------------------------------------

    def prepare(self, plan: RankPlan, shape: PeerShape) -> None:
        per_selection = self.mode == LOW_LATENCY
        allowed = PER_SELECTION_SEND_MODES if per_selection else PER_RANK_SEND_MODES
        if shape.send_mode not in allowed:
            raise UsageError(self._send_mode_refusal(shape.send_mode))
        if self.mode in (LOW_LATENCY, HYBRID) and shape.hidden and shape.row_bytes != 2 * shape.hidden:
            raise UsageError(
                f"--backend {self.name} mode={self.mode} moves BF16 tokens of one hidden size both ways; "
                f"this model's dispatch rows are {shape.row_bytes} B and its combine rows "
                f"{2 * shape.hidden} B (FP8 dispatch): use a model with dispatch_dtype bf16, or mode=normal"
            )
        self.check_world(self.settings, shape.world_size, self.lib)
        self._check_device(shape)
        {
            NORMAL: self._prepare_normal,
            LOW_LATENCY: self._prepare_low_latency,
            HYBRID: self._prepare_hybrid,
            ELASTIC: self._prepare_elastic,
        }[self.mode](shape)

    def _send_mode_refusal(self, send_mode: str) -> str:
        if self.mode == LOW_LATENCY:
            return (
                f"--backend {self.name} mode=low_latency sends one message per (token, expert) selection, "
                "as a "
                f"model's top-k routing makes it; --send-mode {send_mode} hands it the routing de-duplicated "
                "per destination rank, so it would send fewer messages than the model's: use --send-mode "
                "selection"
            )
        return (
            f"--backend {self.name} mode={self.mode} sends a token once per destination rank: use "
            "--send-mode token (or mode=low_latency for one row per (token, expert))"
        )

    def _check_device(self, shape: PeerShape) -> None:
        """What DeepEP's own checks refuse on this GPU (deep_ep/utils/envs.py): PCIe GPUs pair only two ranks
        (check_nvlink_connections, :155-156); deterministic algorithms with filled uninitialized memory race
        its streams (check_torch_deterministic, :189)."""
        if (
            torch.are_deterministic_algorithms_enabled()
            and torch.utils.deterministic.fill_uninitialized_memory
        ):
            raise UsageError(
                f"--backend {self.name}: {self.LIMITS.library} refuses torch's deterministic algorithms with "
                "fill_uninitialized_memory (deep_ep/utils/envs.py:189); turn one of them off"
            )
        device = self.comm.device
        if device.type == "cuda" and "PCIE" in torch.cuda.get_device_name(device) and shape.world_size > 2:
            raise UsageError(
                f"--backend {self.name}: PCIe GPUs have pairwise NVLink only and {self.LIMITS.library} runs "
                f"them 2 ranks at most (deep_ep/utils/envs.py:155-156); use --world-size 2"
            )

    def _replace_buffer(self, key: tuple[Any, ...], build: Any) -> None:
        """Build the library's buffer unless one of the same sizes exists (every rank decides alike)."""
        if self.buffer is not None and key == self._buffer_key:
            return
        self._destroy_buffer()
        self.buffer = build()
        self._buffer_key = key

    def _mnnvl_normal(self, world: int) -> bool:
        """allow_mnnvl for the normal kernels, from where the ranks run: each 8 consecutive ranks (all of
        them, up to 8) join one NVLink group through CUDA IPC handles (csrc/legacy/buffer.hpp:236-245), which
        open only on the same host, or through fabric handles with allow_mnnvl (its ``use_fabric``, the
        constructor's last argument, legacy.py:92-93), which need one GPU fabric clique."""
        if not self.MNNVL:
            return False
        layout, wanted = self.layout(), self.settings.get("allow_mnnvl")
        needed = False
        for group in peer_groups(world, NVL_PEERS):
            domains, hosts = group_reach(layout, group)
            span = f"ranks {group[0]}-{group[-1]}"
            if domains > 1:
                raise UsageError(
                    f"--backend {self.name} mode=normal joins each {NVL_PEERS} consecutive ranks through "
                    f"NVLink (LEGACY_NUM_MAX_NVL_PEERS); {span} span {domains} NVLink domains on {hosts} "
                    "host(s): run "
                    f"{NVL_PEERS} GPUs of one NVLink domain per group of {NVL_PEERS} ranks, or use "
                    "mode=low_latency (RDMA between domains)"
                )
            needed |= hosts > 1
        if needed and wanted is False:
            raise UsageError(
                f"--backend {self.name} mode=normal: the ranks of one NVLink group sit on several hosts of "
                "one "
                "GPU fabric clique, where CUDA IPC handles do not open; drop allow_mnnvl=false (fabric "
                "handles)"
            )
        return needed if wanted is None else bool(wanted)

    def _mnnvl_low_latency(self) -> bool:
        """allow_mnnvl for the low-latency kernels: on where one NVLink domain spans several hosts (NVSHMEM's
        multi-node NVLink P2P; without it DeepEP sets NVSHMEM_DISABLE_MNNVL=1, legacy.py:124-126)."""
        if not self.MNNVL:
            return False
        wanted = self.settings.get("allow_mnnvl")
        if wanted is not None:
            return bool(wanted)
        layout = self.layout()
        domains = range(layout.num_domains)
        return any(len(set(layout.host_of_rank[layout.domain_of_rank == d].tolist())) > 1 for d in domains)

    def _prepare_normal(self, shape: PeerShape) -> None:
        buffer_class = self.lib.Buffer
        if self.settings["num_sms"]:
            buffer_class.set_num_sms(self.settings["num_sms"])
        world = shape.world_size
        mnnvl = self._mnnvl_normal(world)
        self.dispatch_config = buffer_class.get_dispatch_config(world)
        self.combine_config = buffer_class.get_combine_config(world)
        token_bytes = max(shape.row_bytes, 2 * shape.hidden)
        configs = (self.dispatch_config, self.combine_config)
        nvl = self.settings["num_nvl_bytes"] or max(
            c.get_nvl_buffer_size_hint(token_bytes, world) for c in configs
        )
        rdma = self.settings["num_rdma_bytes"] or max(
            c.get_rdma_buffer_size_hint(token_bytes, world) for c in configs
        )
        self._replace_buffer(
            (NORMAL, nvl, rdma, mnnvl),
            lambda: buffer_class(
                self.group,
                num_nvl_bytes=nvl,
                num_rdma_bytes=rdma,
                low_latency_mode=False,
                explicitly_destroy=True,
                **({"allow_mnnvl": mnnvl} if self.MNNVL else {}),
            ),
        )
        self._sizes = {
            "num_sms": int(buffer_class.num_sms),
            "num_nvl_bytes": int(nvl),
            "num_rdma_bytes": int(rdma),
            **({"allow_mnnvl": mnnvl} if self.MNNVL else {}),
        }

    def _check_low_latency(self, shape: PeerShape, hidden: int) -> None:
        limits, library = self.LIMITS, self.LIMITS.library
        if hidden not in limits.ll_hidden:
            raise UsageError(
                f"--backend {self.name} mode=low_latency runs hidden sizes "
                f"{', '.join(map(str, limits.ll_hidden))} "
                f"only (SWITCH_HIDDEN, {library}'s low-latency kernels); this model's rows are {hidden} BF16 "
                "elements: use a model of one of those hidden sizes, or mode=normal"
            )
        if shape.topk > limits.ll_max_topk:
            raise UsageError(
                f"--backend {self.name} mode=low_latency takes at most {limits.ll_max_topk} experts per "
                f"token (kNumMaxTopK, {library}'s internode_ll.cu); this routing has {shape.topk}: use a "
                "model with "
                "a smaller top-k"
            )
        if limits.ll_tokens_of_four and (shape.world_size * shape.max_tokens) % 4:
            raise UsageError(
                f"--backend {self.name} mode=low_latency needs ranks x tokens per rank to be a multiple of 4 "
                f"({library}'s TMA, uccl_ep.cc:1322); {shape.world_size} x {shape.max_tokens} is not: use "
                "--tokens a multiple of 4"
            )
        device = self.comm.device
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            if shape.num_experts > LL_WARPS_PER_SM * sms:
                raise UsageError(
                    f"--backend {self.name} mode=low_latency launches one warp group per ceil(experts / SMs) "
                    f"and at most {LL_WARPS_PER_SM} of them (internode_ll.cu:494-497): {shape.num_experts} "
                    f"experts exceed {LL_WARPS_PER_SM} x {sms} SMs; use a model with fewer experts"
                )

    def _qp_depth(self, max_tokens: int) -> int:
        """NVSHMEM_QP_DEPTH for ``max_tokens`` per rank: DeepEP asserts depth >= 2 x (max tokens + 1)
        (legacy.py:609, 665) and reads it from the environment, 1024 by default (legacy.py:113), so 511 tokens
        at most unless it is raised. Set here (the next power of two) when the user has not; a user's value
        too small is refused with the fix."""
        need = 2 * (max_tokens + 1)
        given = os.environ.get("NVSHMEM_QP_DEPTH")
        if given is not None and given != _QP_DEPTH_SET.get("value"):
            try:
                depth = int(given)
            except ValueError:
                raise UsageError(f"NVSHMEM_QP_DEPTH={given!r} is not an integer; unset it") from None
            if depth < need:
                raise UsageError(
                    f"--backend {self.name} mode=low_latency with {max_tokens} tokens per rank needs "
                    f"NVSHMEM_QP_DEPTH >= {need} (DeepEP asserts 2 x (tokens + 1), "
                    "deep_ep/buffers/legacy.py:609)"
                    f"; it is set to {given}: set it to {next_power_of_two(need)}, unset it (commbench then "
                    f"sets it), or use --tokens {max(1, depth // 2 - 1)} or fewer"
                )
            return depth
        depth = max(LL_DEFAULT_QP_DEPTH, next_power_of_two(need))
        os.environ["NVSHMEM_QP_DEPTH"] = _QP_DEPTH_SET["value"] = str(depth)
        return depth

    def _prepare_low_latency(self, shape: PeerShape) -> None:
        buffer_class = self.lib.Buffer
        hidden = shape.row_bytes // 2
        self._check_low_latency(shape, hidden)
        depth = self._qp_depth(shape.max_tokens) if self.LIMITS.ll_qp_depth else None
        rdma = self.settings["num_rdma_bytes"] or int(
            buffer_class.get_low_latency_rdma_size_hint(
                shape.max_tokens, hidden, shape.world_size, shape.num_experts
            )
        )
        qps = self.settings["num_qps_per_rank"] or shape.experts_per_rank
        allow_nvlink = bool(self.settings["allow_nvlink"])
        mnnvl = self._mnnvl_low_latency()
        self._replace_buffer(
            (LOW_LATENCY, rdma, qps, allow_nvlink, mnnvl, depth),
            lambda: buffer_class(
                self.group,
                num_nvl_bytes=0,
                num_rdma_bytes=rdma,
                low_latency_mode=True,
                num_qps_per_rank=qps,
                allow_nvlink_for_low_latency_mode=allow_nvlink,
                explicitly_destroy=True,
                **({"allow_mnnvl": mnnvl} if self.MNNVL else {}),
            ),
        )
        capacity = shape.max_tokens * shape.world_size
        self._expert_y = torch.zeros(
            (shape.experts_per_rank, capacity, hidden), dtype=torch.bfloat16, device=self.comm.device
        )
        self._sizes = {"num_rdma_bytes": rdma, "num_qps_per_rank": qps, "allow_nvlink": allow_nvlink}
        if self.MNNVL:
            self._sizes["allow_mnnvl"] = mnnvl
        if depth is not None:
            self._sizes["nvshmem_qp_depth"] = depth

    def _prepare_hybrid(self, shape: PeerShape) -> None:
        sms = self.settings["num_sms"] or None
        hidden = max(shape.row_bytes // 2, shape.hidden)
        self._replace_buffer(
            (HYBRID, hidden, shape.max_tokens, shape.experts_per_rank, sms),
            lambda: self.lib.HybridEPBuffer(
                group=self.group,
                hidden_dim=hidden,
                max_num_of_tokens_per_rank=shape.max_tokens,
                num_local_experts=shape.experts_per_rank,
                use_fp8=False,
                num_sms_dispatch_api=sms,
                num_sms_combine_api=sms,
            ),
        )
        # The dense form of the routing: a [tokens, experts] map and the weights in it.
        tokens, experts = self.topk_idx.shape[0], shape.num_experts
        valid = self.topk_idx >= 0
        token_of = (
            torch.arange(tokens, device=self.topk_idx.device).unsqueeze(1).expand_as(self.topk_idx)[valid]
        )
        routing_map = torch.zeros((tokens, experts), dtype=torch.bool, device=self.topk_idx.device)
        probs = torch.zeros((tokens, experts), dtype=torch.float32, device=self.topk_idx.device)
        routing_map[token_of, self.topk_idx[valid]] = True
        probs[token_of, self.topk_idx[valid]] = self.topk_weights[valid]
        self._dense = (routing_map, probs)
        self._sizes = {"num_sms": sms or 0}

    def _prepare_elastic(self, shape: PeerShape) -> None:
        hidden, topk = shape.row_bytes // 2, shape.topk
        if topk > ELASTIC_MAX_TOPK:
            raise UsageError(
                f"--backend {self.name} mode=elastic takes at most {ELASTIC_MAX_TOPK} top-k entries per "
                "token "
                f"(csrc/elastic/buffer.hpp:662); this routing has {topk}"
            )
        sms = self.settings["num_sms"]
        device = self.comm.device
        limit = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        )
        if sms > ELASTIC_MAX_SMS or (limit is not None and sms > limit):
            raise UsageError(
                f"backend {self.name} option num_sms={sms}: mode=elastic runs at most {ELASTIC_MAX_SMS} SMs "
                f"(kNumMaxSMs, csrc/elastic/buffer.hpp:58, 853) and this GPU's own "
                f"({limit if limit is not None else 'all'}, :979); lower it or leave it 0"
            )
        self._replace_buffer(
            (ELASTIC, shape.max_tokens, hidden, topk),
            lambda: self.lib.ElasticBuffer(
                self.group,
                num_max_tokens_per_rank=shape.max_tokens,
                hidden=hidden,
                num_topk=topk,
                use_fp8_dispatch=False,
                explicitly_destroy=True,
            ),
        )
        index_bytes = torch.empty((), dtype=self.index_dtype()).element_size()
        # Each dispatched token carries its top-k ids and float32 weights: DeepEP's figure counts them.
        self._sizes = {"num_sms": self.settings["num_sms"], "token_meta_bytes": topk * (index_bytes + 4)}

    # -- phases (timed) -------------------------------------------------------------------------------------

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        x = tokens.view(torch.bfloat16)
        return {
            NORMAL: self._dispatch_normal,
            LOW_LATENCY: self._dispatch_low_latency,
            HYBRID: self._dispatch_hybrid,
            ELASTIC: self._dispatch_elastic,
        }[self.mode](x)

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        if self.mode == LOW_LATENCY:
            return self._combine_low_latency(expert_out, plan)
        weights = self._recv_weights if self._permutation is None else self._recv_weights[self._permutation]
        weighted = self.weighted_rows(expert_out, weights)
        self._library_rows = grown_buffer(
            self._library_rows,
            int(weighted.shape[0]),
            tuple(weighted.shape[1:]),
            weighted.dtype,
            weighted.device,
        )
        with self.steps("pack"):
            rows = scatter_rows(weighted, self._permutation, self._library_rows)
        with self.steps("library combine"):
            if self.mode == NORMAL:
                output, _, _ = self.buffer.combine(rows, self._handle, config=self.combine_config)
            elif self.mode == ELASTIC:
                output, _, _ = self.buffer.combine(rows, self._handle, num_sms=self.settings["num_sms"])
            else:
                output, _ = self.buffer.combine(rows, None, self._handle)
        self.hold(combined=output)
        return self.combined(output, plan.num_tokens)

    def _dispatch_normal(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shape is not None
        with self.steps("layout"):
            per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
                self.topk_idx, self.shape.num_experts
            )
        with self.steps("library dispatch"):
            recv_x, recv_idx, recv_weights, _, handle, _ = self.buffer.dispatch(
                x,
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma_rank,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
                topk_idx=self.topk_idx,
                topk_weights=self.topk_weights,
                config=self.dispatch_config,
            )
        self._handle = handle
        with self.steps("weights"):
            self._recv_weights = local_weights(recv_idx, recv_weights)
        self.hold(recv_x=recv_x, recv_idx=recv_idx, recv_weights=recv_weights)
        rows, self._permutation = self.flat_rows(recv_x.view(torch.uint8))
        return rows

    def _dispatch_low_latency(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shape is not None
        with self.steps("library dispatch"):
            recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
                x,
                self.topk_idx,
                self.shape.max_tokens,
                self.shape.num_experts,
                use_fp8=False,
                async_finish=False,
                return_recv_hook=False,
            )
        self._handle = handle
        self.hold(recv_x=recv_x, recv_count=recv_count)
        rows, self._index = self.expert_major_rows(recv_x.view(torch.uint8))
        return rows

    def _combine_low_latency(self, expert_out: torch.Tensor, plan: RankPlan) -> torch.Tensor:
        assert self._expert_y is not None
        with self.steps("pack"):
            self._expert_y.view(-1, self._expert_y.shape[-1]).index_copy_(0, self._index, expert_out)
        with self.steps("library combine"):
            output, _, _ = self.buffer.low_latency_combine(
                self._expert_y,
                self.topk_idx,
                self.topk_weights,
                self._handle,
                async_finish=False,
                return_recv_hook=False,
            )
        self.hold(combined=output)
        return self.combined(output, plan.num_tokens)

    def _dispatch_hybrid(self, x: torch.Tensor) -> torch.Tensor:
        assert self._dense is not None and self.shape is not None
        routing_map, probs = self._dense
        with self.steps("library dispatch"):
            tokens_out, probs_out, _, handle = self.buffer.dispatch(
                hidden=x, probs=probs, routing_map=routing_map
            )
        self._handle = handle
        count = self.expected_rows  # from the plans: the handle's count would be a host read of the device
        first = int(self.buffer.local_rank) * self.shape.experts_per_rank
        with self.steps("weights"):
            self._recv_weights = probs_out[:count, first : first + self.shape.experts_per_rank].sum(dim=1)
        self.hold(recv_x=tokens_out, recv_weights=probs_out)
        rows, self._permutation = self.flat_rows(tokens_out[:count].view(torch.uint8))
        return rows

    def _dispatch_elastic(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shape is not None
        with self.steps("library dispatch"):
            recv_x, recv_idx, recv_weights, handle, _ = self.buffer.dispatch(
                x,
                topk_idx=self.topk_idx,
                topk_weights=self.topk_weights,
                num_experts=self.shape.num_experts,
                num_max_tokens_per_rank=self.shape.max_tokens,
                num_sms=self.settings["num_sms"],
            )
        self._handle = handle
        count = self.expected_rows
        with self.steps("weights"):
            self._recv_weights = local_weights(recv_idx[:count], recv_weights[:count])
        self.hold(recv_x=recv_x, recv_idx=recv_idx, recv_weights=recv_weights)
        rows, self._permutation = self.flat_rows(recv_x[:count].view(torch.uint8))
        return rows

    def _destroy_buffer(self) -> None:
        buffer, self.buffer, self._buffer_key = self.buffer, None, ()
        if buffer is not None and hasattr(buffer, "destroy") and self.mode != HYBRID:
            buffer.destroy()  # built with explicitly_destroy=True: the destructor would not release it

    def close(self) -> None:
        self._handle = None
        self._destroy_buffer()
        super().close()

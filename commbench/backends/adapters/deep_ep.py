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

from typing import Any, ClassVar

import torch

from commbench.backends.adapters.bandwidth import DEEP_EP
from commbench.backends.adapters.common import (
    ANY_ORDER,
    SOURCE_ORDER,
    DispatcherBackend,
    PeerShape,
    local_weights,
    scatter_rows,
)
from commbench.backends.adapters.deep_ep_rules import (
    DEEP_EP_LIMITS,
    ELASTIC,
    HYBRID,
    LOW_LATENCY,
    NORMAL,
    PER_RANK_SEND_MODES,
    PER_SELECTION_SEND_MODES,
    LegacyLimits,
    check_buffer_options,
    check_device,
    check_elastic,
    check_elastic_versions,
    check_low_latency,
    check_world,
    deep_ep_options,
    missing,
    mnnvl_low_latency,
    mnnvl_normal,
    qp_depth,
    send_mode_refusal,
)
from commbench.backends.base import grown_buffer
from commbench.backends.options import BackendOption
from commbench.errors import UsageError
from commbench.run.describe import COMMUNICATION, COMPUTE, KernelPattern, kernel_names
from commbench.traffic.plan import RankPlan

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
        check_buffer_options(cls.name, cls.LIMITS, settings)
        if world_size is not None:
            check_world(cls.name, cls.LIMITS, settings, world_size, cls._installed())
        return settings

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
            raise missing(self.name, HYBRID, "HybridEPBuffer (DeepEP's hybrid-ep branch)")
        if self.mode == ELASTIC:
            if not hasattr(self.lib, "ElasticBuffer"):
                raise missing(self.name, ELASTIC, "ElasticBuffer (DeepEP V2, main from 2.1.0)")
            check_elastic_versions(self.name, self.comm.device)

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
            raise UsageError(send_mode_refusal(self.name, self.mode, shape.send_mode))
        if self.mode in (LOW_LATENCY, HYBRID) and shape.hidden and shape.row_bytes != 2 * shape.hidden:
            raise UsageError(
                f"--backend {self.name} mode={self.mode} moves BF16 tokens of one hidden size both ways; "
                f"this model's dispatch rows are {shape.row_bytes} B and its combine rows "
                f"{2 * shape.hidden} B (FP8 dispatch): use a model with dispatch_dtype bf16, or mode=normal"
            )
        check_world(self.name, self.LIMITS, self.settings, shape.world_size, self.lib)
        check_device(self.name, self.LIMITS.library, shape.world_size, self.comm.device)
        {
            NORMAL: self._prepare_normal,
            LOW_LATENCY: self._prepare_low_latency,
            HYBRID: self._prepare_hybrid,
            ELASTIC: self._prepare_elastic,
        }[self.mode](shape)

    def _replace_buffer(self, key: tuple[Any, ...], build: Any) -> None:
        """Build the library's buffer unless one of the same sizes exists (every rank decides alike)."""
        if self.buffer is not None and key == self._buffer_key:
            return
        self._destroy_buffer()
        self.buffer = build()
        self._buffer_key = key

    def _mnnvl(self, world: int | None = None) -> bool:
        """allow_mnnvl from where the ranks run (``deep_ep_rules``): the normal kernels' NVLink groups of
        ``world`` ranks, or (None) the low-latency kernels' NVSHMEM peers; False where the library's Buffer
        takes no such argument."""
        if not self.MNNVL:
            return False
        wanted = self.settings.get("allow_mnnvl")
        if world is None:
            return mnnvl_low_latency(self.layout(), wanted)
        return mnnvl_normal(self.name, self.layout(), world, wanted)

    def _prepare_normal(self, shape: PeerShape) -> None:
        buffer_class = self.lib.Buffer
        if self.settings["num_sms"]:
            buffer_class.set_num_sms(self.settings["num_sms"])
        world = shape.world_size
        mnnvl = self._mnnvl(world)
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

    def _prepare_low_latency(self, shape: PeerShape) -> None:
        buffer_class = self.lib.Buffer
        hidden = shape.row_bytes // 2
        check_low_latency(self.name, self.LIMITS, shape, self.comm.device)
        depth = qp_depth(self.name, shape.max_tokens) if self.LIMITS.ll_qp_depth else None
        rdma = self.settings["num_rdma_bytes"] or int(
            buffer_class.get_low_latency_rdma_size_hint(
                shape.max_tokens, hidden, shape.world_size, shape.num_experts
            )
        )
        qps = self.settings["num_qps_per_rank"] or shape.experts_per_rank
        allow_nvlink = bool(self.settings["allow_nvlink"])
        mnnvl = self._mnnvl()
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
        check_elastic(self.name, shape, self.settings["num_sms"], self.comm.device)
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

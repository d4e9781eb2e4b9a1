"""DeepEP adapter (``--backend deep-ep``): DeepEP's own dispatch and combine kernels, chosen by ``mode``.

Follows the API of DeepEP 2.1.0 (github.com/deepseek-ai/DeepEP, main at dd758ca,
``deep_ep/buffers/legacy.py``, ``Buffer``) and, for ``mode=hybrid``, the hybrid-ep branch at 94a9f8f
(``deep_ep/hybrid_ep_buffer.py``, ``HybridEPBuffer``), read at the source; not run here (no GPU).

- ``normal``: ``Buffer(group, num_nvl_bytes, num_rdma_bytes)``; per dispatch ``get_dispatch_layout(topk_idx,
  num_experts)`` then ``dispatch(x, num_tokens_per_rank=..., is_token_in_rank=..., num_tokens_per_expert=...,
  topk_idx=..., topk_weights=..., config=...)``, per combine ``combine(x, handle, config=...)`` (a sum
  without weights: the expert side weights its rows with the received ``recv_topk_weights``). A token goes
  once to each destination rank: ``--send-mode token`` (or the balanced all-to-all).
- ``low_latency``: ``Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=...)``;
  ``low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=False)`` into
  per-expert buffers, ``low_latency_combine(y, topk_idx, topk_weights, handle)`` (weighted on the token's
  side). One row per selection, so any send mode. ``use_fp8=False``: with FP8 the kernel quantizes BF16
  tokens itself, which cannot be checked byte for byte; rows then travel as BF16 of the combine's hidden
  size both ways, so the model's dispatch rows must be BF16 (``dispatch_dtype: bf16``).
- ``hybrid``: ``HybridEPBuffer(group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts)``;
  ``dispatch(hidden=x, probs=..., routing_map=...)`` (the dense routing map: the index form cannot mark an
  unused top-k entry), ``combine(hidden, None, handle)`` (a sum, weighted on the expert side from the
  dispatched probs). Only where the installed ``deep_ep`` has ``HybridEPBuffer``; token mode; BF16 rows.

Knobs (``--backend-option``, all in every row): ``mode``, ``num_sms`` (normal: ``Buffer.set_num_sms``, even;
hybrid: the dispatch and combine SMs; 0 = the library's default), ``num_nvl_bytes`` / ``num_rdma_bytes``
(0 = the library's size hints for this job), ``num_qps_per_rank`` (low_latency; 0 = the local experts, as
DeepEP requires), ``allow_nvlink`` (low_latency). The rows also carry ``deep_ep_version``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from commbench.backends.adapters.bandwidth import DEEP_EP
from commbench.backends.adapters.common import (
    MAX_BUFFER_BYTES,
    MAX_QPS,
    MAX_SMS,
    DispatcherBackend,
    PeerShape,
    local_weights,
    scatter_rows,
)
from commbench.backends.base import grown_buffer
from commbench.backends.options import BackendOption
from commbench.errors import UsageError
from commbench.run.describe import COMMUNICATION, COMPUTE, KernelPattern, kernel_names
from commbench.traffic.plan import RankPlan

NORMAL, LOW_LATENCY, HYBRID = "normal", "low_latency", "hybrid"


def deep_ep_options(modes: tuple[str, ...]) -> tuple[BackendOption, ...]:
    """The knobs of a DeepEP-compatible ``Buffer`` (DeepEP's own, UCCL-EP's)."""
    return (
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
            "NVLink buffer bytes; 0 = the library's hint",
            minimum=0,
            maximum=MAX_BUFFER_BYTES,
        ),
        BackendOption(
            "num_rdma_bytes",
            int,
            0,
            "RDMA buffer bytes; 0 = the library's hint",
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
    API_VERSION = "DeepEP 2.1.0 (main dd758ca); Hybrid-EP: hybrid-ep branch 94a9f8f"
    bandwidth_vocabulary = DEEP_EP
    kernel_patterns = KERNELS  # UCCL-EP (a subclass) builds DeepEP's kernels
    MODES: ClassVar[tuple[str, ...]] = (NORMAL, LOW_LATENCY, HYBRID)
    OPTIONS: ClassVar[tuple[BackendOption, ...]] = deep_ep_options(MODES)

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
    def check_options(cls, options: Any, world_size: int | None = None) -> dict[str, Any]:
        settings = super().check_options(options, world_size)
        if settings["mode"] == NORMAL and settings["num_sms"] % 2:
            raise UsageError(
                f"backend {cls.name} option num_sms={settings['num_sms']} must be even (DeepEP's normal "
                "kernels run two SMs per channel)"
            )
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
            raise UsageError(
                f"--backend {self.name} mode=hybrid needs Hybrid-EP, which the installed {self.LIBRARY} does "
                "not have (deep_ep.HybridEPBuffer: DeepEP's hybrid-ep branch); use mode=normal"
            )

    @property
    def label(self) -> str:
        return f"{self.name} {self.mode}"

    def knobs(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            **self._sizes,
            f"{self.LIBRARY}_version": self.library_version,
        }

    # -- set-up (untimed, collective) ---------------------------------------------------------------------

    def prepare(self, plan: RankPlan, shape: PeerShape) -> None:
        if self.mode in (NORMAL, HYBRID) and shape.send_mode == "selection":
            raise UsageError(
                f"--backend {self.name} mode={self.mode} sends a token once per destination rank: use "
                "--send-mode token (or mode=low_latency for one row per (token, expert))"
            )
        if self.mode in (LOW_LATENCY, HYBRID) and shape.hidden and shape.row_bytes != 2 * shape.hidden:
            raise UsageError(
                f"--backend {self.name} mode={self.mode} moves BF16 tokens of one hidden size both ways; "
                f"this model's dispatch rows are {shape.row_bytes} B and its combine rows "
                f"{2 * shape.hidden} B (FP8 dispatch): use a model with dispatch_dtype bf16, or mode=normal"
            )
        {NORMAL: self._prepare_normal, LOW_LATENCY: self._prepare_low_latency, HYBRID: self._prepare_hybrid}[
            self.mode
        ](shape)

    def _replace_buffer(self, key: tuple[Any, ...], build: Any) -> None:
        """Build the library's buffer unless one of the same sizes exists (every rank decides alike)."""
        if self.buffer is not None and key == self._buffer_key:
            return
        self._destroy_buffer()
        self.buffer = build()
        self._buffer_key = key

    def _prepare_normal(self, shape: PeerShape) -> None:
        buffer_class = self.lib.Buffer
        if self.settings["num_sms"]:
            buffer_class.set_num_sms(self.settings["num_sms"])
        world = shape.world_size
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
            (NORMAL, nvl, rdma),
            lambda: buffer_class(
                self.group,
                num_nvl_bytes=nvl,
                num_rdma_bytes=rdma,
                low_latency_mode=False,
                explicitly_destroy=True,
            ),
        )
        self._sizes = {
            "num_sms": int(buffer_class.num_sms),
            "num_nvl_bytes": int(nvl),
            "num_rdma_bytes": int(rdma),
        }

    def _prepare_low_latency(self, shape: PeerShape) -> None:
        buffer_class = self.lib.Buffer
        hidden = shape.row_bytes // 2
        rdma = self.settings["num_rdma_bytes"] or int(
            buffer_class.get_low_latency_rdma_size_hint(
                shape.max_tokens, hidden, shape.world_size, shape.num_experts
            )
        )
        qps = self.settings["num_qps_per_rank"] or shape.experts_per_rank
        allow_nvlink = bool(self.settings["allow_nvlink"])
        self._replace_buffer(
            (LOW_LATENCY, rdma, qps, allow_nvlink),
            lambda: buffer_class(
                self.group,
                num_nvl_bytes=0,
                num_rdma_bytes=rdma,
                low_latency_mode=True,
                num_qps_per_rank=qps,
                allow_nvlink_for_low_latency_mode=allow_nvlink,
                explicitly_destroy=True,
            ),
        )
        capacity = shape.max_tokens * shape.world_size
        self._expert_y = torch.zeros(
            (shape.experts_per_rank, capacity, hidden), dtype=torch.bfloat16, device=self.comm.device
        )
        self._sizes = {"num_rdma_bytes": rdma, "num_qps_per_rank": qps, "allow_nvlink": allow_nvlink}

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

    # -- phases (timed) -------------------------------------------------------------------------------------

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        x = tokens.view(torch.bfloat16)
        if self.mode == NORMAL:
            return self._dispatch_normal(x)
        if self.mode == LOW_LATENCY:
            return self._dispatch_low_latency(x)
        return self._dispatch_hybrid(x)

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
        rows, self._index = self.expert_major_rows(recv_x.view(torch.uint8), recv_count.tolist())
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
        count = int(handle[3].reshape(-1)[0])
        first = int(self.buffer.local_rank) * self.shape.experts_per_rank
        with self.steps("weights"):
            self._recv_weights = probs_out[:count, first : first + self.shape.experts_per_rank].sum(dim=1)
        self.hold(recv_x=tokens_out, recv_weights=probs_out)
        rows, self._permutation = self.flat_rows(tokens_out[:count].view(torch.uint8))
        return rows

    def _destroy_buffer(self) -> None:
        buffer, self.buffer, self._buffer_key = self.buffer, None, ()
        if buffer is not None and hasattr(buffer, "destroy") and self.mode != HYBRID:
            buffer.destroy()  # built with explicitly_destroy=True: the destructor would not release it

    def close(self) -> None:
        self._handle = None
        self._destroy_buffer()
        super().close()

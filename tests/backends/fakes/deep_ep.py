"""A fake ``deep_ep`` with DeepEP 2.1.0's API shape (``Buffer``, ``Config``, ``ElasticBuffer``,
``topk_idx_t``) and the hybrid-ep branch's ``HybridEPBuffer``, moving rows between gloo ranks with DeepEP's
layouts:

- normal ``dispatch``: a token once per destination rank; received rows source-major, tokens ascending (as
  the intranode kernels lay them out); ``recv_topk_idx`` local expert indices (-1 elsewhere) and
  ``recv_topk_weights`` (0 elsewhere); ``combine`` sums the returned rows per token without weights, in
  float32, output bf16;
- ``low_latency_dispatch``: one row per (token, expert) into ``[local experts, max tokens x ranks, hidden]``,
  each expert's rows in per-source blocks (sources descending, tokens descending inside: any order is
  DeepEP's right); ``low_latency_combine`` weights with the owner's top-k weights, output bf16;
- ``HybridEPBuffer``: a token once per destination rank, received rows in a scrambled order, probs over the
  node's experts; ``combine`` sums without weights;
- ``ElasticBuffer`` (V2): a token once per destination rank, rows in a scrambled order (its atomics),
  ``recv_topk_idx`` local (-1 elsewhere) while ``recv_topk_weights`` keeps every weight (deep_ep/utils/
  refs.py dispatch: a caller masks by the ids); ``combine`` sums without weights.

Every call enforces the preconditions the real one asserts (each check names its source file and line at
DeepEP dd758ca), so an adapter that would fail on the real library fails here: the rank counts of the
kernels' tables and the config table, buffer alignment, the NVSHMEM queue depth the low-latency calls need,
the low-latency hidden sizes and top-k, ``topk_idx_t``, and the handles a Buffer opens (CUDA IPC on one host
only, fabric handles with allow_mnnvl in one clique: ``topology.PLACES``).
"""

from __future__ import annotations

import os
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tests.backends.fakes import install_modules, topology
from tests.backends.fakes.transport import send_to_ranks

VERSION = "2.1.0"
# DeepEP's recommended-config table covers these rank counts only (Buffer.get_dispatch_config asserts it,
# deep_ep/buffers/legacy.py:245-259; get_combine_config :275-289).
CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
NVL_PEERS = 8  # csrc/kernels/legacy/compiled.cuh:5 LEGACY_NUM_MAX_NVL_PEERS
MAX_RDMA_PEERS = 20  # compiled.cuh:6
calls: list[str] = []  # every library call of this process, in order (tests read what ran)
options: dict[str, Any] = {}  # the keyword arguments of every Buffer built, by the name of its mode
topk_idx_t = torch.int64  # deep_ep.topk_idx_t (compiled.cuh:54-72: 64 bits unless built with 32)


class Config:
    def __init__(self, num_sms: int, nvl_send: int, nvl_recv: int, rdma_send: int, rdma_recv: int) -> None:
        assert num_sms >= 0 and 0 < nvl_send < nvl_recv and 0 < rdma_send < rdma_recv
        self.num_sms = num_sms
        self.nvl_recv = nvl_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return (self.num_sms // 2) * min(num_ranks, 8) * self.nvl_recv * (hidden_bytes + 1024)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0 if num_ranks <= 8 else (self.num_sms // 2) * num_ranks * self.nvl_recv * hidden_bytes


class EventOverlap:
    def __init__(self, event: Any = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        pass


def _group_rank(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class Buffer:
    num_sms: int = 20
    # The kernels' tables (csrc/kernels/legacy/launch.cuh:53-64 SWITCH_RANKS, :66-89 SWITCH_RDMA_RANKS,
    # :113-134 SWITCH_HIDDEN) and limits; UCCL-EP's fake overrides them with its own.
    CONFIG_RANKS: tuple[int, ...] = CONFIG_RANKS
    INTRANODE_RANKS: tuple[int, ...] = (2, 4, 8)
    RDMA_GROUPS: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16, 18, 20)
    LL_HIDDEN: tuple[int, ...] = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
    LL_MAX_TOPK = 11  # csrc/kernels/legacy/internode_ll.cu:493, 1166
    NVSHMEM = True  # the low-latency calls assert the NVSHMEM queue depth (legacy.py:609, 665)
    LL_TOKENS_OF_FOUR = False  # UCCL-EP: ranks x max tokens a multiple of 4

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
    ) -> None:
        assert group is not None
        self.group = group
        self.rank, self.group_size = _group_rank(group)
        ranks = self.group_size
        # csrc/legacy/buffer.hpp:107-116, the C++ runtime's constructor.
        assert num_nvl_bytes % 128 == 0 and (num_nvl_bytes <= 2**31 - 1 or num_rdma_bytes == 0)
        assert num_rdma_bytes % 128 == 0 and (low_latency_mode or num_rdma_bytes <= 2**31 - 1)
        assert ranks <= NVL_PEERS * MAX_RDMA_PEERS or low_latency_mode
        assert ranks < NVL_PEERS or ranks % NVL_PEERS == 0
        if num_rdma_bytes > 0:
            assert ranks > NVL_PEERS or low_latency_mode
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.allow_mnnvl = allow_mnnvl
        self.num_rdma_ranks = max(1, ranks // NVL_PEERS)
        if self.num_rdma_ranks > 1 or low_latency_mode:  # legacy.py:105-126, before NVSHMEM starts
            assert num_qps_per_rank > 0
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
            os.environ["NVSHMEM_QP_DEPTH"] = str(self.nvshmem_qp_depth)
            if not allow_mnnvl:
                os.environ["NVSHMEM_DISABLE_MNNVL"] = "1"
        if num_nvl_bytes > 0:
            self._open_peer_handles()
        self.runtime: Any = object()
        dist.barrier(group=group)  # the constructor is collective (handles are all-gathered)
        options["low_latency" if low_latency_mode else "normal"] = {
            "num_qps_per_rank": num_qps_per_rank,
            "allow_mnnvl": allow_mnnvl,
            "allow_nvlink": allow_nvlink_for_low_latency_mode,
            "qp_depth": getattr(self, "nvshmem_qp_depth", None),
        }
        calls.append(f"Buffer(low_latency_mode={low_latency_mode})")

    def _open_peer_handles(self) -> None:
        """csrc/legacy/buffer.hpp:236-245 (sync): the buffers of the ranks of this rank's NVLink group of 8
        are opened: CUDA IPC handles, which fail for a GPU of another host, or with allow_mnnvl fabric
        handles (legacy.py:92-93 passes it as use_fabric), which fail outside the GPU fabric clique."""
        me = topology.place(self.rank)
        first = self.rank // NVL_PEERS * NVL_PEERS
        for peer in range(first, min(first + NVL_PEERS, self.group_size)):
            other = topology.place(peer)
            if me is None or other is None or peer == self.rank:
                continue
            if not self.allow_mnnvl and other.host != me.host:
                raise RuntimeError(
                    f"Failed: CUDA error buffer.hpp:242 'invalid device context': cudaIpcOpenMemHandle of "
                    f"rank {peer}'s buffer on host {other.host}"
                )
            if self.allow_mnnvl and other.domain_key != me.domain_key:
                raise RuntimeError(
                    "Failed: CUDA error buffer.hpp:242 'invalid resource handle': fabric handle of rank "
                    f"{peer}"
                )

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        assert self.runtime is not None
        self.runtime = None
        calls.append("destroy")

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @classmethod
    def get_dispatch_config(cls, num_ranks: int) -> Config:
        assert num_ranks in cls.CONFIG_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @classmethod
    def get_combine_config(cls, num_ranks: int) -> Config:
        assert num_ranks in cls.CONFIG_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return -(-2 * max_tokens * num_experts * (hidden * 2 + 64) // 128) * 128

    def _check_kernel_ranks(self) -> None:
        """The normal kernels compile for these rank counts only (launch.cuh SWITCH_RANKS in one NVLink
        group, SWITCH_RDMA_RANKS groups of 8): ``EP_HOST_ASSERT(false and "Unsupported ranks")``."""
        ranks = self.group_size
        if ranks <= NVL_PEERS:
            assert ranks in self.INTRANODE_RANKS, "Unsupported ranks"
        else:
            assert ranks // NVL_PEERS in self.RDMA_GROUPS, "Unsupported RDMA ranks"

    # -- normal kernels ---------------------------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, ...]:
        # legacy.py:301 ("dtype must be deep_ep.topk_idx_t"); buffer.hpp:343-345.
        assert topk_idx.dtype == topk_idx_t and topk_idx.dim() == 2 and topk_idx.is_contiguous()
        assert num_experts > 0 and num_experts % self.group_size == 0
        per_rank_experts = num_experts // self.group_size
        rank_of = torch.where(topk_idx >= 0, topk_idx // per_rank_experts, -1)
        in_rank = torch.zeros((topk_idx.shape[0], self.group_size), dtype=torch.bool)
        valid = rank_of >= 0
        rows = torch.arange(topk_idx.shape[0]).unsqueeze(1).expand_as(topk_idx)
        in_rank[rows[valid], rank_of[valid]] = True
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        calls.append("get_dispatch_layout")
        return in_rank.sum(0).to(torch.int32), None, per_expert, in_rank, EventOverlap()

    def dispatch(
        self,
        x: Any,
        handle: Any = None,
        num_tokens_per_rank: Any = None,
        num_tokens_per_rdma_rank: Any = None,
        is_token_in_rank: Any = None,
        num_tokens_per_expert: Any = None,
        topk_idx: Any = None,
        topk_weights: Any = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, ...]:
        assert handle is None, "the fake does not cache layouts"
        config = config or self.get_dispatch_config(self.group_size)  # legacy.py:375
        self._check_kernel_ranks()
        assert config.num_sms % 2 == 0  # buffer.hpp:436
        assert isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.dim() == 2
        assert x.is_contiguous() and (x.shape[1] * 2) % 16 == 0  # buffer.hpp:457-458
        assert (
            num_tokens_per_rank is not None
            and is_token_in_rank is not None
            and num_tokens_per_expert is not None
        )  # legacy.py:395
        assert is_token_in_rank.dtype == torch.bool and tuple(is_token_in_rank.shape) == (
            x.shape[0],
            self.group_size,
        )  # buffer.hpp:447, 460
        assert num_tokens_per_expert.numel() % self.group_size == 0  # buffer.hpp:468
        assert num_tokens_per_expert.numel() // self.group_size <= 1024  # :469 LEGACY_NUM_MAX_LOCAL_EXPERTS
        assert topk_idx.dtype == topk_idx_t and topk_idx.shape == topk_weights.shape
        assert topk_weights.dtype == torch.float32  # buffer.hpp:489
        assert self.num_nvl_bytes >= config.get_nvl_buffer_size_hint(x.shape[1] * 2, self.group_size)
        assert num_tokens_per_rank.tolist() == is_token_in_rank.sum(0).tolist()
        per_rank_experts = num_tokens_per_expert.numel() // self.group_size
        dst, token = torch.nonzero(is_token_in_rank.t(), as_tuple=True)  # destination-major, tokens ascending
        local = topk_idx[token] - (dst * per_rank_experts).unsqueeze(1)
        mine = (topk_idx[token] >= 0) & (local >= 0) & (local < per_rank_experts)
        source, recv_x, recv_idx, recv_weights, recv_token = send_to_ranks(
            self.group,
            dst,
            x[token],
            torch.where(mine, local, -1),
            torch.where(mine, topk_weights[token], 0.0),
            token,
        )
        counts = torch.bincount(source, minlength=self.group_size)
        prefix = torch.zeros((self.group_size, self.group_size), dtype=torch.int32)
        all_counts = [torch.zeros_like(counts) for _ in range(self.group_size)]
        dist.all_gather(all_counts, counts, group=self.group)
        prefix[:, :] = torch.cumsum(torch.stack(all_counts, dim=1), dim=0).to(torch.int32)  # [src, dst]
        per_expert = torch.bincount(recv_idx[recv_idx >= 0], minlength=per_rank_experts).tolist()
        handle = (prefix, None, None, recv_token.to(torch.int32), is_token_in_rank, (dst, token))
        calls.append("dispatch")
        return recv_x, recv_idx, recv_weights, per_expert, handle, EventOverlap()

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple,
        topk_weights: Any = None,
        bias: Any = None,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, ...]:
        config = config or self.get_combine_config(self.group_size)  # legacy.py:440
        self._check_kernel_ranks()
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous()  # buffer.hpp:732
        prefix, _, _, recv_token, is_token_in_rank, (_, token) = handle
        assert x.shape[0] == recv_token.numel(), "combine takes one row per received row"  # buffer.hpp:746
        column = prefix[:, self.rank].to(torch.int64)
        counts = column - torch.cat([column.new_zeros(1), column[:-1]])
        source = torch.repeat_interleave(torch.arange(self.group_size), counts)
        _, rows, owner_token = send_to_ranks(self.group, source, x, recv_token.to(torch.int64))
        assert torch.equal(torch.sort(owner_token).values, torch.sort(token).values)
        out = torch.zeros((is_token_in_rank.shape[0], x.shape[1]), dtype=torch.float32)
        out.index_add_(0, owner_token, rows.to(torch.float32))
        calls.append("combine")
        return out.to(torch.bfloat16), None, EventOverlap()

    # -- low-latency kernels --------------------------------------------------------------------------

    def _check_low_latency(self, hidden: int, topk: int, max_tokens: int) -> None:
        assert self.low_latency_mode, "low-latency kernels need a Buffer built with low_latency_mode=True"
        if self.NVSHMEM:  # legacy.py:609 / 665
            assert self.nvshmem_qp_depth >= (max_tokens + 1) * 2
        assert hidden in self.LL_HIDDEN, "Unsupported hidden"  # SWITCH_HIDDEN, internode_ll.cu:552, 1236
        assert topk <= self.LL_MAX_TOPK  # internode_ll.cu:501, 1179
        if self.LL_TOKENS_OF_FOUR:
            assert (self.group_size * max_tokens) % 4 == 0, (
                "TMA requires the number of tokens to be multiple of 4"
            )

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Any = None,
        dispatch_wait_recv_cost_stats: Any = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, ...]:
        assert not use_fp8, "the fake moves BF16 only (with FP8 the kernel quantizes)"
        hidden = x.shape[1]
        self._check_low_latency(hidden, topk_idx.shape[1], num_max_dispatch_tokens_per_rank)
        assert x.dtype == torch.bfloat16 and x.shape[0] <= num_max_dispatch_tokens_per_rank
        assert topk_idx.dtype == topk_idx_t
        hint = self.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts
        )
        assert self.num_rdma_bytes >= hint
        per_rank_experts = num_experts // self.group_size
        token, slot = torch.nonzero(topk_idx >= 0, as_tuple=True)
        expert = topk_idx[token, slot].to(torch.int64)
        source, rows, got_token, got_expert = send_to_ranks(
            self.group, expert // per_rank_experts, x[token], token, expert
        )
        local = got_expert - self.rank * per_rank_experts
        capacity = num_max_dispatch_tokens_per_rank * self.group_size
        recv_x = torch.full((per_rank_experts, capacity, hidden), float("nan"), dtype=torch.bfloat16)
        src_info = torch.full((per_rank_experts, capacity), -1, dtype=torch.int32)
        layout_range = torch.zeros((per_rank_experts, self.group_size), dtype=torch.int64)
        counts = torch.zeros(per_rank_experts, dtype=torch.int32)
        order = torch.argsort(
            local * (1 << 40) - source * (1 << 20) - got_token
        )  # sources, tokens descending
        for e in range(per_rank_experts):  # a handful of local experts: per-expert slices, not per token
            picked = order[local[order] == e]
            recv_x[e, : picked.numel()] = rows[picked]
            src_info[e, : picked.numel()] = got_token[picked].to(torch.int32)
            counts[e] = picked.numel()
            for s in range(self.group_size):
                from_s = (source[picked] == s).nonzero().flatten()
                begin = int(from_s[0]) if from_s.numel() else 0
                layout_range[e, s] = (from_s.numel() << 32) | begin
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        calls.append("low_latency_dispatch")
        return recv_x, counts, handle, EventOverlap(), None

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Any = None,
        combine_wait_recv_cost_stats: Any = None,
    ) -> tuple[Any, ...]:
        src_info, layout_range, max_tokens, hidden, num_experts = handle
        self._check_low_latency(hidden, topk_idx.shape[1], max_tokens)
        assert x.dtype == torch.bfloat16 and x.shape[2] == hidden and topk_weights.dtype == torch.float32
        per_rank_experts = num_experts // self.group_size
        rows, dst, token, expert = [], [], [], []
        for e in range(per_rank_experts):
            for s in range(self.group_size):
                count, begin = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & 0xFFFFFFFF
                rows.append(x[e, begin : begin + count])
                token.append(src_info[e, begin : begin + count].to(torch.int64))
                dst.append(torch.full((count,), s, dtype=torch.int64))
                expert.append(torch.full((count,), self.rank * per_rank_experts + e, dtype=torch.int64))
        _, back, owner_token, owner_expert = send_to_ranks(
            self.group, torch.cat(dst), torch.cat(rows), torch.cat(token), torch.cat(expert)
        )
        weight = ((topk_idx[owner_token] == owner_expert.unsqueeze(1)) * topk_weights[owner_token]).sum(1)
        combined = torch.zeros((topk_idx.shape[0], hidden), dtype=torch.float32)
        combined.index_add_(0, owner_token, back.to(torch.float32) * weight.unsqueeze(1))
        calls.append("low_latency_combine")
        return combined.to(torch.bfloat16), EventOverlap(), None


class ElasticBuffer:
    """DeepEP V2's ElasticBuffer (deep_ep/buffers/elastic.py) over gloo: the checks of its C++ dispatch and
    combine (csrc/elastic/buffer.hpp, lines at each assert)."""

    def __init__(
        self,
        group: Any,
        num_bytes: Any = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ) -> None:
        if num_bytes is None:  # calculate_buffer_size, buffer.hpp:657-662
            assert num_max_tokens_per_rank > 0 and hidden > 0
            assert -(-hidden // 32) * 4 <= hidden
        self.group = group
        self.rank_idx, self.num_ranks = _group_rank(group)
        self.num_max_tokens_per_rank, self.hidden = num_max_tokens_per_rank, hidden
        self.num_topk = num_topk or 32  # sized for 32 top-k entries when not given (buffer.hpp:662)
        self.explicitly_destroy, self.runtime = explicitly_destroy, object()
        dist.barrier(group=group)  # elastic.py:364-367: the constructor ends on a barrier
        calls.append("ElasticBuffer")

    def destroy(self) -> None:
        assert self.explicitly_destroy  # elastic.py:373
        self.runtime = None
        calls.append("elastic_destroy")

    def dispatch(
        self,
        x: Any,
        topk_idx: Any = None,
        topk_weights: Any = None,
        cumulative_local_expert_recv_stats: Any = None,
        num_experts: Any = None,
        num_max_tokens_per_rank: Any = None,
        expert_alignment: Any = None,
        num_sms: int = 0,
        num_qps: int = 0,
        handle: Any = None,
        do_cpu_sync: Any = None,
        do_expand: bool = False,
        **_: Any,
    ) -> tuple[Any, ...]:
        assert self.runtime is not None and handle is None and not do_expand
        max_tokens = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        assert isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.is_contiguous()
        assert (x.shape[1] * x.element_size()) % 16 == 0  # buffer.hpp:755
        assert x.shape[0] <= max_tokens  # :756
        assert topk_idx.dtype == topk_idx_t and topk_idx.is_contiguous()  # :777-778
        assert num_experts % self.num_ranks == 0  # :805
        assert num_sms <= 160  # :853 kNumMaxSMs
        # :963 the buffer sized at construction holds this dispatch (tokens, hidden, top-k).
        assert max_tokens <= self.num_max_tokens_per_rank and x.shape[1] <= self.hidden
        assert topk_idx.shape[1] <= self.num_topk
        per_rank = num_experts // self.num_ranks
        rank_of = torch.where(topk_idx >= 0, topk_idx // per_rank, -1)
        in_rank = torch.zeros((x.shape[0], self.num_ranks), dtype=torch.bool)
        valid = rank_of >= 0
        rows = torch.arange(x.shape[0]).unsqueeze(1).expand_as(topk_idx)
        in_rank[rows[valid], rank_of[valid]] = True
        dst, token = torch.nonzero(in_rank.t(), as_tuple=True)
        local = topk_idx[token] - (dst * per_rank).unsqueeze(1)
        mine = (topk_idx[token] >= 0) & (local >= 0) & (local < per_rank)
        source, got, got_idx, got_weights, got_token = send_to_ranks(
            self.group, dst, x[token], torch.where(mine, local, -1), topk_weights[token], token
        )
        order = torch.argsort((got_token * 7919 + source * 104729) % 1000003)  # the kernel's atomics
        handle = SimpleNamespace(source=source[order], token=got_token[order], num_tokens=x.shape[0])
        calls.append("elastic_dispatch")
        return got[order], got_idx[order], got_weights[order], handle, EventOverlap()

    def combine(
        self,
        x: torch.Tensor,
        handle: Any,
        topk_weights: Any = None,
        bias: Any = None,
        num_sms: int = 0,
        **_: Any,
    ) -> tuple[Any, ...]:
        assert x.is_contiguous() and x.dtype == torch.bfloat16  # buffer.hpp:1202-1203
        assert (x.shape[1] * x.element_size()) % 16 == 0  # :1204
        assert handle.num_tokens <= self.num_max_tokens_per_rank  # :1214
        assert x.shape[0] == handle.token.numel()
        _, back, owner_token = send_to_ranks(self.group, handle.source, x, handle.token)
        out = torch.zeros((handle.num_tokens, x.shape[1]), dtype=torch.float32)
        out.index_add_(0, owner_token, back.to(torch.float32))
        calls.append("elastic_combine")
        return out.to(torch.bfloat16), None, EventOverlap()


class HybridEPBuffer:
    def __init__(
        self,
        group: Any,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        num_sms_dispatch_api: Any = None,
        num_sms_combine_api: Any = None,
        **_: Any,
    ) -> None:
        self.group = group
        self.rank, self.group_size = _group_rank(group)
        self.local_rank = self.rank  # one NVLink domain: every rank of the group
        self.hidden_dim, self.max_tokens, self.num_local_experts = (
            hidden_dim,
            max_num_of_tokens_per_rank,
            num_local_experts,
        )
        assert not use_fp8
        calls.append("HybridEPBuffer")

    def dispatch(
        self,
        hidden: torch.Tensor,
        scaling_factor: Any = None,
        topk_idx: Any = None,
        topk_weights: Any = None,
        num_of_experts: Any = None,
        probs: Any = None,
        routing_map: Any = None,
        **_: Any,
    ) -> tuple[Any, ...]:
        if routing_map is None:  # indices_to_map: a -1 index fails in scatter, as in the library
            routing_map = torch.zeros(hidden.shape[0], num_of_experts, dtype=torch.bool).scatter(
                1, topk_idx, True
            )
            probs = torch.zeros(hidden.shape[0], num_of_experts).scatter(1, topk_idx, topk_weights)
        assert routing_map.dtype == torch.bool and hidden.shape[1] <= self.hidden_dim
        assert hidden.shape[0] <= self.max_tokens
        in_rank = routing_map.view(hidden.shape[0], self.group_size, self.num_local_experts).any(dim=2)
        dst, token = torch.nonzero(in_rank.t(), as_tuple=True)
        source, rows, got_probs, got_token = send_to_ranks(
            self.group, dst, hidden[token], probs[token], token
        )
        order = torch.argsort(source * (1 << 32) + (got_token * 7919) % 1009)  # scrambled inside each source
        capacity = self.max_tokens * self.group_size
        tokens_out = torch.full((capacity, hidden.shape[1]), float("nan"), dtype=torch.bfloat16)
        probs_out = torch.zeros((capacity, probs.shape[1]), dtype=torch.float32)
        tokens_out[: order.numel()] = rows[order]
        probs_out[: order.numel()] = got_probs[order]
        handle = (
            None,
            None,
            None,
            torch.tensor([order.numel()]),
            None,
            (source[order], got_token[order]),
            None,
        )
        calls.append("hybrid_dispatch")
        return tokens_out, probs_out, None, handle

    def combine(self, hidden: torch.Tensor, probs: Any = None, handle: Any = None) -> tuple[Any, ...]:
        source, token = handle[5]
        assert hidden.dtype == torch.bfloat16 and hidden.shape[0] == token.numel()
        _, back, owner_token = send_to_ranks(self.group, source, hidden, token)
        out = torch.zeros((self.max_tokens, hidden.shape[1]), dtype=torch.float32)
        out.index_add_(0, owner_token, back.to(torch.float32))
        calls.append("hybrid_combine")
        return out.to(torch.bfloat16), None


def module(hybrid: bool = False, name: str = "deep_ep", elastic: bool = True) -> ModuleType:
    """A fresh fake ``deep_ep`` module (with ``HybridEPBuffer`` when ``hybrid``, ``ElasticBuffer`` when
    ``elastic``: DeepEP 2.1.0 main has it)."""
    fake = ModuleType(name)
    fake.__version__ = VERSION
    fake.Buffer, fake.Config, fake.EventOverlap = Buffer, Config, EventOverlap
    fake.topk_idx_t = topk_idx_t
    if hybrid:
        fake.HybridEPBuffer = HybridEPBuffer
    if elastic:
        fake.ElasticBuffer = ElasticBuffer
    return fake


def install(hybrid: bool = False, elastic: bool = True, index_dtype: torch.dtype = torch.int64) -> None:
    global topk_idx_t
    calls.clear()
    options.clear()
    Buffer.num_sms = 20
    topk_idx_t = index_dtype
    install_modules({"deep_ep": module(hybrid, elastic=elastic)})

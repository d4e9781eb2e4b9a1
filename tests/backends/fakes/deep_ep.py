"""A fake ``deep_ep`` with DeepEP 2.1.0's API shape (``Buffer``, ``Config``) and the hybrid-ep branch's
``HybridEPBuffer``, moving rows between gloo ranks with DeepEP's layouts:

- normal ``dispatch``: a token once per destination rank; received rows source-major, tokens ascending (as
  the intranode kernels lay them out); ``recv_topk_idx`` local expert indices (-1 elsewhere) and
  ``recv_topk_weights`` (0 elsewhere); ``combine`` sums the returned rows per token without weights, in
  float32, output bf16;
- ``low_latency_dispatch``: one row per (token, expert) into ``[local experts, max tokens x ranks, hidden]``,
  each expert's rows in per-source blocks (sources descending, tokens descending inside: any order is
  DeepEP's right); ``low_latency_combine`` weights with the owner's top-k weights, output bf16;
- ``HybridEPBuffer``: a token once per destination rank, received rows in a scrambled order, probs over the
  node's experts; ``combine`` sums without weights.

Calls check their arguments as the library does (dtypes, shapes, buffer sizes, the config table's rank
counts), so an adapter that would fail on the real library fails here too.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from tests.backends.fakes import install_modules
from tests.backends.fakes.transport import send_to_ranks

VERSION = "2.1.0"
# DeepEP's recommended-config table covers these rank counts only (Buffer.get_dispatch_config asserts it).
CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
calls: list[str] = []  # every library call of this process, in order (tests read what ran)


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
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.runtime: Any = object()
        dist.barrier(group=group)  # the constructor is collective (handles are all-gathered)
        calls.append(f"Buffer(low_latency_mode={low_latency_mode})")

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        assert self.runtime is not None
        self.runtime = None
        calls.append("destroy")

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in CONFIG_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in CONFIG_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return 2 * max_tokens * num_experts * (hidden * 2 + 64)

    # -- normal kernels ---------------------------------------------------------------------------------

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, ...]:
        assert topk_idx.dtype == torch.int64 and topk_idx.dim() == 2
        assert num_experts % self.group_size == 0
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
        assert isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.dim() == 2
        assert (x.shape[1] * 2) % 16 == 0, "hidden bytes must be a multiple of int4"
        assert (
            num_tokens_per_rank is not None
            and is_token_in_rank is not None
            and num_tokens_per_expert is not None
        )
        assert topk_idx.shape == topk_weights.shape and topk_weights.dtype == torch.float32
        config = config or self.get_dispatch_config(self.group_size)
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
        assert x.dtype == torch.bfloat16 and x.dim() == 2
        prefix, _, _, recv_token, is_token_in_rank, (_, token) = handle
        assert x.shape[0] == recv_token.numel(), "combine takes one row per received row"
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
        assert self.low_latency_mode, "low-latency kernels need a Buffer built with low_latency_mode=True"
        assert not use_fp8, "the fake moves BF16 only (with FP8 the kernel quantizes)"
        assert x.dtype == torch.bfloat16 and x.shape[0] <= num_max_dispatch_tokens_per_rank
        hidden = x.shape[1]
        hint = self.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts
        )
        assert self.num_rdma_bytes >= hint
        per_rank_experts = num_experts // self.group_size
        token, slot = torch.nonzero(topk_idx >= 0, as_tuple=True)
        expert = topk_idx[token, slot]
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


def module(hybrid: bool = False, name: str = "deep_ep") -> ModuleType:
    """A fresh fake ``deep_ep`` module (with ``HybridEPBuffer`` when ``hybrid``)."""
    fake = ModuleType(name)
    fake.__version__ = VERSION
    fake.Buffer, fake.Config, fake.EventOverlap = Buffer, Config, EventOverlap
    if hybrid:
        fake.HybridEPBuffer = HybridEPBuffer
    return fake


def install(hybrid: bool = False) -> None:
    calls.clear()
    Buffer.num_sms = 20
    install_modules({"deep_ep": module(hybrid)})

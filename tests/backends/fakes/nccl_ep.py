"""A fake nccl4py ``nccl.ep`` (0.3.1's API shape: ``Group``, ``GroupConfig``, ``Handle``, ``Tensor``, the
dispatch/combine bundles, ``interop.torch.get_nccl_comm_from_group``), moving rows between gloo ranks:

- HT (``Layout.FLAT``): a token once per destination rank, the N(r) received rows first in a scrambled order,
  ``outputs.topk_idx`` local expert indices (-1 elsewhere) while ``outputs.topk_weights`` keeps every weight
  (so a caller must mask by the indices); ``combine`` sums without weights, output bf16;
- LL (``Layout.EXPERT_MAJOR``): one row per selection into ``[local experts, max tokens x ranks, hidden]``
  with ``layout_info.expert_counters``; ``combine`` weights with ``outputs.topk_weights``, output bf16.

The routing is the handle's (``create_handle``/``update``); arguments are checked as ``nccl_ep.h`` says, and
every precondition NCCL EP asserts at NVIDIA/nccl 5067397 is enforced (contrib/nccl_ep/nccl_ep.cc, lines at
each check): HT's 8192 tokens per rank and experts per node a multiple of 4, LL's hidden sizes and top-k,
the SM budget, the experts dividing over the ranks, the receive buffers' sizes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from tests.backends.fakes import install_modules
from tests.backends.fakes.transport import send_to_ranks

calls: list[str] = []
HT_MAX_TOKENS = 8192  # include/common.hpp:26 MAX_SUPPORTED_TOKENS_PER_RANK
LL_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)  # device/macros.cuh:161-171 SWITCH_HIDDEN
LL_MAX_TOPK = 9  # device/low_latency.cu:1022, 1951
DEVICE_SMS = 132  # the SMs of the GPU the fake stands for (an H100)


class Algorithm(enum.IntEnum):
    LOW_LATENCY = 0
    HIGH_THROUGHPUT = 1


class Layout(enum.IntEnum):
    UNSET = 0
    EXPERT_MAJOR = 1
    RANK_MAJOR = 2
    FLAT = 3


class Tensor:
    def __init__(self, buffer: torch.Tensor, **_: Any) -> None:
        assert isinstance(buffer, torch.Tensor) and buffer.is_contiguous()
        self.buffer = buffer


@dataclass
class GroupConfig:
    algorithm: Algorithm = Algorithm.LOW_LATENCY
    num_experts: int = 0
    max_dispatch_tokens_per_rank: int = 0
    max_recv_tokens_per_rank: int = 0
    max_token_bytes: int = 0
    rdma_buffer_size: int = 0
    num_qp_per_rank: int = 0
    num_channels: int = 0
    max_num_sms: int = 0
    enable_mask: bool = False
    timeout_ns: int = 0


@dataclass
class HandleConfig:
    dispatch_output_per_expert_alignment: int = 0


@dataclass
class DispatchConfig:
    send_only: int = 0
    round_scales: int = 0


@dataclass
class CombineConfig:
    send_only: int = 0


@dataclass
class LayoutInfo:
    expert_counters: Tensor | None = None
    src_rank_counters: Tensor | None = None
    expert_offsets: Tensor | None = None
    recv_total_counter: Tensor | None = None


@dataclass
class DispatchInputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None


@dataclass
class DispatchOutputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None
    topk_idx: Tensor | None = None


@dataclass
class CombineInputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None


@dataclass
class CombineOutputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None


class Communicator:
    def __init__(self, group: Any) -> None:
        self.group = group
        self.alive = True

    def destroy(self) -> None:
        self.alive = False
        calls.append("comm.destroy")


def get_nccl_comm_from_group(group: Any = None) -> Communicator:
    calls.append("get_nccl_comm_from_group")
    return Communicator(group if group is not None else dist.group.WORLD)


class Handle:
    def __init__(self, group: Group, layout: Layout, topk_idx: Tensor) -> None:
        self.group, self.layout = group, layout
        self.topk_idx = topk_idx.buffer.clone()
        self.route: tuple[torch.Tensor, ...] | None = None

    def update(self, topk_idx: Tensor, *, layout_info: Any = None, stream: Any) -> None:
        assert isinstance(stream, int)
        self.topk_idx = topk_idx.buffer.clone()
        calls.append("update")

    def dispatch(
        self,
        inputs: DispatchInputs,
        outputs: DispatchOutputs,
        *,
        layout_info: Any = None,
        config: Any = None,
        stream: Any,
    ) -> None:
        config_ = self.group.config
        x = inputs.tokens.buffer
        assert x.dim() == 2 and x.shape[0] <= config_.max_dispatch_tokens_per_rank  # nccl_ep.cc:2641-2642
        assert x.shape[1] * x.element_size() <= config_.max_token_bytes  # :2643-2644
        assert x.dtype == torch.bfloat16  # :2682 (no FP8 scales given)
        world = dist.get_world_size(self.group.torch_group)
        rank = dist.get_rank(self.group.torch_group)
        per_rank = config_.num_experts // world
        topk = self.topk_idx
        if self.layout == Layout.FLAT:
            # :2690-2692 a node's experts' probabilities load 16 bytes at a time (one node here: every rank)
            assert (per_rank * world * 4) % 16 == 0, (
                "HT dispatch requires experts_per_node to be multiple of 4"
            )
            assert (x.shape[1] * x.element_size()) % 16 == 0  # :2694-2697
            recv_rows = config_.max_recv_tokens_per_rank
            assert outputs.topk_weights.buffer.shape[0] >= recv_rows  # :2941-2944
            assert (
                outputs.topk_idx.buffer.shape[0] >= recv_rows and outputs.topk_idx.buffer.dtype == torch.int64
            )
        else:
            hidden = x.shape[1]
            assert hidden in LL_HIDDEN, "Unsupported hidden"  # SWITCH_HIDDEN, low_latency.cu:1100-1102
            assert topk.shape[1] <= LL_MAX_TOPK  # low_latency.cu:1030
        if self.layout == Layout.FLAT:
            assert inputs.topk_weights is not None, "HT forward dispatch needs inputs.topk_weights"
            weights = inputs.topk_weights.buffer
            in_rank = torch.zeros((topk.shape[0], world), dtype=torch.bool)
            valid = topk >= 0
            rows = torch.arange(topk.shape[0]).unsqueeze(1).expand_as(topk)
            in_rank[rows[valid], (topk // per_rank)[valid]] = True
            dst, token = torch.nonzero(in_rank.t(), as_tuple=True)
            local = topk[token] - (dst * per_rank).unsqueeze(1)
            mine = (topk[token] >= 0) & (local >= 0) & (local < per_rank)
            source, got, got_idx, got_w, got_token = send_to_ranks(
                self.group.torch_group, dst, x[token], torch.where(mine, local, -1), weights[token], token
            )
            order = torch.argsort(-source * (1 << 32) + got_token)  # sources descending
            count = order.numel()
            assert count <= outputs.tokens.buffer.shape[0] <= config_.max_recv_tokens_per_rank
            outputs.tokens.buffer[:count] = got[order]
            outputs.topk_idx.buffer[:count] = got_idx[order]
            outputs.topk_weights.buffer[:count] = got_w[order]
            self.route = (source[order], got_token[order], x.shape[0])
        else:
            token, slot = torch.nonzero(topk >= 0, as_tuple=True)
            expert = topk[token, slot]
            source, got, got_token, got_expert = send_to_ranks(
                self.group.torch_group, expert // per_rank, x[token], token, expert
            )
            local = got_expert - rank * per_rank
            out = outputs.tokens.buffer
            order = torch.argsort(local * (1 << 40) - source * (1 << 20) - got_token)
            counts = torch.bincount(local, minlength=per_rank)
            first = torch.cumsum(counts, 0) - counts
            positions = torch.empty_like(order)
            positions[order] = local[order] * out.shape[1] + torch.arange(order.numel()) - first[local[order]]
            out.view(-1, out.shape[-1])[positions] = got
            layout_info.expert_counters.buffer.copy_(counts.to(torch.int32))
            self.route = (positions, source, got_token, got_expert, x.shape[0])
        calls.append("dispatch")

    def combine(
        self, inputs: CombineInputs, outputs: CombineOutputs, *, config: Any = None, stream: Any
    ) -> None:
        assert self.route is not None
        y, out = inputs.tokens.buffer, outputs.tokens.buffer
        assert y.dtype == torch.bfloat16 and out.dtype == torch.bfloat16  # nccl_ep.cc:3184
        if self.layout == Layout.FLAT:  # FWD combine: no input weights (:3246-3251, topk_weights forbidden)
            assert inputs.topk_weights is None
        else:
            assert self.topk_idx.shape[1] <= LL_MAX_TOPK  # low_latency.cu:2002
        if self.layout == Layout.FLAT:
            source, token, num_tokens = self.route
            assert y.shape[0] == token.numel()
            _, back, owner_token = send_to_ranks(self.group.torch_group, source, y, token)
            weight = torch.ones(owner_token.numel())
        else:
            positions, source, token, expert, num_tokens = self.route
            rows = y.reshape(-1, y.shape[-1])[positions]
            _, back, owner_token, owner_expert = send_to_ranks(
                self.group.torch_group, source, rows, token, expert
            )
            weights = outputs.topk_weights.buffer
            weight = ((self.topk_idx[owner_token] == owner_expert.unsqueeze(1)) * weights[owner_token]).sum(1)
        combined = torch.zeros((num_tokens, y.shape[-1]), dtype=torch.float32)
        combined.index_add_(0, owner_token, back.to(torch.float32) * weight.unsqueeze(1))
        out[:num_tokens] = combined.to(torch.bfloat16)
        calls.append("combine")

    def destroy(self) -> None:
        calls.append("handle.destroy")


class Group:
    def __init__(self, comm: Communicator, config: GroupConfig) -> None:
        self.comm, self.config, self.torch_group = comm, config, comm.group

    @classmethod
    def create(cls, comm: Communicator, config: GroupConfig) -> Group:
        assert (
            config.num_experts > 0 and config.max_dispatch_tokens_per_rank > 0 and config.max_token_bytes > 0
        )  # nccl_ep.cc:1247-1252
        if config.algorithm == Algorithm.HIGH_THROUGHPUT:
            assert config.max_dispatch_tokens_per_rank <= HT_MAX_TOKENS  # :1253-1255
            assert config.max_recv_tokens_per_rank > 0  # :1331-1333
            assert config.max_recv_tokens_per_rank >= config.max_dispatch_tokens_per_rank  # :1334-1336
        assert config.max_num_sms <= DEVICE_SMS  # :1297-1299
        if config.algorithm == Algorithm.LOW_LATENCY and config.max_num_sms:  # :1301-1310
            assert -(-config.num_experts // config.max_num_sms) <= 14, "insufficient 'max_num_sms'"
        calls.append(f"Group.create({Algorithm(config.algorithm).name})")
        return cls(comm, config)

    def create_handle(
        self, layout: Layout, topk_idx: Tensor, *, layout_info: Any = None, config: Any = None, stream: Any
    ) -> Handle:
        assert layout != Layout.UNSET and isinstance(stream, int)
        allowed = (
            (Layout.FLAT, Layout.EXPERT_MAJOR)
            if self.config.algorithm == Algorithm.HIGH_THROUGHPUT
            else (Layout.EXPERT_MAJOR, Layout.RANK_MAJOR)
        )
        assert layout in allowed  # nccl_ep.cc:2137-2146
        assert topk_idx.buffer.dtype == torch.int64
        world = dist.get_world_size(self.torch_group)
        assert self.config.num_experts % world == 0  # :2148
        calls.append("create_handle")
        return Handle(self, Layout(layout), topk_idx)

    def destroy(self) -> None:
        calls.append("group.destroy")


def install() -> None:
    calls.clear()
    nccl = ModuleType("nccl")
    nccl.__path__ = []
    ep = ModuleType("nccl.ep")
    ep.__path__ = []
    for item in (
        Algorithm,
        Layout,
        Tensor,
        GroupConfig,
        HandleConfig,
        DispatchConfig,
        CombineConfig,
        LayoutInfo,
        DispatchInputs,
        DispatchOutputs,
        CombineInputs,
        CombineOutputs,
        Group,
        Handle,
    ):
        setattr(ep, item.__name__, item)
    interop = ModuleType("nccl.ep.interop")
    interop.__path__ = []
    torch_interop = ModuleType("nccl.ep.interop.torch")
    torch_interop.get_nccl_comm_from_group = get_nccl_comm_from_group
    install_modules(
        {"nccl": nccl, "nccl.ep": ep, "nccl.ep.interop": interop, "nccl.ep.interop.torch": torch_interop}
    )

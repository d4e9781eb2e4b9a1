"""NCCL EP adapter (``--backend nccl-ep``): NCCL's expert-parallel dispatch and combine via nccl4py's nccl.ep.

NCCL EP (github.com/NVIDIA/nccl, ``contrib/nccl_ep``: ``ncclEpCreateGroup``, ``ncclEpCreateHandle``,
``ncclEpDispatch``, ``ncclEpCombine``) has a Python binding: nccl4py's ``nccl.ep`` package
(``bindings/nccl4py/nccl/ep``: ``Group``, ``GroupConfig``, ``Handle``, ``Tensor``, the ``Dispatch*`` /
``Combine*`` bundles, ``interop.torch.get_nccl_comm_from_group``). Follows nccl4py 0.3.1 at NVIDIA/nccl
master 5067397, read at the source (``nccl/ep/*.py``, ``contrib/nccl_ep/include/nccl_ep.h``,
``contrib/nccl_ep/ep_test.py``); not run here (no GPU; nccl4py's NCCL EP supports CUDA 13 only).

- ``mode=ht`` (``Algorithm.HIGH_THROUGHPUT``, ``Layout.FLAT``): the routing is bound to the handle
  (``Handle.update(topk_idx)``, which exchanges the metadata, inside the timed dispatch), ``dispatch``
  with ``DispatchInputs(tokens, topk_weights)`` into ``DispatchOutputs(tokens [slots, hidden], topk_weights,
  topk_idx)`` (received rows first, local expert indices, -1 unused), ``combine`` of ``[N(r), hidden]`` rows
  (a sum without weights in the forward pass: the expert side weights its rows with the received weights).
  A token goes once per destination rank: ``--send-mode token`` (or the balanced all-to-all); each rank
  stands as ``HT_EXPERTS_PER_RANK`` experts, a token's row addressed to the first, since HT's TMA loads a
  node's experts' probabilities 16 bytes at a time (experts per node a multiple of 4, nccl_ep.cc:2690-2692).
- ``mode=ll`` (``Algorithm.LOW_LATENCY``, ``Layout.EXPERT_MAJOR``): ``dispatch`` into ``[local experts,
  max tokens x ranks, hidden]`` with ``LayoutInfo(expert_counters)``, ``combine`` with
  ``CombineOutputs(tokens, topk_weights)`` (weighted on the token's side). One row per selection, as a
  model's routing makes the kernel send: ``--send-mode selection``; rows travel as BF16 of the combine's
  hidden size both ways (BF16 dispatch rows).

Preconditions checked before NCCL EP is called (read at 5067397, file:line in docs/plugins.md): HT at most
8192 tokens per rank (MAX_SUPPORTED_TOKENS_PER_RANK), LL hidden sizes of its SWITCH_HIDDEN, at most 9
experts per token, and ``max_num_sms`` within the GPU and enough for the experts (at most 14 warp groups).

Tokens are commbench's rows viewed as BF16 (``max_token_bytes`` = the larger row). Knobs: ``mode``,
``num_channels``, ``max_num_sms``, ``num_qp_per_rank``, ``rdma_buffer_size`` (0 = NCCL EP's choice), and in
the rows ``nccl4py_version``.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, ClassVar

import torch

from commbench.backends.adapters.bandwidth import NCCL_EP
from commbench.backends.adapters.common import (
    MAX_BUFFER_BYTES,
    MAX_QPS,
    MAX_SMS,
    DispatcherBackend,
    PeerShape,
    local_weights,
    scatter_rows,
)
from commbench.backends.options import BackendOption
from commbench.errors import UsageError
from commbench.traffic.plan import RankPlan

HT, LL = "ht", "ll"
MAX_CHANNELS = 1024
# Read at NVIDIA/nccl 5067397 (contrib/nccl_ep):
HT_MAX_TOKENS = (
    8192  # include/common.hpp:26 MAX_SUPPORTED_TOKENS_PER_RANK; nccl_ep.cc:1253-1255 asserts it (HT)
)
HT_EXPERTS_PER_RANK = 4  # nccl_ep.cc:2690-2692: experts per node x 4 bytes a multiple of 16 (TMA)
LL_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)  # device/macros.cuh:161-171 SWITCH_HIDDEN
LL_MAX_TOPK = 9  # device/low_latency.cu:1022 kNumMaxTopK, :1951 kCombineMaxTopk
LL_MAX_WARP_GROUPS = 14  # nccl_ep.cc:1301-1310: ceil(experts / max_num_sms) <= 14


class NcclEpBackend(DispatcherBackend):
    name = "nccl-ep"
    LIBRARY = "nccl.ep"
    DISPLAY = "NCCL EP"
    INSTALL = "pip install nccl4py[cu13] (nccl4py >= 0.3.1, which ships NCCL EP as nccl.ep)"
    API_VERSION = "nccl4py 0.3.1 nccl.ep (NVIDIA/nccl master 5067397)"
    bandwidth_vocabulary = NCCL_EP
    OPTIONS: ClassVar[tuple[BackendOption, ...]] = (
        BackendOption(
            "mode", str, HT, "ht (high throughput, flat) or ll (low latency, per expert)", choices=(HT, LL)
        ),
        BackendOption(
            "num_channels",
            int,
            0,
            "channels per rank (HT: 2 SMs each); 0 = auto",
            minimum=0,
            maximum=MAX_CHANNELS,
        ),
        BackendOption("max_num_sms", int, 0, "most SMs for EP kernels; 0 = auto", minimum=0, maximum=MAX_SMS),
        BackendOption("num_qp_per_rank", int, 0, "QPs per rank; 0 = auto", minimum=0, maximum=MAX_QPS),
        BackendOption(
            "rdma_buffer_size", int, 0, "RDMA buffer bytes; 0 = default", minimum=0, maximum=MAX_BUFFER_BYTES
        ),
    )

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.mode: str = self.settings["mode"]
        self.nccl_comm: Any = None
        self.ep_group: Any = None
        self.handle: Any = None
        self._key: tuple[Any, ...] = ()
        self._permutation: torch.Tensor | None = None
        self._recv_weights = torch.zeros(0)
        self._index = torch.zeros(0, dtype=torch.int64)

    @property
    def label(self) -> str:
        return f"{self.name} {self.mode}"

    @property
    def library_version(self) -> str:
        try:
            return metadata.version("nccl4py")
        except metadata.PackageNotFoundError:
            return "unknown"

    def knobs(self) -> dict[str, Any]:
        tunables = {key: self.settings[key] for key in ("num_channels", "max_num_sms", "num_qp_per_rank")}
        return {
            "mode": self.mode,
            **tunables,
            "rdma_buffer_size": self.settings["rdma_buffer_size"],
            "nccl4py_version": self.library_version,
        }

    def experts_per_rank(self, shape: PeerShape) -> int:
        """The experts each rank stands as: HT's token mode HT_EXPERTS_PER_RANK (module docstring)."""
        return HT_EXPERTS_PER_RANK if self.mode == HT else shape.experts_per_rank

    def check_shape(self, shape: PeerShape) -> None:
        """UsageError (one line) for what NCCL EP would assert on (module docstring)."""
        if self.mode == HT and shape.send_mode == "selection":
            raise UsageError(
                f"--backend {self.name} mode=ht sends a token once per destination rank: use --send-mode "
                "token (or mode=ll for one row per (token, expert))"
            )
        if self.mode == LL and shape.send_mode == "token":
            raise UsageError(
                f"--backend {self.name} mode=ll sends one message per (token, expert) selection, as a "
                "model's top-k routing makes it; --send-mode token hands it the routing de-duplicated per "
                "destination rank, so it would send fewer messages than the model's: use --send-mode "
                "selection"
            )
        if self.mode == LL and shape.hidden and shape.row_bytes != 2 * shape.hidden:
            raise UsageError(
                f"--backend {self.name} mode=ll moves BF16 tokens of one hidden size both ways; this model's "
                f"dispatch rows are {shape.row_bytes} B and its combine rows {2 * shape.hidden} B (FP8 "
                "dispatch): use a model with dispatch_dtype bf16, or mode=ht"
            )
        if self.mode == HT and shape.max_tokens > HT_MAX_TOKENS:
            raise UsageError(
                f"--backend {self.name} mode=ht takes at most {HT_MAX_TOKENS} tokens per rank "
                f"(MAX_SUPPORTED_TOKENS_PER_RANK, contrib/nccl_ep/include/common.hpp:26); this job has "
                f"{shape.max_tokens}: use --tokens {HT_MAX_TOKENS} or fewer"
            )
        if self.mode == LL:
            self._check_ll(shape)

    def _check_ll(self, shape: PeerShape) -> None:
        hidden = shape.row_bytes // 2
        if hidden not in LL_HIDDEN:
            raise UsageError(
                f"--backend {self.name} mode=ll runs hidden sizes {', '.join(map(str, LL_HIDDEN))} only "
                f"(SWITCH_HIDDEN, contrib/nccl_ep/device/macros.cuh:161); this model's rows are {hidden} "
                "BF16 elements: use a model of one of those hidden sizes, or mode=ht"
            )
        if shape.topk > LL_MAX_TOPK:
            raise UsageError(
                f"--backend {self.name} mode=ll takes at most {LL_MAX_TOPK} experts per token (kNumMaxTopK, "
                f"contrib/nccl_ep/device/low_latency.cu:1022); this routing has {shape.topk}"
            )
        sms = self.settings["max_num_sms"]
        if sms and -(-shape.num_experts // sms) > LL_MAX_WARP_GROUPS:
            need = -(-shape.num_experts // LL_MAX_WARP_GROUPS)
            raise UsageError(
                f"backend {self.name} option max_num_sms={sms}: mode=ll needs at least {need} SMs for "
                f"{shape.num_experts} experts (nccl_ep.cc:1301-1310); raise it or leave it 0"
            )
        device = self.comm.device
        if sms and device.type == "cuda":
            count = torch.cuda.get_device_properties(device).multi_processor_count
            if sms > count:
                raise UsageError(
                    f"backend {self.name} option max_num_sms={sms} exceeds this GPU's {count} SMs "
                    "(nccl_ep.cc:1297-1299)"
                )

    def prepare(self, plan: RankPlan, shape: PeerShape) -> None:
        self.check_shape(shape)
        lib, device = self.lib, self.comm.device
        experts = shape.world_size * self.experts_per_rank(shape)
        key = (experts, shape.max_tokens, shape.row_bytes, shape.hidden)
        if self.ep_group is None or key != self._key:
            self._destroy_group()
            if self.nccl_comm is None:
                interop = importlib.import_module(f"{self.LIBRARY}.interop.torch")
                self.nccl_comm = interop.get_nccl_comm_from_group(self.group)
            config = lib.GroupConfig(
                algorithm=lib.Algorithm.HIGH_THROUGHPUT if self.mode == HT else lib.Algorithm.LOW_LATENCY,
                num_experts=experts,
                max_dispatch_tokens_per_rank=shape.max_tokens,
                max_recv_tokens_per_rank=shape.max_tokens * shape.world_size,
                max_token_bytes=max(shape.row_bytes, 2 * shape.hidden),
                rdma_buffer_size=self.settings["rdma_buffer_size"],
                num_qp_per_rank=self.settings["num_qp_per_rank"],
                num_channels=self.settings["num_channels"],
                max_num_sms=self.settings["max_num_sms"],
            )
            self.ep_group = lib.Group.create(self.nccl_comm, config)
            self._key = key
        self._destroy_handle()
        if self.mode == HT:  # a token's row to the first of its destination rank's experts
            self.topk_idx = torch.where(self.topk_idx >= 0, self.topk_idx * HT_EXPERTS_PER_RANK, -1)
        self.topk_tensor = lib.Tensor(self.topk_idx)
        self.weights_tensor = lib.Tensor(self.topk_weights)
        layout = lib.Layout.FLAT if self.mode == HT else lib.Layout.EXPERT_MAJOR
        self.handle = self.ep_group.create_handle(
            layout, self.topk_tensor, config=lib.HandleConfig(), stream=self.stream_pointer()
        )
        self._buffers(shape, device)

    def _buffers(self, shape: PeerShape, device: torch.device) -> None:
        lib = self.lib
        capacity, width, hidden = shape.max_tokens * shape.world_size, shape.row_bytes // 2, shape.hidden
        combine_hidden = hidden or width
        self.combine_out = torch.empty(
            (shape.max_tokens, combine_hidden), dtype=torch.bfloat16, device=device
        )
        if self.mode == HT:
            self.recv_tokens = torch.empty((capacity, width), dtype=torch.bfloat16, device=device)
            self.recv_weights = torch.zeros((capacity, shape.topk), dtype=torch.float32, device=device)
            self.recv_idx = torch.full((capacity, shape.topk), -1, dtype=torch.int64, device=device)
            self.combine_in = torch.zeros((capacity, combine_hidden), dtype=torch.bfloat16, device=device)
            self.dispatch_out = lib.DispatchOutputs(
                tokens=lib.Tensor(self.recv_tokens),
                topk_weights=lib.Tensor(self.recv_weights),
                topk_idx=lib.Tensor(self.recv_idx),
            )
            self.layout_info = None
            return
        experts = shape.experts_per_rank
        self.recv_tokens = torch.empty((experts, capacity, width), dtype=torch.bfloat16, device=device)
        self.expert_counts = torch.zeros(experts, dtype=torch.int32, device=device)
        self.combine_in = torch.zeros(
            (experts, capacity, combine_hidden), dtype=torch.bfloat16, device=device
        )
        self.dispatch_out = lib.DispatchOutputs(tokens=lib.Tensor(self.recv_tokens))
        self.layout_info = lib.LayoutInfo(expert_counters=lib.Tensor(self.expert_counts))

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        lib, stream = self.lib, self.stream_pointer()
        with self.steps("layout"):  # HT: the routing metadata exchange
            self.handle.update(self.topk_tensor, stream=stream)
        sent = lib.Tensor(tokens.view(torch.bfloat16))
        # HT's forward pass takes the routing weights with the tokens; LL gets them at combine.
        inputs = lib.DispatchInputs(
            tokens=sent, topk_weights=self.weights_tensor if self.mode == HT else None
        )
        with self.steps("library dispatch"):
            self.handle.dispatch(
                inputs,
                self.dispatch_out,
                layout_info=self.layout_info,
                config=lib.DispatchConfig(),
                stream=stream,
            )
        if self.mode == LL:
            self.hold(recv_tokens=self.recv_tokens, expert_counts=self.expert_counts)
            rows, self._index = self.expert_major_rows(self.recv_tokens.view(torch.uint8))
            return rows
        # The flat layout holds N(r) received rows first: as many as the plans send this rank.
        count = self.expected_rows
        self.hold(recv_tokens=self.recv_tokens, recv_weights=self.recv_weights, recv_idx=self.recv_idx)
        with self.steps("weights"):
            self._recv_weights = local_weights(self.recv_idx[:count], self.recv_weights[:count])
        rows, self._permutation = self.flat_rows(self.recv_tokens[:count].view(torch.uint8))
        return rows

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        lib, stream = self.lib, self.stream_pointer()
        if self.mode == LL:
            with self.steps("pack"):
                self.combine_in.view(-1, self.combine_in.shape[-1]).index_copy_(0, self._index, expert_out)
            inputs = lib.CombineInputs(tokens=lib.Tensor(self.combine_in))
            outputs = lib.CombineOutputs(
                tokens=lib.Tensor(self.combine_out), topk_weights=self.weights_tensor
            )
        else:
            weights = (
                self._recv_weights if self._permutation is None else self._recv_weights[self._permutation]
            )
            weighted = self.weighted_rows(expert_out, weights)
            with self.steps("pack"):
                rows = scatter_rows(weighted, self._permutation, self.combine_in)
            inputs = lib.CombineInputs(tokens=lib.Tensor(rows))
            outputs = lib.CombineOutputs(tokens=lib.Tensor(self.combine_out))
        with self.steps("library combine"):
            self.handle.combine(inputs, outputs, config=lib.CombineConfig(), stream=stream)
        self.hold(combined=self.combine_out)
        return self.combined(self.combine_out, plan.num_tokens)

    def _destroy_handle(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.destroy()

    def _destroy_group(self) -> None:
        self._destroy_handle()
        group, self.ep_group, self._key = self.ep_group, None, ()
        if group is not None:
            group.destroy()

    def close(self) -> None:
        self._destroy_group()
        comm, self.nccl_comm = self.nccl_comm, None
        if comm is not None and hasattr(comm, "destroy"):
            comm.destroy()
        super().close()

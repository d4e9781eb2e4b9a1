"""What the dispatcher adapters share: the lazy library import, a plan as top-k routing, received rows put
back in commbench's order, the expert-side weighting, held outputs poisoned, and how a library defines the
bandwidth it prints.

How a plan maps onto a dispatcher. A plan's send rows are (token, key) pairs: key = destination rank in
token mode (a token goes once to each rank holding one of its experts, DeepEP normal kernels) and in the
balanced all-to-all (token i to rank i), expert id in selection mode (one row per (token, expert)). The
adapter gives the library a routing that produces exactly those rows: ``topk_idx[t, j]`` = the key of token
t's j-th row, read as an expert id; in token mode every rank then holds one "expert" (``experts_per_rank``
1), so per-rank de-duplication and per-expert copies both give one row per (token, destination rank).
``topk_weights[t, j]`` = that row's combine weight. Unused entries are -1 / 0. The width K is the most rows
any token of any rank has (``PeerShape``), so every rank builds the library's buffers alike.

Rows travel as the library's token payload: the uint8 row viewed as bf16 elements where the library wants
bf16 (DeepEP, UCCL-EP, NCCL EP: row bytes / 2 elements; the library copies bytes, so every byte arrives as
sent), or as raw bytes where it takes a byte size (pplx-kernels). Rows must be a multiple of 16 bytes (the
libraries move 16-byte vectors).

Order. A library receives rows in its own layout (per expert, per channel, ...). commbench verifies rows in
source-rank order, each source's rows in the order it sent them (token mode: tokens ascending; selection
mode: by (expert, token)). Every row starts with its source rank and token index (``traffic.payload``), so
``order_keys`` sorts by (source, slot the library put the row in, token): a row the library misdelivered
lands out of place and verification counts it. A mode whose library documents commbench's order (DeepEP's
normal kernels: ``LIBRARY_ORDER = SOURCE_ORDER``) is checked once at set-up (one untimed dispatch of the
job's own rows, headers read on the host); when it holds, nothing is copied in the timed calls. Every
other layout is put in order by one gather inside the timed call, as a framework's un-permute would, with
its keys sorted on the device: no host sync is added to what the library's own benchmark times.

Counts. These libraries exchange their counts inside their dispatch call (timed); commbench's own
``recv_counts`` (which the harness uses to derive expert outputs) come from every rank's plan, as the
expected rows do, so ``exchange_counts`` adds no collective. The same plans give, at set-up, how many rows
arrive (``expected_rows``) and how many at each local expert (``expected_slot_rows``): the timed calls
take the valid part of a library's receive buffer from them, never by reading the library's device-side
counts back to the host (a slot the library left unwritten holds the poison, which verification counts).

Set-up. Each adapter refuses what its library cannot run before the library is called (the preconditions
read in its source, listed in docs/plugins.md), and any AssertionError the library still raises while the
buffers are built is one line (``UsageError``, exit 2) naming the library's own words and where it raised.

Combine. Each library reduces in bf16 (or fp16) and hands back bf16: the rows returned here are that
output widened to float32, so they carry bf16 rounding, about 2^-8 relative (``combine_rtol``). Where the
library sums without weights (DeepEP normal, Hybrid-EP, NCCL EP HT), the expert side multiplies each row by
the weights the library delivered with it (its local top-k weights), as a model's expert layer does; where
it weights on the token's side (low-latency kernels, pplx-kernels), the token owner's top-k weights go in.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from commbench.backends.base import grown_buffer
from commbench.backends.options import DeclaredOptions
from commbench.errors import UsageError
from commbench.hardware.probes import local_place
from commbench.inputs.layout import Layout, build_layout
from commbench.run.interface import Backend
from commbench.traffic.payload import HEADER_BYTES, encode_rows, poison_
from commbench.traffic.plan import RankPlan

# How a library lays out the rows it received (``DispatcherBackend.LIBRARY_ORDER``): commbench's own order
# (by source rank, each source's rows as it sent them), checked once at set-up; or any order, sorted on the
# device in every call.
SOURCE_ORDER, ANY_ORDER = "source", "any"
ROW_ALIGN_BYTES = 16
# Bounds of the buffer-size and SM knobs: far beyond any GPU, they only refuse typos.
MAX_BUFFER_BYTES = 1 << 40
MAX_SMS = 1024
MAX_QPS = 1024
# bf16 keeps 8 significant bits: a value rounded once to bf16 is within 2^-9 of it. The expert side's
# weighted row and the library's bf16 output are two roundings (plus float32 accumulation): 2^-7 bounds them.
BF16_COMBINE_RTOL = 2.0**-7


@dataclass(frozen=True)
class PeerShape:
    """The exchange as every rank's plans describe it, the same on every rank (so every rank sizes the
    library's buffers alike)."""

    world_size: int
    send_mode: str
    experts_per_rank: int  # selection mode: the model's; token mode and balanced: 1 (one key per rank)
    topk: int  # K: the most send rows of one token on any rank (>= 1)
    max_tokens: int  # the most tokens on any rank (>= 1)
    row_bytes: int  # dispatch row bytes
    hidden: int  # combine row elements (bf16); 0 without a combine phase (balanced)
    uniform: bool  # every token of every rank has exactly ``topk`` rows (no token routed to fewer)

    @property
    def num_experts(self) -> int:
        return self.world_size * self.experts_per_rank

    @classmethod
    def of(cls, plans: Sequence[RankPlan]) -> PeerShape:
        first = plans[0]
        per_rank = int(first.send_counts.shape[1]) if first.send_mode == "selection" else 1
        per_token = [torch.bincount(plan.send_token_index.cpu(), minlength=plan.num_tokens) for plan in plans]
        topk = max([1, *(int(rows.max()) for rows in per_token if rows.numel())])
        return cls(
            world_size=first.world_size,
            send_mode=first.send_mode,
            experts_per_rank=per_rank,
            topk=topk,
            max_tokens=max([1, *(plan.num_tokens for plan in plans)]),
            row_bytes=int(first.dispatch_row_bytes),
            hidden=int(first.combine_row_bytes) // 2,
            uniform=all(bool((rows == topk).all()) for rows in per_token),
        )


def routed_tokens(plan: RankPlan, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx int64 [T, topk], topk_weights float32 [T, topk]) whose selections are exactly ``plan``'s
    send rows (module docstring), on the plan's device; unused entries -1 and 0. A token's rows keep the
    plan's order (ascending key)."""
    token = plan.send_token_index
    device = token.device
    count = token.numel()
    topk_idx = torch.full((plan.num_tokens, topk), -1, dtype=torch.int64, device=device)
    topk_weights = torch.zeros((plan.num_tokens, topk), dtype=torch.float32, device=device)
    if count:
        order = torch.argsort(token, stable=True)
        sorted_token = token[order]
        rows = torch.bincount(token, minlength=plan.num_tokens)
        first = torch.cumsum(rows, 0) - rows
        position = torch.arange(count, device=device) - first[sorted_token]
        topk_idx[sorted_token, position] = plan.send_key[order]
        topk_weights[sorted_token, position] = plan.combine_weight[order].to(torch.float32)
    return topk_idx, topk_weights


def order_keys(rows: torch.Tensor, slot: torch.Tensor | int, num_slots: int) -> torch.Tensor:
    """int64 sort key of each received uint8 row: (source rank, ``slot``, token index), the source and token
    read from the row's header. Sorting by it gives commbench's order (``slot`` = the local expert a
    per-expert library put the row in; 0 for flat layouts)."""
    header = rows[:, :HEADER_BYTES].contiguous().view(torch.int32).to(torch.int64)
    source, token = header[:, 0], header[:, 1] & 0xFFFFFFFF
    return ((source * num_slots + slot) << 32) + token


def expert_major_slots(
    counts: Sequence[int], capacity: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat row index into an [experts, capacity, ...] buffer, local expert of each row) of the first
    ``counts[e]`` rows of every expert ``e``."""
    sizes = torch.tensor(list(counts), dtype=torch.int64, device=device)
    total = int(sum(counts))
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes, output_size=total)
    first = torch.cumsum(sizes, 0) - sizes
    within = torch.arange(total, device=device) - first[expert]
    return expert * capacity + within, expert


def rank_layout(comm: Any) -> Layout:
    """Collective: where every rank runs (host, NVLink domain: the GPU fabric clique where NVML reports one,
    else the host), from each rank's ``local_place``, the same on every rank. The hardware's own places:
    the --ranks-per-domain overrides are what-ifs for the report, not where the library's peers are."""
    device = getattr(comm, "device", None)
    index = device.index if device is not None and device.type == "cuda" else None
    places = comm.all_gather_object(local_place(index))
    return build_layout(comm.world_size, discovered=places)


def peer_groups(world_size: int, per_group: int) -> list[range]:
    """Consecutive rank groups of ``per_group`` (the whole world when it is smaller): the ranks a library
    connects through NVLink (DeepEP's normal kernels: each 8 consecutive ranks)."""
    size = min(world_size, per_group)
    return [range(first, min(first + size, world_size)) for first in range(0, world_size, size)]


def group_reach(layout: Layout, group: range) -> tuple[int, int]:
    """(NVLink domains, hosts) the ranks of ``group`` span."""
    ranks = list(group)
    return len(set(layout.domain_of_rank[ranks].tolist())), len(set(layout.host_of_rank[ranks].tolist()))


def next_power_of_two(value: int) -> int:
    return 1 << max(0, int(value) - 1).bit_length()


@contextlib.contextmanager
def library_refusals(backend: str, library: str, what: str = "set-up") -> Iterator[None]:
    """An AssertionError of the library while its buffers are built, or a C++ assertion it raised as a
    RuntimeError (DeepEP's EP_HOST_ASSERT: "Assertion error <file>:<line> '<condition>'"), becomes one line
    (UsageError, exit 2) with the library's own words and where it raised, instead of a traceback."""
    try:
        yield
    except AssertionError as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
        words = " ".join(str(exc).split())[:300] or "assert failed"
        raise UsageError(
            f"--backend {backend}: {library} refused the {what}{where}: {words} (a precondition commbench "
            "does not check yet; see docs/plugins.md for the ones it does)"
        ) from None
    except RuntimeError as exc:
        text = " ".join(str(exc).split())
        if "assert" not in text.lower():
            raise
        raise UsageError(f"--backend {backend}: {library} refused the {what}: {text[:300]}") from None


class DispatcherBackend(DeclaredOptions, Backend):
    """A backend that drives another library's dispatch/combine (the subclasses: one per library).

    A subclass names its library (``LIBRARY``: the module imported lazily; ``DISPLAY``, ``INSTALL``,
    ``API_VERSION``: the version whose API it follows), declares its knobs (``OPTIONS``) and how its
    library defines bandwidth (``bandwidth_vocabulary``) and its kernels' names (``kernel_patterns``), and
    implements ``prepare`` (the library's buffers for a job, untimed, collective), ``dispatch`` and
    ``combine``."""

    LIBRARY: ClassVar[str] = ""
    DISPLAY: ClassVar[str] = ""
    INSTALL: ClassVar[str] = ""
    API_VERSION: ClassVar[str] = ""
    # The receive order the library promises (module docstring, "Order"): SOURCE_ORDER is checked at set-up.
    LIBRARY_ORDER: ClassVar[str] = ANY_ORDER
    # The library needs its ranks on NCCL with one GPU each, and its figures are a GPU fabric's (judged).
    process_group: ClassVar[str] = "nccl"
    gpu_fabric: ClassVar[bool] = True
    # The combine output's precision: the library reduces in bf16 (module docstring).
    combine_rtol: ClassVar[float] = BF16_COMBINE_RTOL

    @classmethod
    def import_library(cls) -> ModuleType:
        """The library's module; UsageError (one line) naming what to install when it does not import."""
        try:
            return importlib.import_module(cls.LIBRARY)
        except Exception as exc:  # noqa: BLE001 - a broken install fails any way; the reason is the message
            text = " ".join(str(exc).split())[:200]
            raise UsageError(
                f"--backend {cls.name} needs {cls.DISPLAY} ({cls.INSTALL}); import {cls.LIBRARY} failed: "
                f"{type(exc).__name__}: {text}"
            ) from None

    @classmethod
    def check_available(cls) -> None:
        """UsageError (one line, exit 2) unless the library imports and this host has CUDA devices (the
        launch puts the ranks on ``process_group``, one GPU each)."""
        cls.import_library()
        if torch.cuda.device_count() < 1:
            raise UsageError(
                f"--backend {cls.name} needs CUDA GPUs ({cls.DISPLAY} runs on GPUs only); this host has no "
                "CUDA device"
            )

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.settings = self.check_options(self.options)
        self.lib = self.import_library()
        self.group = comm.group if comm.group is not None else dist.group.WORLD
        self.shape: PeerShape | None = None
        self.topk_idx = torch.zeros(0, 1, dtype=torch.int64)
        self.topk_weights = torch.zeros(0, 1, dtype=torch.float32)
        self._peers: list[RankPlan] | None = None
        self._recv_counts = torch.zeros(0, 1, dtype=torch.int64)
        self._held: dict[str, torch.Tensor] = {}
        self._rows: torch.Tensor | None = None
        self._combined: torch.Tensor | None = None
        self._weighted: torch.Tensor | None = None
        # What arrives here, from every rank's plan (module docstring, "Counts"): host integers.
        self.expected_rows = 0
        self.expected_slot_rows: list[int] = []
        self._slots: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (capacity, index, slot)
        self._in_order = False  # set-up found the library's order to be commbench's
        self._probing = False
        self._probe_sorted = False
        self._layout: Layout | None = None

    @property
    def library_version(self) -> str:
        return str(getattr(self.lib, "__version__", "") or "unknown")

    def setup_peers(self, plans: Sequence[RankPlan]) -> None:
        self._peers = list(plans)

    def setup(self, plan: RankPlan) -> None:
        if self._peers is None:
            raise RuntimeError(f"{type(self).__name__}.setup needs setup_peers(plans of every rank) first")
        shape = PeerShape.of(self._peers)
        if shape.row_bytes < ROW_ALIGN_BYTES or shape.row_bytes % ROW_ALIGN_BYTES:
            raise UsageError(
                f"--backend {self.name}: rows of {shape.row_bytes} B cannot travel through {self.DISPLAY}, "
                f"which moves tokens in {ROW_ALIGN_BYTES}-byte units; use row sizes that are a multiple of "
                f"{ROW_ALIGN_BYTES} B (balanced sizes of {ROW_ALIGN_BYTES} x ranks bytes and multiples)"
            )
        me = self.comm.rank
        self.shape = shape
        recv_counts = torch.stack([peer.send_counts[me].cpu() for peer in self._peers])
        self.expected_rows = int(recv_counts.sum())
        self.expected_slot_rows = [int(count) for count in recv_counts.sum(dim=0).tolist()]
        self._slots = None
        self._recv_counts = recv_counts.to(self.comm.device)
        topk_idx, self.topk_weights = routed_tokens(plan, shape.topk)
        self.topk_idx = topk_idx.to(self.index_dtype())
        self._held = {}
        with library_refusals(self.name, self.DISPLAY):
            self.prepare(plan, shape)
            self._in_order = self.library_order() == SOURCE_ORDER and self._check_order(plan)

    def library_order(self) -> str:
        """How the library lays out the rows it received (``SOURCE_ORDER`` or ``ANY_ORDER``)."""
        return self.LIBRARY_ORDER

    def index_dtype(self) -> torch.dtype:
        """The dtype the library takes top-k expert ids in (int64 unless it says otherwise)."""
        return torch.int64

    def layout(self) -> Layout:
        """Where every rank runs (``rank_layout``), gathered at the first set-up that needs it."""
        if self._layout is None:
            self._layout = rank_layout(self.comm)
        return self._layout

    def _check_order(self, plan: RankPlan) -> bool:
        """One untimed dispatch of this job's own rows: whether the library handed them back in commbench's
        order (read on the host, once), so the timed calls copy nothing. Collective, as dispatch is."""
        tokens = encode_rows(self.comm.rank, torch.arange(plan.num_tokens), plan.dispatch_row_bytes)
        self._probing, self._probe_sorted = True, True
        try:
            self.dispatch(tokens.to(self.comm.device), plan, self._recv_counts)
        finally:
            self._probing = False
        self.poison_receive_buffers()
        return self._probe_sorted

    def prepare(self, plan: RankPlan, shape: PeerShape) -> None:
        """The library's buffers for this job (untimed; every rank calls it at the same point)."""
        raise NotImplementedError

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        # The library exchanges its counts inside its dispatch call (timed); see the module docstring.
        return self._recv_counts

    def hold(self, **outputs: torch.Tensor | None) -> None:
        """Keep the library outputs the last call read (by name: a dispatch's replace the previous
        dispatch's), so ``poison_receive_buffers`` poisons them and memory recycled from them holds the
        sentinel: a call that silently moves nothing cannot pass on an earlier call's rows."""
        self._held.update((name, out) for name, out in outputs.items() if isinstance(out, torch.Tensor))

    def poison_receive_buffers(self) -> None:
        for buffer in (*self._held.values(), self._rows, self._combined):
            if buffer is not None and buffer.is_contiguous():
                poison_(buffer)

    def flat_rows(self, received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows in commbench's order, the permutation applied or None) of the rows a library received
        (uint8 [n, row_bytes]; a caller slices a buffer of capacity rows to ``expected_rows``): no copy when
        set-up found the library's order to be commbench's, else one gather by keys sorted on the device (no
        host sync)."""
        with self.steps("unpack"):
            if self._in_order:
                return received, None
            keys = order_keys(received, 0, 1)
            if self._probing and keys.numel() > 1:  # set-up only: the one host read of the order
                self._probe_sorted = bool((keys[1:] >= keys[:-1]).all())
            permutation = torch.argsort(keys, stable=True)
            return self.gather_rows(received, permutation), permutation

    def expert_major_rows(self, received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows in commbench's order, their flat index into the buffer) of a per-expert receive buffer
        (uint8 [experts, capacity, row_bytes]): expert e's first ``expected_slot_rows[e]`` rows, as every
        rank's plan says (the library's own counts stay on the device)."""
        experts, capacity, row_bytes = received.shape
        flat = received.reshape(experts * capacity, row_bytes)
        with self.steps("unpack"):
            index, slot = self.slot_index(capacity, received.device)
            keys = order_keys(flat[:, :HEADER_BYTES].index_select(0, index), slot, experts)
            index = index[torch.argsort(keys, stable=True)]
            return self.gather_rows(flat, index), index

    def slot_index(self, capacity: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat index, local expert) of the rows the plans send to each local expert of a per-expert
        buffer of ``capacity`` rows per expert, built once per set-up."""
        if self._slots is None or self._slots[0] != capacity:
            counts = [min(count, capacity) for count in self.expected_slot_rows]
            self._slots = (capacity, *expert_major_slots(counts, capacity, device))
        return self._slots[1], self._slots[2]

    def gather_rows(self, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        count = int(index.numel())
        self._rows = grown_buffer(self._rows, count, tuple(source.shape[1:]), source.dtype, source.device)
        return torch.index_select(source, 0, index, out=self._rows[:count])

    def weighted_rows(self, expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """bf16 ``expert_out * weights`` per row (float32 product, one rounding), in a reused buffer: what an
        expert layer hands a library that sums combine rows without weights."""
        count, hidden = int(expert_out.shape[0]), int(expert_out.shape[1])
        self._weighted = grown_buffer(self._weighted, count, (hidden,), torch.bfloat16, expert_out.device)
        with self.steps("weight"):  # computed in float32, rounded once into the bf16 buffer
            return torch.mul(expert_out, weights.to(torch.float32).unsqueeze(1), out=self._weighted[:count])

    def combined(self, output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The library's combine output (bf16 [>= num_tokens, hidden]) as float32 [num_tokens, hidden] in a
        reused buffer."""
        hidden = int(output.shape[1])
        self._combined = grown_buffer(self._combined, num_tokens, (hidden,), torch.float32, output.device)
        with self.steps("widen"):
            return self._combined[:num_tokens].copy_(output[:num_tokens])

    def stream_pointer(self) -> int:
        """The current CUDA stream of this rank's device as an integer handle (0 on CPU)."""
        device = self.comm.device
        return int(torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else 0

    def close(self) -> None:
        self._held = {}
        self._rows = self._combined = self._weighted = None


def local_weights(topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """float32 [n]: per received row, the sum of its weights on this rank's experts (entries whose local
    expert index is -1 are other ranks')."""
    return torch.where(topk_idx >= 0, topk_weights.to(torch.float32), 0.0).sum(dim=1)


def scatter_rows(rows: torch.Tensor, permutation: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``rows`` (commbench's order) into ``out`` in the library's order: out[permutation[i]] = rows[i];
    ``rows`` itself when the orders agree (``permutation`` None)."""
    if permutation is None:
        return rows
    count = int(rows.shape[0])
    target = out[:count]
    target.index_copy_(0, permutation, rows)
    return target

"""pplx-kernels adapter (``--backend pplx``): Perplexity's ``AllToAll`` dispatch and combine.

Follows pplx-kernels 0.0.1 at main 2bd6e30 (github.com/perplexityai/pplx-kernels,
``src/pplx_kernels/all_to_all.py`` and ``csrc/bindings/all_to_all_ops.cpp``), read at the source; not run
here (no GPU). ``AllToAll.intranode(max_num_tokens, num_experts, experts_per_token, rank, world_size,
dp_size, hidden_dim, hidden_dim_bytes, hidden_dim_scale_bytes, group_name)`` (or ``internode(...)`` after
``nvshmem_init``, ``mode=internode``) is built once per job size; per call ``dispatch(out_expert_num_tokens,
out_expert_x, out_expert_x_scale, dp_x, dp_x_scale, indices, bound_m)`` writes every local expert's tokens
into ``out_expert_x[expert, :count]`` and ``combine(out_tokens, indices, weights, expert_y, bound_m)``
reduces the expert outputs with the token owner's weights into ``out_tokens``.

Mapping. ``dp_x`` is commbench's uint8 rows as they are (``hidden_dim_bytes`` = row bytes: the kernel
copies bytes; ``hidden_dim`` = the combine's BF16 elements), ``indices`` the plan's top-k as uint32 (one
row per selection). pplx-kernels routes every token to exactly ``experts_per_token`` experts and has no
"unused" index, so it runs selection mode (or the balanced all-to-all) of routings that drop no selection
(no ``--mask-ratio`` / ``--capacity-factor``). ``dp_size`` is 1 (every rank its own tokens). ``intranode``
shares buffers through CUDA IPC handles (``csrc/all_to_all/intranode.cpp:63-119``), which open on one host
only: ranks on several hosts need ``mode=internode``, refused otherwise before the library is called;
``internode`` takes a ``cuda.core`` Device for NVSHMEM's bootstrap (``tests/bench_all_to_all.py:249-254``),
imported there and named in one line when missing. Knobs:
``mode`` (intranode | internode), and in the rows ``max_num_tokens``, ``experts_per_token``,
``pplx_kernels_version``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from commbench.backends.adapters.bandwidth import PPLX
from commbench.backends.adapters.common import DispatcherBackend, PeerShape
from commbench.backends.options import BackendOption
from commbench.errors import UsageError
from commbench.run.describe import COMMUNICATION, KernelPattern, kernel_names
from commbench.traffic.plan import RankPlan

INTRANODE, INTERNODE = "intranode", "internode"
# Template arguments are part of the pattern: these kernel names are generic, pplx's signatures are not.
KERNELS = (
    KernelPattern(
        "pplx",
        COMMUNICATION,
        kernel_names(
            r"(?:\(anonymous namespace\)::)?dispatchKernel<\d+u?, (?:true|false), (?:true|false)>"
            r"|(?:\(anonymous namespace\)::)?combineKernel<[\w: ]+, [\w: ]+, \d+u?l*, (?:true|false), "
            r"(?:true|false)>"
        ),
        "perplexityai/pplx-kernels csrc/all_to_all/{intranode,internode}_{dispatch,combine}.cu",
    ),
)


def cuda_core_device() -> Any:
    """cuda.core's ``Device`` class, which pplx-kernels' NVSHMEM bootstrap takes (its own benchmark passes
    ``Device(local_rank)``); UsageError (one line) naming what to install when it does not import."""
    try:
        from cuda.core.experimental import Device
    except Exception as exc:  # noqa: BLE001 - a missing or broken install fails any way; the reason is the message
        text = " ".join(str(exc).split())[:200]
        raise UsageError(
            "--backend pplx mode=internode needs cuda.core for NVSHMEM's bootstrap (pip install "
            f"cuda-core); import cuda.core.experimental failed: {type(exc).__name__}: {text}"
        ) from None
    return Device


class PplxBackend(DispatcherBackend):
    name = "pplx"
    LIBRARY = "pplx_kernels"
    DISPLAY = "pplx-kernels"
    INSTALL = "pip install github.com/perplexityai/pplx-kernels (needs NVSHMEM)"
    API_VERSION = "pplx-kernels 0.0.1 (main 2bd6e30)"
    bandwidth_vocabulary = PPLX
    kernel_patterns = KERNELS
    OPTIONS: ClassVar[tuple[BackendOption, ...]] = (
        BackendOption(
            "mode",
            str,
            INTRANODE,
            "intranode (NVLink, CUDA IPC) or internode (NVSHMEM)",
            choices=(INTRANODE, INTERNODE),
        ),
    )

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.mode: str = self.settings["mode"]
        self.all_to_all: Any = None
        self._key: tuple[Any, ...] = ()
        self._nvshmem_ready = False
        self._index = torch.zeros(0, dtype=torch.int64)

    @property
    def label(self) -> str:
        return f"{self.name} {self.mode}"

    def knobs(self) -> dict[str, Any]:
        shape = self.shape
        return {
            "mode": self.mode,
            "max_num_tokens": shape.max_tokens if shape else None,
            "experts_per_token": shape.topk if shape else None,
            "pplx_kernels_version": self.library_version,
        }

    def prepare(self, plan: RankPlan, shape: PeerShape) -> None:
        if self.mode == INTRANODE and shape.world_size > 1 and self.layout().num_hosts > 1:
            raise UsageError(
                f"--backend {self.name} mode=intranode shares its buffers through CUDA IPC handles, which "
                f"open on one host only (csrc/all_to_all/intranode.cpp:75-119); these {shape.world_size} "
                f"ranks run on {self.layout().num_hosts} hosts: use mode=internode (NVSHMEM)"
            )
        if shape.world_size < 2:
            raise UsageError(f"--backend {self.name} needs at least 2 ranks (pplx-kernels asserts it)")
        if not shape.uniform:
            raise UsageError(
                f"--backend {self.name}: pplx-kernels sends every token to exactly experts_per_token experts "
                "and has no unused index; this job's tokens have different numbers of rows (token mode, or "
                "dropped selections): use --send-mode selection without --mask-ratio / --capacity-factor"
            )
        device = self.comm.device
        hidden = shape.hidden or shape.row_bytes // 2
        experts, capacity = shape.experts_per_rank, shape.max_tokens * shape.world_size
        key = (shape.max_tokens, shape.num_experts, shape.topk, shape.row_bytes, hidden)
        if self.all_to_all is None or key != self._key:
            self._destroy()
            self.all_to_all = self._create(shape, hidden)
            self._key = key
        self.indices = self.topk_idx.to(torch.uint32)
        self.bound_m = torch.tensor([plan.num_tokens], dtype=torch.uint32, device=device)
        self.expert_counts = torch.zeros(experts, dtype=torch.int32, device=device)
        self.expert_x = torch.empty((experts, capacity, shape.row_bytes), dtype=torch.uint8, device=device)
        self.expert_y = torch.zeros((experts, capacity, hidden), dtype=torch.bfloat16, device=device)
        self.out_tokens = torch.empty((shape.max_tokens, hidden), dtype=torch.bfloat16, device=device)

    def _create(self, shape: PeerShape, hidden: int) -> Any:
        arguments = {
            "max_num_tokens": shape.max_tokens,
            "num_experts": shape.num_experts,
            "experts_per_token": shape.topk,
            "rank": self.comm.rank,
            "world_size": shape.world_size,
            "dp_size": 1,
            "hidden_dim": hidden,
            "hidden_dim_bytes": shape.row_bytes,
            "hidden_dim_scale_bytes": 0,
        }
        if self.mode == INTRANODE:
            return self.lib.AllToAll.intranode(**arguments, group_name=self.group.group_name)
        if not self._nvshmem_ready:
            device_class = cuda_core_device()
            local = self.comm.device.index or 0
            self.lib.nvshmem_init(
                global_rank=self.comm.rank,
                local_rank=local,
                world_size=shape.world_size,
                device=device_class(local),
            )
            self._nvshmem_ready = True
        return self.lib.AllToAll.internode(**arguments)

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        with self.steps("library dispatch"):
            self.all_to_all.dispatch(
                out_expert_num_tokens=self.expert_counts,
                out_expert_x=self.expert_x,
                out_expert_x_scale=None,
                dp_x=tokens,
                dp_x_scale=None,
                indices=self.indices,
                bound_m=self.bound_m,
            )
        self.hold(expert_x=self.expert_x, expert_counts=self.expert_counts)
        rows, self._index = self.expert_major_rows(self.expert_x)
        return rows

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        with self.steps("pack"):
            self.expert_y.view(-1, self.expert_y.shape[-1]).index_copy_(0, self._index, expert_out)
        with self.steps("library combine"):
            self.all_to_all.combine(
                out_tokens=self.out_tokens,
                indices=self.indices,
                weights=self.topk_weights,
                expert_y=self.expert_y,
                bound_m=self.bound_m,
            )
        self.hold(combined=self.out_tokens)
        return self.combined(self.out_tokens, plan.num_tokens)

    def _destroy(self) -> None:
        all_to_all, self.all_to_all, self._key = self.all_to_all, None, ()
        if all_to_all is not None:
            all_to_all.destroy()

    def close(self) -> None:
        self._destroy()
        super().close()

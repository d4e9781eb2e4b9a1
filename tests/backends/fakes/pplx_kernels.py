"""A fake ``pplx_kernels`` with pplx-kernels 0.0.1's API shape (``AllToAll.intranode/internode``,
``dispatch``, ``combine``, ``nvshmem_init``), moving rows between gloo ranks: dispatch writes every local
expert's rows into ``out_expert_x[expert, :count]`` (sources descending, tokens descending inside: the kernel
promises no order), combine weights with the owner's weights and writes ``out_tokens`` in its dtype. Checks
its arguments as the binding does (uint32 indices, float32 weights, sizes, one ``bound_m``)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from tests.backends.fakes import install_modules, topology
from tests.backends.fakes.transport import send_to_ranks

calls: list[str] = []
nvshmem: dict[str, Any] = {}


def nvshmem_init(global_rank: int, local_rank: int, world_size: int, device: Any, uid: Any = None) -> None:
    nvshmem.update(rank=global_rank, world_size=world_size, device=device)
    calls.append("nvshmem_init")


def _open_ipc_handles(world_size: int) -> None:
    """intranode.cpp:63-119: every rank's buffers are shared through cudaIpcGetMemHandle and opened with
    cudaIpcOpenMemHandle, which fails for a GPU on another host (``topology.PLACES``)."""
    mine = topology.place(dist.get_rank())
    for peer in range(world_size):
        other = topology.place(peer)
        if mine is not None and other is not None and other.host != mine.host:
            raise RuntimeError(f"CUDA error: invalid device context (cudaIpcOpenMemHandle of rank {peer})")


class AllToAll:
    def __init__(self, settings: dict[str, Any], group: Any) -> None:
        self.settings, self.group = settings, group
        self.layout: tuple[torch.Tensor, ...] | None = None
        self.alive = True

    @classmethod
    def _create(cls, kind: str, group: Any, **settings: Any) -> AllToAll:
        assert settings["world_size"] % settings["dp_size"] == 0  # src/pplx_kernels/all_to_all.py:102
        assert settings["world_size"] // settings["dp_size"] > 1  # :103
        assert settings["hidden_dim_bytes"] % 16 == 0  # csrc/all_to_all/all_to_all.cpp:32
        assert settings["num_experts"] >= settings["world_size"]  # :37 numLocalExperts != 0
        assert settings["hidden_dim_scale_bytes"] == 0, "the fake carries no scales"
        calls.append(kind)
        return cls(settings, group)

    @classmethod
    def intranode(
        cls,
        max_num_tokens: int,
        num_experts: int,
        experts_per_token: int,
        rank: int,
        world_size: int,
        dp_size: int,
        hidden_dim: int,
        hidden_dim_bytes: int,
        hidden_dim_scale_bytes: int,
        group_name: str = "default",
    ) -> AllToAll:
        group = dist.group.WORLD
        assert group_name == group.group_name, f"no process group named {group_name!r}"
        _open_ipc_handles(world_size)
        settings = dict(locals())
        for key in ("cls", "group_name", "group"):
            settings.pop(key)
        return cls._create("intranode", group, **settings)

    @classmethod
    def internode(
        cls,
        max_num_tokens: int,
        num_experts: int,
        experts_per_token: int,
        rank: int,
        world_size: int,
        dp_size: int,
        hidden_dim: int,
        hidden_dim_bytes: int,
        hidden_dim_scale_bytes: int,
    ) -> AllToAll:
        assert nvshmem.get("world_size") == world_size, "NVSHMEM is not initialized (nvshmem_init)"
        settings = dict(locals())
        settings.pop("cls")
        return cls._create("internode", dist.group.WORLD, **settings)

    def dispatch(
        self,
        out_expert_num_tokens: torch.Tensor,
        out_expert_x: torch.Tensor,
        out_expert_x_scale: Any,
        dp_x: torch.Tensor,
        dp_x_scale: Any,
        indices: torch.Tensor,
        bound_m: Any,
        do_send: bool = True,
        do_recv: bool = True,
    ) -> None:
        settings = self.settings
        assert self.alive and out_expert_x_scale is None and dp_x_scale is None
        assert (
            indices.dtype == torch.uint32
            and indices.shape
            == (  # csrc/bindings/all_to_all_ops.cpp:152-165
                dp_x.shape[0],
                settings["experts_per_token"],
            )
        )
        assert dp_x.shape[0] <= settings["max_num_tokens"]  # intranode_dispatch.cu:65
        assert dp_x.dim() == 2 and dp_x.shape[1] * dp_x.element_size() == settings["hidden_dim_bytes"]
        assert bound_m.dtype == torch.uint32 and bound_m.numel() == 1 and int(bound_m.item()) == dp_x.shape[0]
        world, experts = settings["world_size"], settings["num_experts"]
        per_rank = experts // world
        expert = indices.to(torch.int64)
        token = torch.arange(dp_x.shape[0]).unsqueeze(1).expand_as(expert).reshape(-1)
        expert = expert.reshape(-1)
        assert bool((expert < experts).all())
        source, rows, got_token, got_expert = send_to_ranks(
            self.group, expert // per_rank, dp_x[token], token, expert
        )
        local = got_expert - settings["rank"] * per_rank
        order = torch.argsort(local * (1 << 40) - source * (1 << 20) - got_token)
        positions = torch.empty_like(order)
        counts = torch.bincount(local, minlength=per_rank)
        assert out_expert_x.shape[1] >= int(counts.max()) if counts.numel() else True
        first = torch.cumsum(counts, 0) - counts
        sorted_local = local[order]
        positions[order] = (
            sorted_local * out_expert_x.shape[1] + torch.arange(order.numel()) - first[sorted_local]
        )
        out_expert_x.view(-1, out_expert_x.shape[-1])[positions] = rows.view(out_expert_x.dtype)
        out_expert_num_tokens.copy_(counts.to(torch.int32))
        self.layout = (positions, source, got_token, got_expert)
        calls.append("dispatch")

    def combine(
        self,
        out_tokens: torch.Tensor,
        indices: torch.Tensor,
        weights: torch.Tensor,
        expert_y: torch.Tensor,
        bound_m: Any,
        do_send: bool = True,
        do_recv: bool = True,
    ) -> None:
        assert self.alive and self.layout is not None
        assert indices.dtype == torch.uint32 and weights.dtype == torch.float32
        assert expert_y.dtype in (torch.float32, torch.bfloat16, torch.float16)
        assert out_tokens.dtype in (torch.bfloat16, torch.float16)
        assert expert_y.shape[-1] == out_tokens.shape[1] == self.settings["hidden_dim"]
        positions, source, token, expert = self.layout
        rows = expert_y.reshape(-1, expert_y.shape[-1])[positions]
        _, back, owner_token, owner_expert = send_to_ranks(self.group, source, rows, token, expert)
        mine = indices.to(torch.int64)[owner_token] == owner_expert.unsqueeze(1)
        weight = (mine * weights[owner_token]).sum(1)
        out = torch.zeros((int(bound_m.item()), out_tokens.shape[1]), dtype=torch.float32)
        out.index_add_(0, owner_token, back.to(torch.float32) * weight.unsqueeze(1))
        out_tokens[: out.shape[0]] = out.to(out_tokens.dtype)
        calls.append("combine")

    def destroy(self) -> None:
        self.alive = False
        calls.append("destroy")


def install(with_cuda_core: bool = True) -> None:
    """The fake ``pplx_kernels`` (and, for ``nvshmem_init``'s device argument, a fake ``cuda.core`` unless
    ``with_cuda_core`` is False: a process that has the real one keeps it)."""
    calls.clear()
    nvshmem.clear()
    fake = ModuleType("pplx_kernels")
    fake.__version__ = "0.0.1"
    fake.AllToAll, fake.nvshmem_init = AllToAll, nvshmem_init
    modules = {"pplx_kernels": fake}
    if with_cuda_core:
        cuda = ModuleType("cuda")
        cuda.__path__ = []
        core = ModuleType("cuda.core")
        core.__path__ = []
        experimental = ModuleType("cuda.core.experimental")
        experimental.Device = lambda index: f"device {index}"
        modules.update({"cuda": cuda, "cuda.core": core, "cuda.core.experimental": experimental})
    install_modules(modules)

"""A fake UCCL-EP: ``uccl.ep`` (the extension) and its DeepEP-compatible wrapper package ``deep_ep``
(``initialize_uccl``, ``destroy_uccl``, a ``Buffer`` with uccl's constructor signature), moving rows as the
fake DeepEP does (UCCL-EP runs DeepEP's kernels)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from tests.backends.fakes import deep_ep as fake_deep_ep
from tests.backends.fakes import install_modules

VERSION = "0.0.1+fake"


class Buffer(fake_deep_ep.Buffer):
    """uccl's ep/bench/buffer.py constructor: no ``enable_shrink``/``comm``, an ``is_intranode`` switch, and
    its own tables (read at uccl da914a2): config_map (ep/bench/buffer.py:753-765: no 48 or 96), the
    kernels' ranks (ep/include/ep_launch.cuh:67-97), low-latency hidden sizes (:45-65: no 3072), at most 16
    experts per token (ep/src/internode_ll.cu:670), ranks x tokens a multiple of 4 (ep/src/uccl_ep.cc:1322),
    no NVSHMEM queue depth (its proxies post the RDMA). It accepts ``allow_mnnvl`` and ignores it."""

    CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
    RDMA_GROUPS = (2, 3, 4, 8, 16)
    LL_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
    LL_MAX_TOPK = 16
    NVSHMEM = False
    LL_TOKENS_OF_FOUR = True

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
        is_intranode: Any = None,
    ) -> None:
        self.proxies = initialize_uccl(num_rdma_bytes, low_latency_mode)
        super().__init__(
            group,
            num_nvl_bytes,
            num_rdma_bytes,
            low_latency_mode,
            num_qps_per_rank,
            allow_nvlink_for_low_latency_mode,
            False,  # accepted, unused (ep/bench/buffer.py:84, never read)
            explicitly_destroy,
        )

    def destroy(self) -> None:
        super().destroy()
        destroy_uccl(self.proxies, [])


def initialize_uccl(*args: Any, **kwargs: Any) -> list[str]:
    fake_deep_ep.calls.append("initialize_uccl")
    return ["proxy"]


def destroy_uccl(proxies: Any, workers: Any) -> None:
    fake_deep_ep.calls.append("destroy_uccl")


def install() -> None:
    fake_deep_ep.calls.clear()
    fake_deep_ep.Buffer.num_sms = 20
    uccl = ModuleType("uccl")
    uccl.__version__ = VERSION
    uccl.__path__ = []  # a package, so uccl.ep resolves
    ep = ModuleType("uccl.ep")
    ep.Config, ep.EventHandle = fake_deep_ep.Config, object
    fake_deep_ep.options.clear()
    fake_deep_ep.topk_idx_t = torch.int64
    wrapper = fake_deep_ep.module(hybrid=False, elastic=False)
    del wrapper.topk_idx_t  # the wrapper's deep_ep exports no topk_idx_t (its ids are int64)
    wrapper.Buffer, wrapper.initialize_uccl, wrapper.destroy_uccl = Buffer, initialize_uccl, destroy_uccl
    install_modules({"uccl": uccl, "uccl.ep": ep, "deep_ep": wrapper})

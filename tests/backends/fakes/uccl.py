"""A fake UCCL-EP: ``uccl.ep`` (the extension) and its DeepEP-compatible wrapper package ``deep_ep``
(``initialize_uccl``, ``destroy_uccl``, a ``Buffer`` with uccl's constructor signature), moving rows as the
fake DeepEP does (UCCL-EP runs DeepEP's kernels)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from tests.backends.fakes import deep_ep as fake_deep_ep
from tests.backends.fakes import install_modules

VERSION = "0.0.1+fake"


class Buffer(fake_deep_ep.Buffer):
    """uccl's ep/bench/buffer.py constructor: no ``enable_shrink``/``comm``, an ``is_intranode`` switch."""

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
            allow_mnnvl,
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
    wrapper = fake_deep_ep.module(hybrid=False)
    wrapper.Buffer, wrapper.initialize_uccl, wrapper.destroy_uccl = Buffer, initialize_uccl, destroy_uccl
    install_modules({"uccl": uccl, "uccl.ep": ep, "deep_ep": wrapper})

"""UCCL-EP adapter (``--backend uccl-ep``): UCCL-EP's DeepEP-compatible ``Buffer``, driven as the DeepEP one.

UCCL-EP (github.com/uccl-project/uccl, ``ep/``) runs DeepEP's kernels with CPU proxies issuing the RDMA
(any NIC, also AMD GPUs) and ships a drop-in wrapper package named ``deep_ep`` (``ep/deep_ep_wrapper``,
whose ``Buffer`` is ``ep/bench/buffer.py``) on top of its extension ``uccl.ep``. Follows that ``Buffer`` at
uccl main da914a2 (read at the source; not run here, no GPU): the constructor's ``group, num_nvl_bytes,
num_rdma_bytes, low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode,
explicitly_destroy``, ``get_dispatch_layout`` / ``dispatch`` / ``combine`` and ``low_latency_dispatch`` /
``low_latency_combine`` with DeepEP's signatures, so the mapping is ``deep_ep.DeepEpBackend``'s (modes
``normal`` and ``low_latency``; the proxies start inside ``Buffer``). It needs ``uccl.ep`` and the wrapper:
a ``deep_ep`` without ``initialize_uccl`` is DeepEP itself, and this backend says so.

Its kernels are DeepEP's with narrower tables (``UCCL_EP_LIMITS``, read at da914a2): the normal mode runs
2, 4, 8 ranks in one NVLink group (``SWITCH_RANKS``, ``ep/include/ep_launch.cuh``) and 16, 24, 32, 64, 128
as groups of 8 (``SWITCH_RDMA_RANKS`` {2, 3, 4, 8, 16} there, within ``get_dispatch_config``'s table, which
lacks 48 and 96); the low-latency kernels take hidden sizes without 3072, at most 16 experts per token, and
ranks x tokens a multiple of 4, with no NVSHMEM queue-depth bound (its CPU proxies post the RDMA). Its
``Buffer`` accepts ``allow_mnnvl`` without using it (``ep/bench/buffer.py``), so that knob is not offered.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, ClassVar

from commbench.backends.adapters.bandwidth import UCCL_EP
from commbench.backends.adapters.deep_ep import DeepEpBackend
from commbench.backends.adapters.deep_ep_rules import LOW_LATENCY, NORMAL, LegacyLimits, deep_ep_options
from commbench.backends.options import BackendOption
from commbench.errors import UsageError

UCCL_EP_LIMITS = LegacyLimits(
    library="UCCL-EP",
    intranode_ranks=(2, 4, 8),  # ep/include/ep_launch.cuh:85-97 SWITCH_RANKS
    rdma_groups=(2, 3, 4, 8, 16),  # ep_launch.cuh:67-83 SWITCH_RDMA_RANKS
    config_ranks=(2, 4, 8, 16, 24, 32, 64, 128, 144, 160),  # ep/bench/buffer.py:753-765 config_map
    ll_hidden=(2048, 2560, 4096, 5120, 6144, 7168, 8192),  # ep_launch.cuh:45-65 SWITCH_HIDDEN
    ll_max_topk=16,  # ep/src/internode_ll.cu:670, 1237 kNumMaxTopK
    ll_qp_depth=False,  # no NVSHMEM: the proxies post the RDMA
    ll_tokens_of_four=True,  # ep/src/uccl_ep.cc:1322
    source="uccl-project/uccl da914a2",
)


class UcclEpBackend(DeepEpBackend):
    name = "uccl-ep"
    LIBRARY = "deep_ep"
    DISPLAY = "UCCL-EP"
    INSTALL = "build uccl with its ep extension (uccl.ep) and install ep/deep_ep_wrapper"
    API_VERSION = "uccl main da914a2 (ep/bench/buffer.py, ep/deep_ep_wrapper)"
    bandwidth_vocabulary = UCCL_EP
    MODES: ClassVar[tuple[str, ...]] = (NORMAL, LOW_LATENCY)
    OPTIONS: ClassVar[tuple[BackendOption, ...]] = deep_ep_options(MODES, mnnvl=False)
    LIMITS: ClassVar[LegacyLimits] = UCCL_EP_LIMITS
    MNNVL: ClassVar[bool] = False

    @classmethod
    def import_library(cls) -> Any:
        try:
            importlib.import_module("uccl.ep")
        except Exception as exc:  # noqa: BLE001 - a broken install fails any way; the reason is the message
            text = " ".join(str(exc).split())[:200]
            raise UsageError(
                f"--backend {cls.name} needs UCCL-EP ({cls.INSTALL}); import uccl.ep failed: "
                f"{type(exc).__name__}: {text}"
            ) from None
        module = super(DeepEpBackend, cls).import_library()
        if not hasattr(module, "initialize_uccl"):
            raise UsageError(
                f"--backend {cls.name}: the deep_ep importable here is DeepEP itself, not UCCL-EP's wrapper "
                "(install uccl's ep/deep_ep_wrapper, or use --backend deep-ep)"
            )
        return module

    @property
    def library_version(self) -> str:
        try:
            return metadata.version("uccl")
        except metadata.PackageNotFoundError:  # built in place: the extension's package says
            return str(getattr(importlib.import_module("uccl"), "__version__", "") or "unknown")

    def knobs(self) -> dict[str, Any]:
        knobs = super().knobs()
        knobs.pop(f"{self.LIBRARY}_version", None)
        return {**knobs, "uccl_version": self.library_version}

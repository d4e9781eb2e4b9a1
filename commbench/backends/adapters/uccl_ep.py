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
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, ClassVar

from commbench.backends.adapters.bandwidth import UCCL_EP
from commbench.backends.adapters.deep_ep import (
    LOW_LATENCY,
    NORMAL,
    DeepEpBackend,
    deep_ep_options,
)
from commbench.backends.options import BackendOption
from commbench.errors import UsageError


class UcclEpBackend(DeepEpBackend):
    name = "uccl-ep"
    LIBRARY = "deep_ep"
    DISPLAY = "UCCL-EP"
    INSTALL = "build uccl with its ep extension (uccl.ep) and install ep/deep_ep_wrapper"
    API_VERSION = "uccl main da914a2 (ep/bench/buffer.py, ep/deep_ep_wrapper)"
    bandwidth_vocabulary = UCCL_EP
    MODES: ClassVar[tuple[str, ...]] = (NORMAL, LOW_LATENCY)
    OPTIONS: ClassVar[tuple[BackendOption, ...]] = deep_ep_options(MODES)

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

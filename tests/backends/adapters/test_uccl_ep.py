"""The UCCL-EP adapter over a fake uccl.ep + deep_ep wrapper on gloo ranks, and how it tells DeepEP apart."""

from __future__ import annotations

import pytest

from commbench.backends import availability
from commbench.backends.adapters.deep_ep import DeepEpBackend
from commbench.backends.adapters.uccl_ep import UcclEpBackend
from commbench.errors import UsageError
from commbench.run import dist
from tests.backends.adapters.drive import BF16, FP8, TIMEOUT_S, assert_clean, drive, routing
from tests.backends.fakes import deep_ep as fake_deep_ep
from tests.backends.fakes import remove_modules, uccl

CASES = [("normal", FP8, "token"), ("low_latency", BF16, "selection")]


def _entry(comm):
    uccl.install()
    outcomes = []
    for mode, model, send_mode in CASES:
        cfg = routing(comm.world_size, model, "zipf:1.2")
        outcomes.append(comm.all_gather_object(drive(comm, UcclEpBackend, {"mode": mode}, cfg, send_mode)))
    return outcomes, list(fake_deep_ep.calls)


def test_both_modes_deliver_every_row_through_the_wrapper_and_start_its_proxies():
    outcomes, calls = dist.launch(2, _entry, (), process_group="gloo", timeout_s=TIMEOUT_S)
    for (mode, _, _), case in zip(CASES, outcomes, strict=True):
        assert_clean(case)
        assert case[0]["knobs"]["mode"] == mode and case[0]["knobs"]["uccl_version"] == uccl.VERSION
        assert case[0]["label"] == f"uccl-ep {mode}"
    assert calls.count("initialize_uccl") == 2 and calls.count("destroy_uccl") == 2


def test_uccl_and_deepep_each_refuse_the_others_deep_ep_package():
    try:
        uccl.install()
        with pytest.raises(UsageError, match="is UCCL-EP's wrapper, not DeepEP; use --backend uccl-ep"):
            DeepEpBackend.import_library()
        assert UcclEpBackend.import_library().initialize_uccl is uccl.initialize_uccl
        remove_modules("deep_ep")
        fake_deep_ep.install()
        with pytest.raises(UsageError, match="is DeepEP itself, not UCCL-EP's wrapper"):
            UcclEpBackend.import_library()
        remove_modules("uccl")
        available, reason = availability("uccl-ep")
        assert not available and "import uccl.ep failed" in reason
    finally:
        remove_modules("deep_ep", "uccl")


def test_uccl_has_no_hybrid_mode():
    with pytest.raises(UsageError, match="mode='hybrid' is unknown; use one of: normal, low_latency"):
        UcclEpBackend.check_options({"mode": "hybrid"})

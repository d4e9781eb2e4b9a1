"""The UCCL-EP adapter over a fake uccl.ep + deep_ep wrapper on gloo ranks, and how it tells DeepEP apart."""

from __future__ import annotations

import pytest

from commbench.backends import availability
from commbench.backends.adapters.deep_ep import DeepEpBackend
from commbench.backends.adapters.uccl_ep import UcclEpBackend
from commbench.errors import UsageError
from commbench.run import dist
from tests.backends.adapters.drive import FP8, LL, TIMEOUT_S, assert_clean, drive, routing
from tests.backends.fakes import deep_ep as fake_deep_ep
from tests.backends.fakes import remove_modules, uccl

CASES = [("normal", FP8, "token"), ("low_latency", LL, "selection")]


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
    assert "nvshmem_qp_depth" not in outcomes[1][0]["knobs"]  # no NVSHMEM: its proxies post the RDMA
    assert "allow_mnnvl" not in outcomes[0][0]["knobs"]


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


def test_uccl_runs_its_own_rank_table_not_deepeps():
    """UCCL-EP's config_map has no 48 or 96 (ep/bench/buffer.py:753-765, asserting "Unsupported number of
    EP ranks") and its internode kernels take 2, 3, 4, 8, 16 groups of 8 (ep/include/ep_launch.cuh:67-83):
    48 and 96 ranks, which DeepEP runs, are refused before launch naming UCCL-EP's sizes; the fake asserts
    as its library does."""
    remove_modules("deep_ep", "uccl")
    uccl.install()
    try:
        with pytest.raises(AssertionError, match="Unsupported number of EP ranks: 48"):
            uccl.Buffer.get_dispatch_config(48)
        for world in (48, 96, 72):
            with pytest.raises(UsageError) as info:
                UcclEpBackend.check_options({"mode": "normal"}, world_size=world)
            message = str(info.value)
            assert f"cannot run {world} ranks: UCCL-EP's normal kernels run 2, 4, 8 ranks" in message
            assert "16, 24, 32, 64, 128 as groups of 8" in message and "elastic" not in message
        DeepEpBackend.check_options({"mode": "normal"}, world_size=48)
        UcclEpBackend.check_options({"mode": "normal"}, world_size=64)
    finally:
        remove_modules("deep_ep", "uccl")


def test_uccl_has_no_mnnvl_knob():
    """UCCL-EP's Buffer takes allow_mnnvl and never reads it (ep/bench/buffer.py:84-102)."""
    with pytest.raises(UsageError, match="has no option"):
        UcclEpBackend.check_options({"allow_mnnvl": "true"})

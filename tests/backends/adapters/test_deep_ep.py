"""The DeepEP adapter over a fake deep_ep on gloo ranks: its normal, low-latency and Hybrid-EP mappings."""

from __future__ import annotations

import pytest
import torch

from commbench.backends import availability, get_backend
from commbench.backends.adapters.deep_ep import DeepEpBackend
from commbench.errors import UsageError
from commbench.run import dist
from tests.backends.adapters.drive import BF16, FP8, TIMEOUT_S, assert_clean, balanced, drive, routing
from tests.backends.fakes import deep_ep as fake
from tests.backends.fakes import remove_modules

# (mode, model, skew, send mode)
CASES = [
    ("normal", FP8, "hot:2:0.4", "token"),
    ("normal", BF16, "zipf:1.2", "token"),
    ("low_latency", BF16, "zipf:1.2", "selection"),
    ("low_latency", BF16, "uniform", "token"),
    ("hybrid", BF16, "hot:2:0.4", "token"),
]


def _entry(comm, cases, options):
    fake.install(hybrid=True)
    report = {"cases": [], "calls": None, "balanced": {}}
    for mode, model, skew, send_mode in cases:
        cfg = routing(comm.world_size, model, skew, mask_ratio=0.1)
        outcome = drive(comm, DeepEpBackend, {"mode": mode, **options}, cfg, send_mode)
        report["cases"].append(comm.all_gather_object(outcome))
    for mode in ("normal", "low_latency"):
        report["balanced"][mode] = balanced(
            comm, DeepEpBackend, "deep-ep", {"mode": mode}, [comm.world_size * 16, comm.world_size * 256]
        )
    report["calls"] = list(fake.calls)
    return report


@pytest.fixture(scope="module")
def report():
    """One launch of 4 gloo ranks (DeepEP's config table covers 2, 4, 8, ... ranks)."""
    return dist.launch(4, _entry, (CASES, {"num_sms": 24}), process_group="gloo", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c[0]}-{c[1].name}-{c[3]}" for c in CASES])
def test_each_mode_delivers_every_row_as_gloo_does_and_combines_at_bf16(report, index):
    outcomes = report["cases"][index]
    assert_clean(outcomes)
    mode = CASES[index][0]
    knobs = outcomes[0]["knobs"]
    assert knobs["mode"] == mode and knobs["deep_ep_version"] == fake.VERSION
    assert outcomes[0]["label"] == f"deep-ep {mode}"
    # The profiler's steps: the library's own call apart from what the adapter adds around it.
    assert {"library dispatch", "library combine", "widen"} <= set(outcomes[0]["steps"])
    if mode == "normal":  # the knob reached the library and the buffer came from its hints
        assert knobs["num_sms"] == 24 and knobs["num_nvl_bytes"] > 0 and knobs["num_rdma_bytes"] == 0
    if mode == "low_latency":
        assert knobs["num_qps_per_rank"] >= 1 and knobs["num_rdma_bytes"] > 0


def test_the_library_calls_are_the_ones_each_mode_names(report):
    calls = report["calls"]
    for name in (
        "get_dispatch_layout",
        "dispatch",
        "combine",
        "low_latency_dispatch",
        "low_latency_combine",
        "HybridEPBuffer",
        "hybrid_dispatch",
        "hybrid_combine",
        "destroy",
    ):
        assert name in calls, name
    assert calls.count("Buffer(low_latency_mode=False)") <= calls.count("destroy") + 1


def test_balanced_all_to_all_through_the_harness_is_verified_with_knobs_in_rows(report):
    for mode, rows in report["balanced"].items():
        assert [row["size_bytes"] for row in rows] == [64, 1024]
        assert all(row["wrong"] == 0 and row["check"] != "n/a" for row in rows), rows
        assert all(row["backend"] == f"deep-ep {mode}" and row["mode"] == mode for row in rows)
        assert all(row["knobs"]["mode"] == mode for row in rows)


def _stale_entry(comm):
    """A library whose second dispatch moves nothing and hands back its previous output."""
    fake.install()
    original = fake.Buffer.dispatch
    previous = {}

    def lazy(self, *args, **kwargs):
        if "out" not in previous:
            previous["out"] = original(self, *args, **kwargs)
        return previous["out"]

    fake.Buffer.dispatch = lazy
    try:
        cfg = routing(comm.world_size, FP8, "uniform")
        return comm.all_gather_object(drive(comm, DeepEpBackend, {}, cfg, "token"))
    finally:
        fake.Buffer.dispatch = original


def test_a_dispatch_that_moves_nothing_is_caught_by_the_poisoned_buffers():
    outcomes = dist.launch(2, _stale_entry, (), process_group="gloo", timeout_s=TIMEOUT_S)
    for outcome in outcomes:
        assert outcome["rows_wrong"][0] == 0 and outcome["rows_wrong"][1] > 0


REFUSALS = [
    ("normal", FP8, "selection", "sends a token once per destination rank: use --send-mode token"),
    ("low_latency", FP8, "selection", "moves BF16 tokens of one hidden size both ways"),
    ("hybrid", BF16, "token", "needs Hybrid-EP, which the installed deep_ep does not have"),
]


def _refusals_entry(comm, cases):
    """Every mapping of ``cases`` driven in turn on each rank: the error each one ends with (None: none)."""
    errors = []
    for mode, model, send_mode, _ in cases:
        fake.install(hybrid=False)
        try:
            drive(comm, DeepEpBackend, {"mode": mode}, routing(comm.world_size, model, "uniform"), send_mode)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - the test reads the class and the message
            errors.append((type(exc), str(exc)))
    return errors


@pytest.fixture(scope="module")
def refusals():
    """One 2-rank launch trying every mapping of REFUSALS (rank 0's errors)."""
    return dist.launch(2, _refusals_entry, (REFUSALS,), process_group="gloo", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(("index", "message"), [(i, case[3]) for i, case in enumerate(REFUSALS)])
def test_a_mapping_the_library_cannot_run_is_one_usage_error(refusals, index, message):
    error_class, text = refusals[index]
    assert issubclass(error_class, UsageError) and message in text, refusals[index]


def test_availability_names_the_library_then_the_gpus():
    remove_modules("deep_ep")
    try:
        assert get_backend("deep-ep") is DeepEpBackend
        available, reason = availability("deep-ep")
        assert not available and "needs DeepEP" in reason and "import deep_ep failed" in reason
        fake.install()
        available, reason = availability("deep-ep")
        if torch.cuda.device_count() < 1:
            assert not available and reason.endswith("this host has no CUDA device")
    finally:
        remove_modules("deep_ep")


def test_odd_sm_counts_and_unknown_modes_are_refused_before_launch():
    with pytest.raises(UsageError, match="num_sms=3 must be even"):
        DeepEpBackend.check_options({"num_sms": 3})
    with pytest.raises(UsageError, match="mode='fast' is unknown"):
        DeepEpBackend.check_options({"mode": "fast"})
    assert DeepEpBackend.check_options({"mode": "low_latency", "num_sms": 3})["num_sms"] == 3

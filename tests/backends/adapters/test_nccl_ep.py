"""The NCCL EP adapter over a fake nccl4py nccl.ep on gloo ranks: HT (flat) and LL (per expert) verified."""

from __future__ import annotations

import pytest

from commbench.backends import availability
from commbench.backends.adapters.nccl_ep import NcclEpBackend
from commbench.errors import UsageError
from commbench.run import dist
from tests.backends.adapters.drive import BF16, FP8, TIMEOUT_S, assert_clean, balanced, drive, routing
from tests.backends.fakes import nccl_ep as fake
from tests.backends.fakes import remove_modules

CASES = [("ht", FP8, "token"), ("ll", BF16, "selection"), ("ll", BF16, "token")]


def _entry(comm):
    fake.install()
    outcomes = []
    for mode, model, send_mode in CASES:
        cfg = routing(comm.world_size, model, "hot:2:0.4", mask_ratio=0.1)
        options = {"mode": mode, "num_channels": 8}
        outcomes.append(comm.all_gather_object(drive(comm, NcclEpBackend, options, cfg, send_mode)))
    rows = balanced(comm, NcclEpBackend, "nccl-ep", {}, [comm.world_size * 16, comm.world_size * 256])
    return outcomes, rows, list(fake.calls)


def test_ht_and_ll_deliver_every_row_as_gloo_does():
    outcomes, rows, calls = dist.launch(2, _entry, (), process_group="gloo", timeout_s=TIMEOUT_S)
    for (mode, _, _), case in zip(CASES, outcomes, strict=True):
        assert_clean(case)
        assert case[0]["knobs"]["mode"] == mode and case[0]["knobs"]["num_channels"] == 8
    assert all(row["wrong"] == 0 and row["backend"] == "nccl-ep ht" for row in rows)
    # The routing is re-bound (its metadata exchanged) inside every timed dispatch.
    assert calls.count("update") == calls.count("dispatch") > 0
    assert "Group.create(HIGH_THROUGHPUT)" in calls and "Group.create(LOW_LATENCY)" in calls
    assert "comm.destroy" in calls and "group.destroy" in calls


REFUSALS = [
    ("ht", FP8, "selection", "mode=ht sends a token once per destination rank"),
    ("ll", FP8, "token", "mode=ll moves BF16 tokens of one hidden size both ways"),
]


def _refusals_entry(comm, cases):
    """Every mapping of ``cases`` driven in turn on each rank: the error each one ends with (None: none)."""
    errors = []
    for mode, model, send_mode, _ in cases:
        fake.install()
        try:
            drive(comm, NcclEpBackend, {"mode": mode}, routing(comm.world_size, model, "uniform"), send_mode)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - the test reads the class and the message
            errors.append((type(exc), str(exc)))
    return errors


@pytest.fixture(scope="module")
def refusals():
    """One 2-rank launch trying every mapping of REFUSALS (rank 0's errors)."""
    return dist.launch(2, _refusals_entry, (REFUSALS,), process_group="gloo", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(("index", "message"), [(i, case[3]) for i, case in enumerate(REFUSALS)])
def test_mappings_nccl_ep_cannot_run_are_refused(refusals, index, message):
    error_class, text = refusals[index]
    assert issubclass(error_class, UsageError) and message in text, refusals[index]


def test_without_nccl4py_it_is_listed_unavailable_naming_the_package():
    remove_modules("nccl")
    available, reason = availability("nccl-ep")
    assert not available and "pip install nccl4py[cu13]" in reason and "import nccl.ep failed" in reason

"""The pplx-kernels adapter over a fake pplx_kernels on gloo ranks: selection mode verified, refusals."""

from __future__ import annotations

import pytest

from commbench.backends.adapters.pplx import PplxBackend
from commbench.errors import UsageError
from commbench.run import dist
from tests.backends.adapters.drive import BF16, FP8, TIMEOUT_S, assert_clean, balanced, drive, routing
from tests.backends.fakes import pplx_kernels as fake


def _entry(comm):
    fake.install()
    outcomes = {}
    for mode in ("intranode", "internode"):
        cfg = routing(comm.world_size, FP8, "hot:2:0.4")
        outcomes[mode] = comm.all_gather_object(drive(comm, PplxBackend, {"mode": mode}, cfg, "selection"))
    outcomes["bf16"] = comm.all_gather_object(
        drive(comm, PplxBackend, {}, routing(comm.world_size, BF16, "zipf:1.2"), "selection")
    )
    rows = balanced(comm, PplxBackend, "pplx", {}, [comm.world_size * 16, comm.world_size * 512])
    return outcomes, rows, list(fake.calls)


def test_selection_mode_delivers_every_row_and_combines_with_the_owners_weights():
    outcomes, rows, calls = dist.launch(2, _entry, (), process_group="gloo", timeout_s=TIMEOUT_S)
    for mode in ("intranode", "internode", "bf16"):
        assert_clean(outcomes[mode])
    knobs = outcomes["internode"][0]["knobs"]
    assert knobs == {
        "mode": "internode",
        "max_num_tokens": 24,
        "experts_per_token": 4,
        "pplx_kernels_version": "0.0.1",
    }
    assert "nvshmem_init" in calls and calls.count("destroy") >= 3
    assert all(row["wrong"] == 0 and row["backend"] == "pplx intranode" for row in rows)


def _stale_entry(comm):
    """A library whose second dispatch writes nothing into the caller's buffers."""
    fake.install()
    original = fake.AllToAll.dispatch
    done = []

    def lazy(self, *args, **kwargs):
        if not done:
            done.append(original(self, *args, **kwargs))

    fake.AllToAll.dispatch = lazy
    try:
        return comm.all_gather_object(
            drive(comm, PplxBackend, {}, routing(comm.world_size, FP8, "uniform"), "selection")
        )
    finally:
        fake.AllToAll.dispatch = original


def test_a_dispatch_that_writes_nothing_leaves_the_sentinel_and_is_caught():
    for outcome in dist.launch(2, _stale_entry, (), process_group="gloo", timeout_s=TIMEOUT_S):
        assert outcome["rows_wrong"][0] == 0 and outcome["rows_wrong"][1] > 0


REFUSALS = [("token", 0.0), ("selection", 0.2)]


def _refusals_entry(comm, cases):
    """Every (send mode, mask ratio) of ``cases`` driven in turn on each rank: the error each one ends with
    (None: none)."""
    errors = []
    for send_mode, mask_ratio in cases:
        fake.install()
        cfg = routing(comm.world_size, FP8, "uniform", mask_ratio=mask_ratio)
        try:
            drive(comm, PplxBackend, {}, cfg, send_mode)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - the test reads the class and the message
            errors.append((type(exc), str(exc)))
    return errors


@pytest.fixture(scope="module")
def refusals():
    """One 2-rank launch trying every case of REFUSALS (rank 0's errors)."""
    return dist.launch(2, _refusals_entry, (REFUSALS,), process_group="gloo", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("index", range(len(REFUSALS)), ids=[f"{m}-{r}" for m, r in REFUSALS])
def test_tokens_with_fewer_rows_than_experts_per_token_are_refused(refusals, index):
    error_class, text = refusals[index]
    assert issubclass(error_class, UsageError), refusals[index]
    assert "pplx-kernels sends every token to exactly experts_per_token" in text

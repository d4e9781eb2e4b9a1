"""The NCCL EP adapter over a fake nccl4py nccl.ep on gloo ranks: HT (flat) and LL (per expert) verified, and
what NCCL EP asserts refused before it is called (the fake enforces each, contrib/nccl_ep/nccl_ep.cc)."""

from __future__ import annotations

import pytest
import torch

from commbench.backends import availability
from commbench.backends.adapters.nccl_ep import NcclEpBackend
from commbench.errors import UsageError
from commbench.run import dist
from tests.backends.adapters.drive import BF16, FP8, LL, TIMEOUT_S, assert_clean, balanced, drive, routing
from tests.backends.fakes import nccl_ep as fake
from tests.backends.fakes import remove_modules

CASES = [("ht", FP8, "token"), ("ll", LL, "selection"), ("ht", BF16, "token")]


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
    ("ht", FP8, "selection", {}, "mode=ht sends a token once per destination rank"),
    ("ll", FP8, "selection", {}, "mode=ll moves BF16 tokens of one hidden size both ways"),
    # LL sends per selection (the model's routing), never token mode's de-duplicated one.
    ("ll", LL, "token", {}, "mode=ll sends one message per (token, expert) selection"),
    # device/macros.cuh:161-171 SWITCH_HIDDEN.
    ("ll", BF16, "selection", {}, "runs hidden sizes 2048, 2560, 4096, 5120, 6144, 7168, 8192 only"),
    # nccl_ep.cc:1301-1310: ceil(16 experts / 1 SM) warp groups > 14.
    ("ll", LL, "selection", {"max_num_sms": 1}, "mode=ll needs at least 2 SMs for 16 experts"),
]


def _refusals_entry(comm, cases):
    """Every mapping of ``cases`` driven in turn on each rank: the error each one ends with (None: none)."""
    errors = []
    for mode, model, send_mode, options, _ in cases:
        fake.install()
        cfg = routing(comm.world_size, model, "uniform")
        try:
            drive(comm, NcclEpBackend, {"mode": mode, **options}, cfg, send_mode)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - the test reads the class and the message
            errors.append((type(exc), str(exc)))
    return errors


@pytest.fixture(scope="module")
def refusals():
    """One 2-rank launch trying every mapping of REFUSALS (rank 0's errors)."""
    return dist.launch(2, _refusals_entry, (REFUSALS,), process_group="gloo", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize(("index", "message"), [(i, case[4]) for i, case in enumerate(REFUSALS)])
def test_mappings_nccl_ep_cannot_run_are_refused(refusals, index, message):
    error_class, text = refusals[index]
    assert issubclass(error_class, UsageError) and message in text, refusals[index]


def test_without_nccl4py_it_is_listed_unavailable_naming_the_package():
    remove_modules("nccl")
    available, reason = availability("nccl-ep")
    assert not available and "pip install nccl4py[cu13]" in reason and "import nccl.ep failed" in reason


def test_the_fake_asserts_what_nccl_ep_does():
    """The preconditions the adapter meets, asserted by the fake as NCCL EP asserts them: HT at most 8192
    tokens per rank (contrib/nccl_ep/include/common.hpp:26, nccl_ep.cc:1253-1255), and a node's experts a
    multiple of 4 in HT dispatch (nccl_ep.cc:2690-2692), which is why each rank stands as 4 experts."""
    fake.install()
    try:
        ht = fake.GroupConfig(
            algorithm=fake.Algorithm.HIGH_THROUGHPUT,
            num_experts=8,
            max_dispatch_tokens_per_rank=8193,
            max_recv_tokens_per_rank=8193 * 2,
            max_token_bytes=256,
        )
        with pytest.raises(AssertionError):
            fake.Group.create(fake.Communicator(None), ht)
    finally:
        remove_modules("nccl")


def test_ht_past_8192_tokens_per_rank_is_refused_naming_the_limit():
    """HT's kernels are built for MAX_SUPPORTED_TOKENS_PER_RANK = 8192 (contrib/nccl_ep/include/common.hpp:26;
    ncclEpCreateGroup asserts it, nccl_ep.cc:1253-1255): more is one line before NCCL EP is called."""
    from types import SimpleNamespace

    from commbench.backends.adapters.common import PeerShape

    backend = NcclEpBackend.__new__(NcclEpBackend)
    backend.mode, backend.settings = "ht", NcclEpBackend.check_options({})
    backend.comm = SimpleNamespace(device=torch.device("cpu"))
    shape = PeerShape(2, "token", 1, 2, 8193, 256, 128, False)
    with pytest.raises(UsageError, match="mode=ht takes at most 8192 tokens per rank.*use --tokens 8192"):
        backend.check_shape(shape)
    backend.check_shape(PeerShape(2, "token", 1, 2, 8192, 256, 128, False))

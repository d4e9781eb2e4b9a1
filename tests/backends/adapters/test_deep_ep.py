"""The DeepEP adapter over a fake deep_ep on gloo ranks: its normal, low-latency, Hybrid-EP and V2 elastic
mappings, and the preconditions DeepEP asserts (the fake enforces each, so an adapter that would fail on the
real library fails here), refused before the library is called."""

from __future__ import annotations

import pytest
import torch

from commbench.backends import availability, get_backend
from commbench.backends.adapters.deep_ep import DeepEpBackend
from commbench.errors import UsageError
from commbench.run import dist
from tests.backends.adapters.drive import BF16, FP8, LL, TIMEOUT_S, assert_clean, balanced, drive, routing
from tests.backends.fakes import deep_ep as fake
from tests.backends.fakes import remove_modules

# (mode, model, skew, send mode)
CASES = [
    ("normal", FP8, "hot:2:0.4", "token"),
    ("normal", BF16, "zipf:1.2", "token"),
    ("low_latency", LL, "zipf:1.2", "selection"),
    ("low_latency", LL, "uniform", "selection"),
    ("hybrid", BF16, "hot:2:0.4", "token"),
    ("elastic", BF16, "zipf:1.2", "token"),
]
# The balanced all-to-all's sizes per mode: the low-latency kernels' rows must be a hidden size they
# compile for (4096 B = 2048 BF16 elements per destination).
BALANCED = {"normal": (16, 256), "low_latency": (4096,), "elastic": (16, 256)}


def _entry(comm, cases, options):
    fake.install(hybrid=True)
    report = {"cases": [], "calls": None, "balanced": {}}
    for mode, model, skew, send_mode in cases:
        cfg = routing(comm.world_size, model, skew, mask_ratio=0.1)
        outcome = drive(comm, DeepEpBackend, {"mode": mode, **options}, cfg, send_mode)
        report["cases"].append(comm.all_gather_object(outcome))
    for mode, rows in BALANCED.items():
        sizes = [comm.world_size * row for row in rows]
        report["balanced"][mode] = balanced(comm, DeepEpBackend, "deep-ep", {"mode": mode}, sizes)
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
        assert knobs["allow_mnnvl"] is False  # one host
    if mode == "low_latency":
        assert knobs["num_qps_per_rank"] >= 1 and knobs["num_rdma_bytes"] > 0
        assert knobs["nvshmem_qp_depth"] == 1024  # 24 tokens: DeepEP's default depth suffices
    if mode == "elastic":  # each token carries its top-k ids (int64) and float32 weights
        assert knobs["token_meta_bytes"] == outcomes[0]["topk_width"] * (8 + 4) > 0


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
        "ElasticBuffer",
        "elastic_dispatch",
        "elastic_combine",
        "elastic_destroy",
    ):
        assert name in calls, name
    assert calls.count("Buffer(low_latency_mode=False)") <= calls.count("destroy") + 1


def test_balanced_all_to_all_through_the_harness_is_verified_with_knobs_in_rows(report):
    for mode, rows in report["balanced"].items():
        assert [row["size_bytes"] for row in rows] == [4 * size for size in BALANCED[mode]]
        assert all(row["wrong"] == 0 and row["check"] != "n/a" for row in rows), rows
        assert all(row["backend"] == f"deep-ep {mode}" and row["mode"] == mode for row in rows)
        assert all(row["knobs"]["mode"] == mode for row in rows)


def _stale_entry(comm):
    """A library whose third dispatch (after set-up's order check and round one) moves nothing and hands
    back its previous output."""
    fake.install()
    original = fake.Buffer.dispatch
    previous = {}

    def lazy(self, *args, **kwargs):
        if previous.get("calls", 0) < 2:
            previous["out"] = original(self, *args, **kwargs)
        previous["calls"] = previous.get("calls", 0) + 1
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
    (
        "hybrid",
        BF16,
        "token",
        "needs HybridEPBuffer (DeepEP's hybrid-ep branch), which the installed deep_ep",
    ),
    ("low_latency", LL, "token", "sends one message per (token, expert) selection"),
    (
        "low_latency",
        BF16,
        "selection",
        "runs hidden sizes 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192 only",
    ),
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


def test_normal_mode_refuses_a_rank_count_its_kernels_lack_before_launch_naming_what_runs():
    """72 ranks (an NVL72 rack) = 9 groups of 8: DeepEP's Buffer.get_dispatch_config asserts the count is in
    its config_map (deep_ep/buffers/legacy.py:259, "Unsupported number of EP ranks"; :289 for combine) and
    the normal kernels compile for SWITCH_RANKS 2, 4, 8 and 8 x SWITCH_RDMA_RANKS {2, 3, 4, 6, 8, 12, 16,
    18, 20} only (csrc/kernels/legacy/launch.cuh:53-89). The fake asserts as the library does; the adapter
    refuses in the parent, in one line, naming the sizes and what runs instead (DeepEP V2's ElasticBuffer
    where the installed deep_ep has it)."""
    fake.install()
    try:
        with pytest.raises(AssertionError, match="Unsupported number of EP ranks: 72"):
            fake.Buffer.get_dispatch_config(72)
        with pytest.raises(UsageError) as info:
            DeepEpBackend.check_options({"mode": "normal"}, world_size=72)
        message = str(info.value)
        assert "\n" not in message and "cannot run 72 ranks" in message
        assert "run 2, 4, 8 ranks in one NVLink group and 16, 24, 32, 48, 64, 96, 128, 144, 160" in message
        assert "use --world-size 64" in message and "or mode=low_latency" in message
        assert "or mode=elastic (DeepEP V2's ElasticBuffer, which the installed deep_ep has)" in message
        fake.install(elastic=False)  # an older DeepEP: the message points at V2
        with pytest.raises(UsageError, match="or DeepEP V2 .main from 2.1.0., whose ElasticBuffer"):
            DeepEpBackend.check_options({"mode": "normal"}, world_size=72)
        for world in (2, 8, 16, 64, 160):
            DeepEpBackend.check_options({"mode": "normal"}, world_size=world)
        # The low-latency Buffer takes fewer than 8 ranks or multiples of 8 (csrc/legacy/buffer.hpp:114).
        DeepEpBackend.check_options({"mode": "low_latency"}, world_size=72)
        with pytest.raises(UsageError, match="low_latency cannot run 12 ranks.*buffer.hpp:114"):
            DeepEpBackend.check_options({"mode": "low_latency"}, world_size=12)
        # A buffer size off DeepEP's 128-byte alignment (csrc/legacy/buffer.hpp:107-110).
        with pytest.raises(UsageError, match="num_nvl_bytes=1000 must be a multiple of 128"):
            DeepEpBackend.check_options({"num_nvl_bytes": 1000})
        with pytest.raises(UsageError, match="on 4 <= 8 ranks has no RDMA buffer"):
            DeepEpBackend.check_options({"num_rdma_bytes": 1 << 20}, world_size=4)
    finally:
        remove_modules("deep_ep")


def test_without_the_library_the_kernels_tables_still_refuse():
    remove_modules("deep_ep")
    with pytest.raises(UsageError, match="cannot run 72 ranks"):
        DeepEpBackend.check_options({"mode": "normal"}, world_size=72)


def _assertion_case(comm, raise_as):
    """The fake's Buffer constructor fails on an assertion commbench does not check: Python's (assert) or
    the C++ runtime's (EP_HOST_ASSERT, raised as RuntimeError "Failed: Assertion error <file>:<line>")."""
    fake.install()
    original = fake.Buffer.__init__

    def refuse(self, *args, **kwargs):
        if raise_as == "python":
            assert self is None, "runtime not available"
        raise RuntimeError(
            "Failed: Assertion error csrc/legacy/buffer.hpp:129 'ceil_div(num_nvl_bytes) < max'"
        )

    fake.Buffer.__init__ = refuse
    try:
        drive(comm, DeepEpBackend, {}, routing(comm.world_size, FP8, "uniform"), "token")
    except Exception as exc:  # noqa: BLE001 - the test reads the class and the message
        return type(exc), str(exc)
    finally:
        fake.Buffer.__init__ = original
    return None


def _qp_depth_case(comm, tokens, user_depth):
    """A low-latency run of ``tokens`` per rank, NVSHMEM_QP_DEPTH unset or set by the user."""
    import os

    fake.install()
    before = os.environ.pop("NVSHMEM_QP_DEPTH", None)
    if user_depth is not None:
        os.environ["NVSHMEM_QP_DEPTH"] = str(user_depth)
    try:
        cfg = routing(comm.world_size, LL, "uniform", tokens=tokens)
        return drive(comm, DeepEpBackend, {"mode": "low_latency"}, cfg, "selection", rounds=1), None
    except Exception as exc:  # noqa: BLE001 - the test reads the class and the message
        return None, (type(exc), str(exc))
    finally:
        os.environ.pop("NVSHMEM_QP_DEPTH", None)
        if before is not None:
            os.environ["NVSHMEM_QP_DEPTH"] = before


def _library_counts_case(comm, index_bits):
    """Low-latency and normal runs over a library whose received counts are never right (the adapter must
    not need them: it takes them from the plans) and whose ids are ``index_bits`` wide."""
    fake.install(index_dtype=torch.int32 if index_bits == 32 else torch.int64)
    original = fake.Buffer.low_latency_dispatch

    def wrong_counts(self, *args, **kwargs):
        recv_x, counts, *rest = original(self, *args, **kwargs)
        return (recv_x, torch.full_like(counts, -1), *rest)

    fake.Buffer.low_latency_dispatch = wrong_counts
    try:
        low_cfg = routing(comm.world_size, LL, "zipf:1.2")
        low = drive(comm, DeepEpBackend, {"mode": "low_latency"}, low_cfg, "selection")
        normal = drive(comm, DeepEpBackend, {}, routing(comm.world_size, FP8, "zipf:1.2"), "token")
        return comm.all_gather_object([low, normal])
    finally:
        fake.Buffer.low_latency_dispatch = original


def _raw_buffer_case(comm):
    """A Buffer built straight on the fake, one rank per tray, allow_mnnvl left off."""
    from tests.backends.fakes import topology

    fake.install()
    topology.use(topology.machines(comm.world_size, 1, True))
    try:
        fake.Buffer(comm.group or torch.distributed.group.WORLD, num_nvl_bytes=1 << 20)
    except RuntimeError as exc:
        return RuntimeError, str(exc)
    finally:
        topology.use([])
    return None


def _preconditions_entry(comm):
    return {
        "assert python": _assertion_case(comm, "python"),
        "assert cpp": _assertion_case(comm, "cpp"),
        "depth unset": _qp_depth_case(comm, 512, None),
        "depth 1024": _qp_depth_case(comm, 512, 1024),
        "counts 64": _library_counts_case(comm, 64),
        "counts 32": _library_counts_case(comm, 32),
        "raw buffer": _raw_buffer_case(comm),
    }


@pytest.fixture(scope="module")
def preconditions():
    """One 2-rank launch of the precondition cases (rank 0's outcomes)."""
    return dist.launch(2, _preconditions_entry, (), process_group="gloo", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("raise_as", ["python", "cpp"])
def test_a_library_assertion_during_set_up_is_one_line_and_exit_2(preconditions, raise_as):
    """Any AssertionError DeepEP raises while its buffers are built (legacy.py asserts; EP_HOST_ASSERT in
    csrc/legacy/buffer.hpp, a RuntimeError through pybind11) is one line, UsageError (exit 2), with the
    library's words and where it raised, never a traceback."""
    error_class, text = preconditions[f"assert {raise_as}"]
    assert issubclass(error_class, UsageError) and error_class.exit_code == 2
    assert "\n" not in text and "DeepEP refused the set-up" in text
    if raise_as == "python":
        assert "at test_deep_ep.py:" in text and "runtime not available" in text
    else:
        assert "buffer.hpp:129" in text


def test_low_latency_raises_nvshmems_queue_depth_past_511_tokens_or_names_the_fix(preconditions):
    """DeepEP's low-latency calls assert NVSHMEM_QP_DEPTH >= 2 x (max tokens + 1) (deep_ep/buffers/
    legacy.py:609, 665), the depth read from the environment, 1024 by default (:113): 511 tokens at most.
    With 512 tokens and no depth set the adapter sets 2048 before the Buffer reads it (the fake asserts as
    DeepEP does); a user's 1024 is refused with the fix in the message."""
    outcome, error = preconditions["depth unset"]
    assert error is None, error
    assert outcome["rows_wrong"] == [0] and outcome["combine_wrong"] == [0] and outcome["host_reads"] == []
    assert outcome["knobs"]["nvshmem_qp_depth"] == 2048
    _, (error_class, text) = preconditions["depth 1024"]
    assert issubclass(error_class, UsageError) and "\n" not in text
    assert "with 512 tokens per rank needs NVSHMEM_QP_DEPTH >= 1026" in text
    assert "set it to 2048, unset it (commbench then sets it), or use --tokens 511 or fewer" in text


@pytest.mark.parametrize("index_bits", [64, 32])
def test_received_counts_come_from_the_plans_and_ids_in_the_librarys_index_type(preconditions, index_bits):
    """The timed calls read no library count back to the host (their recv_count stays on the device; here
    it is wrong and nothing notices), and the top-k ids go in deep_ep.topk_idx_t, which a DeepEP built with
    EP_NUM_TOPK_IDX_BITS=32 makes int32 (deep_ep/include/deep_ep/common/compiled.cuh:54-72; the fake
    asserts the dtype as get_dispatch_layout requires, legacy.py:301)."""
    for outcomes in preconditions[f"counts {index_bits}"]:
        for outcome in outcomes:
            assert_clean([outcome])


def test_the_fake_opens_handles_as_deepep_does(preconditions):
    """The precondition the layout check meets, in the fake itself: without allow_mnnvl a Buffer on one tray
    fails to open a peer's CUDA IPC handle on the other (csrc/legacy/buffer.hpp:236-245)."""
    error_class, text = preconditions["raw buffer"]
    assert error_class is RuntimeError and "cudaIpcOpenMemHandle of rank 1's buffer on host tray1" in text


def _topology_entry(comm, cases):
    """Each case's ranks placed on ``per_host``-GPU hosts (one fabric clique or none), normal mode: the
    outcome, or the error it ends with."""
    from tests.backends.fakes import topology

    results = []
    for per_host, clique, options in cases:
        fake.install()
        topology.use(topology.machines(comm.world_size, per_host, clique))
        try:
            cfg = routing(comm.world_size, FP8, "zipf:1.2")
            outcome = drive(comm, DeepEpBackend, options, cfg, "token")
            results.append((outcome, dict(fake.options.get("normal", {})), list(fake.calls)))
        except Exception as exc:  # noqa: BLE001 - the test reads the class and the message
            results.append((type(exc), str(exc), list(fake.calls)))
        finally:
            topology.use([])
    return results


TOPOLOGIES = [
    (2, True, {}),  # 2 trays of one NVL72 clique: allow_mnnvl on
    (2, False, {}),  # 2 servers without a clique: no NVLink between them
    (2, True, {"allow_mnnvl": False}),  # the user's false across trays: refused
    (4, False, {}),  # one host: CUDA IPC
]


def test_allow_mnnvl_follows_the_layout_and_a_group_beyond_one_nvlink_domain_is_refused():
    """DeepEP's normal kernels join each 8 consecutive ranks through NVLink (LEGACY_NUM_MAX_NVL_PEERS,
    csrc/kernels/legacy/compiled.cuh:5), opening their buffers with CUDA IPC handles (csrc/legacy/
    buffer.hpp:236-245), which fail on another host, or with allow_mnnvl fabric handles (legacy.py:92-93),
    which need one fabric clique: the fake opens them so. 4 ranks on 2-GPU trays of one clique get
    allow_mnnvl from the layout and run; without a clique, or with allow_mnnvl=false, it is one line before
    DeepEP is called (no Buffer built)."""
    results = dist.launch(4, _topology_entry, (TOPOLOGIES,), process_group="gloo", timeout_s=TIMEOUT_S)
    trays, servers, refused, one_host = results
    outcome, built, _ = trays
    assert outcome["rows_wrong"] == [0, 0] and outcome["combine_wrong"] == [0, 0]
    assert outcome["knobs"]["allow_mnnvl"] is True and built["allow_mnnvl"] is True
    error_class, text, calls = servers
    assert issubclass(error_class, UsageError) and "span 2 NVLink domains on 2 host(s)" in text
    assert not any(call.startswith("Buffer(") for call in calls)
    error_class, text, calls = refused
    assert issubclass(error_class, UsageError) and "drop allow_mnnvl=false" in text
    assert not any(call.startswith("Buffer(") for call in calls)
    outcome, built, _ = one_host
    assert outcome["rows_wrong"] == [0, 0] and outcome["knobs"]["allow_mnnvl"] is False

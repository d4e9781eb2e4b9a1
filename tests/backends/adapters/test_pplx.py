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


def _hosts_entry(comm):
    """intranode on 2 hosts (one rank each): the adapter's refusal; the fake's own failure to open the
    other host's CUDA IPC handle, as pplx-kernels' would."""
    from tests.backends.fakes import topology

    fake.install()
    topology.use(topology.machines(comm.world_size, 1, True))
    out = []
    try:
        for attempt in ("adapter", "library"):
            try:
                if attempt == "adapter":
                    drive(comm, PplxBackend, {}, routing(comm.world_size, FP8, "uniform"), "selection")
                else:
                    fake.AllToAll.intranode(8, 16, 4, comm.rank, comm.world_size, 1, 64, 144, 0, "0")
                out.append(None)
            except Exception as exc:  # noqa: BLE001 - the test reads the class and the message
                out.append((type(exc), str(exc)))
        internode = drive(
            comm, PplxBackend, {"mode": "internode"}, routing(comm.world_size, FP8, "uniform"), "selection"
        )
        return out, internode
    finally:
        topology.use([])


def test_intranode_on_several_hosts_is_refused_before_cuda_ipc_fails():
    """pplx-kernels' intranode AllToAll shares its buffers through cudaIpcGetMemHandle / cudaIpcOpenMemHandle
    (csrc/all_to_all/intranode.cpp:63-119), which open on one host only: the fake fails there as the library
    would, and the adapter refuses first, in one line, pointing at mode=internode, which runs."""
    (adapter, library), internode = dist.launch(
        2, _hosts_entry, (), process_group="gloo", timeout_s=TIMEOUT_S
    )
    error_class, text = adapter
    assert issubclass(error_class, UsageError) and "ranks run on 2 hosts: use mode=internode" in text
    assert library[0] is RuntimeError and "cudaIpcOpenMemHandle" in library[1]
    assert_clean([internode])


def test_internode_without_cuda_core_is_one_line(monkeypatch):
    """pplx-kernels' NVSHMEM bootstrap takes a cuda.core Device (tests/bench_all_to_all.py:249-254): a host
    without it gets one line naming the package, never an ImportError traceback."""
    import builtins

    from commbench.backends.adapters.pplx import cuda_core_device

    real_import = builtins.__import__

    def no_cuda_core(name, *args, **kwargs):
        if name.startswith("cuda.core"):
            raise ModuleNotFoundError("No module named 'cuda.core'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cuda_core)
    with pytest.raises(UsageError) as info:
        cuda_core_device()
    message = str(info.value)
    assert "\n" not in message and "needs cuda.core" in message and "pip install cuda-core" in message

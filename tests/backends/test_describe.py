"""A backend describes itself: a new GPU backend, registered like a plug-in and touching no other stage, is
judged, estimated, profiled and given its bandwidth vocabulary as nccl / nvshmem are; the adapters' figures
are judged as GPU fabric figures."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from commbench import backends
from commbench.backends import BackendEntry, availability, get_backend
from commbench.backends.options import DeclaredOptions
from commbench.cli.acceptance import choose_report_spec
from commbench.cli.resources import GPU_RESERVE_BYTES, balanced_rank_memory, check_launch_fits
from commbench.errors import UsageError
from commbench.report.frame import results_frame
from commbench.report.interop.vocabulary import definitions, library_figures, vocabulary_table
from commbench.report.profiler.kernels import (
    COMMUNICATION,
    COMPUTE,
    UNMATCHED_LIBRARY,
    classify_kernel,
    communication_libraries,
)
from commbench.run.describe import KernelPattern, LibraryBandwidth, kernel_names
from commbench.run.interface import Backend
from commbench.run.jobs import BalancedJob
from commbench.run.rows import byte_columns, time_columns

FAKE = "fake-gpu"
FAKE_KERNEL = "void fakelib::dispatch<8, 128>(int4*, int const*, int)"
SPEC = "hgx-h100"
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class FakeGpuBackend(DeclaredOptions, Backend):
    """A one-sided GPU dispatcher of an imaginary library: only its description matters here."""

    name = FAKE
    process_group = "nccl"
    gpu_fabric = True
    one_sided = True
    kernel_patterns = (
        KernelPattern("fakelib", COMPUTE, kernel_names(r"fakelib::layout"), "this test"),
        KernelPattern("fakelib", COMMUNICATION, kernel_names(r"fakelib::(?:dispatch|combine)"), "this test"),
    )
    bandwidth_vocabulary = (
        LibraryBandwidth(
            library="FakeLib",
            phase="dispatch",
            label="algo GB/s",
            bytes_column="max_recv_bytes",
            time_column="time_us_mean",
            bytes_meaning="rows the rank received",
            time_meaning="the dispatch call",
        ),
    )

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("never launched here")

    def dispatch(self, tokens, plan, recv_counts):
        raise NotImplementedError("never launched here")

    def combine(self, expert_out, plan, recv_counts):
        raise NotImplementedError("never launched here")


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """FakeGpuBackend registered as a plug-in package would register it (an entry point's registry entry)."""
    entry = BackendEntry(FAKE, f"{__name__}:FakeGpuBackend", package="fake-package", version="1.0")
    monkeypatch.setitem(backends.ENTRIES, FAKE, entry)
    monkeypatch.setitem(backends.BACKENDS, FAKE, entry.target)


@pytest.mark.parametrize(
    ("name", "group", "gpu_fabric", "one_sided", "emulated"),
    [
        ("nccl", "nccl", True, False, False),
        ("gloo", "gloo", False, False, False),
        ("nvshmem", "nccl", True, True, False),
        ("shmem-emu", "gloo", False, True, True),
        ("mock", "gloo", False, False, True),
        ("sim", "gloo", False, False, True),
        ("deep-ep", "nccl", True, False, False),
    ],
)
def test_the_built_ins_describe_themselves(name, group, gpu_fabric, one_sided, emulated) -> None:
    described = get_backend(name)
    assert (described.process_group, described.gpu_fabric, described.one_sided, described.emulated) == (
        group,
        gpu_fabric,
        one_sided,
        emulated,
    )
    assert described.models_report_layout == (name == "sim")


def test_the_fake_is_a_backend_the_registry_loads(registered: None) -> None:
    assert get_backend(FAKE) is FakeGpuBackend
    # On a host without GPUs it is unavailable for the reason nccl is (its process group), else as nccl.
    assert availability(FAKE) == availability("nccl")


@pytest.mark.parametrize("name", [FAKE, "nccl", "nvshmem", "deep-ep", "uccl-ep", "pplx", "nccl-ep"])
def test_gpu_fabric_backends_are_judged_against_the_spec(registered: None, name: str) -> None:
    spec, how, judged = choose_report_spec(SPEC, name)
    assert judged == SPEC and spec.name == SPEC and "not judged" not in how


@pytest.mark.parametrize("name", ["gloo", "mock", "sim", "shmem-emu"])
def test_cpu_and_emulated_backends_are_not_judged(name: str) -> None:
    spec, how, judged = choose_report_spec(SPEC, name)
    assert judged is None and spec.name == SPEC
    assert how.startswith(f"{name} run on CPU: bandwidth not judged") and "what-if" in how


def test_the_memory_estimate_counts_its_gpus_and_its_second_receive_side(
    registered: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four faked GPUs with room for a two-sided backend's buffers but not a one-sided one's: the fake is
    refused as nvshmem is (its buffers on the GPU, with a second receive side), nccl and gloo pass."""
    for variable in TORCHRUN_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    sizes, world, iters = [64 << 20], 4, 5
    two_sided = balanced_rank_memory(sizes, world, iters, get_backend("nccl")).device
    one_sided = balanced_rank_memory(sizes, world, iters, FakeGpuBackend).device
    assert one_sided > two_sided
    total = GPU_RESERVE_BYTES + (two_sided + one_sided) // 2
    monkeypatch.setattr(torch.cuda, "device_count", lambda: world)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=total)
    )
    monkeypatch.setattr("commbench.cli.resources.host_memory_available", lambda: (1 << 50, "test host"))
    jobs = [BalancedJob("balanced", sizes, iters=iters)]
    for name in ("nccl", "gloo"):
        check_launch_fits(jobs, world, name, False)
    for name in (FAKE, "nvshmem"):
        with pytest.raises(UsageError, match="of GPU memory per rank"):
            check_launch_fits(jobs, world, name, False)


def test_its_kernels_are_profiled_as_its_library_s(registered: None) -> None:
    assert classify_kernel(FAKE_KERNEL) == ("fakelib", COMMUNICATION)
    assert classify_kernel("void fakelib::layout<8>(int const*)") == ("fakelib", COMPUTE)
    assert "fakelib" in communication_libraries()
    # The built-ins' kernels are still theirs.
    assert classify_kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == (
        "nccl",
        COMMUNICATION,
    )


def test_an_unregistered_library_s_kernels_are_compute() -> None:
    assert classify_kernel(FAKE_KERNEL) == (UNMATCHED_LIBRARY, COMPUTE)
    assert "fakelib" not in communication_libraries()


def test_its_bandwidth_vocabulary_reaches_the_report(registered: None) -> None:
    assert definitions(FAKE) == FakeGpuBackend.bandwidth_vocabulary
    assert definitions("nccl") == () and definitions("no-such-backend") == ()
    assert "FakeLib algo GB/s" in vocabulary_table()  # every registered backend's definitions
    matrix = np.array([[500, 2000], [700, 1000]])  # rank 1 receives 3000 B, its own 1000 B included
    row = {
        "pattern": "tiny",
        "phase": "dispatch",
        "backend": FAKE,
        "backend_name": FAKE,
        "world_size": 2,
        **byte_columns(matrix),
        **time_columns(np.full((2, 3), 2e-6)),
        "knobs": {},
    }
    (figure,) = library_figures(results_frame([row])).to_dict("records")
    assert (figure["library"], figure["library_figure"]) == ("FakeLib", "algo GB/s")
    assert figure["library_GBps"] == pytest.approx(3000 / 2.0e3)  # max_recv_bytes / time_us_mean

"""torch symmetric memory set-up for NVSHMEM: the version gate, groups per torch version, real causes."""

from __future__ import annotations

import warnings

import pytest
import torch

from commbench.backends.shmem import symmetric as symm
from commbench.errors import UsageError

DEPRECATION = "`enable_symm_mem_for_group` is deprecated. There is no need to call this function anymore."
MISSING_GROUP = "get_group_info: no group info associated with the group name 0"


class FakeSymmMem:
    """torch.distributed._symmetric_memory as seen by the NVSHMEM allocator, with CPU tensors.

    ``needs_group_info``: ``empty`` fails (as torch 2.9/2.10's NVSHMEM allocator does) until group "0" is
    enabled. ``deprecated``: ``enable_symm_mem_for_group`` warns as torch 2.11 does. ``fail``: what ``empty``
    raises once the groups are in place."""

    def __init__(
        self, needs_group_info: bool, deprecated: bool = False, fail: BaseException | None = None
    ) -> None:
        self.needs_group_info, self.deprecated, self.fail = needs_group_info, deprecated, fail
        self.calls: list[tuple[str, str]] = []

    def set_backend(self, name: str) -> None:
        self.calls.append(("set_backend", name))

    def enable_symm_mem_for_group(self, name: str) -> None:
        if self.deprecated:
            warnings.warn(DEPRECATION, FutureWarning, stacklevel=2)
        self.calls.append(("enable", name))

    def is_symm_mem_enabled_for_group(self, name: str) -> bool:
        return ("enable", name) in self.calls

    def empty(self, *size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.calls.append(("empty", str(size)))
        if self.needs_group_info and not self.is_symm_mem_enabled_for_group("0"):
            raise RuntimeError(MISSING_GROUP)
        if self.fail is not None:
            raise self.fail
        return torch.zeros(*size, dtype=dtype, device=device)

    def rendezvous(self, tensor: torch.Tensor, group: str) -> None:
        self.calls.append(("rendezvous", group))

    def get_backend(self, device: torch.device) -> str:
        return "NVSHMEM"

    def enabled(self) -> list[str]:
        return [name for kind, name in self.calls if kind == "enable"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch) -> None:
    # allocate_heap sets these with setdefault: keep them out of the rest of the session.
    for name in ("NVSHMEM_SYMMETRIC_SIZE", "TORCH_SYMMMEM_IMPLICIT_POOL"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def allocate(monkeypatch, version: str, fake: FakeSymmMem, group: str = "0") -> torch.Tensor:
    monkeypatch.setattr(torch, "__version__", version)
    return symm.allocate_heap(fake, 4096, torch.device("cpu"), group, "0")


@pytest.mark.parametrize("version", ["2.8.0+cu128", "2.5.1", "1.13.0"])
def test_torch_before_2_9_is_refused_naming_found_and_needed(version: str) -> None:
    with pytest.raises(UsageError) as info:
        symm.check_torch_version(version)
    message = str(info.value)
    assert "\n" not in message and "needs torch >= 2.9" in message and f"found torch {version}" in message


@pytest.mark.parametrize("version", ["2.9.0+cu128", "2.10.0", "2.11.0+cu130", "2.13.0+cpu", "3.0.0"])
def test_torch_2_9_and_later_pass_the_gate(version: str) -> None:
    symm.check_torch_version(version, FakeSymmMem(needs_group_info=False))


def test_a_build_without_set_backend_is_refused_whatever_its_version_says() -> None:
    class Old:  # a nightly that says 2.9 but predates set_backend
        enable_symm_mem_for_group = empty = rendezvous = None

    with pytest.raises(UsageError, match="found torch 2.9.0a0"):
        symm.check_torch_version("2.9.0a0+git1234", Old())


@pytest.mark.parametrize("version", ["2.9.0+cu128", "2.9.1", "2.10.0+cu128"])
def test_torch_2_9_and_2_10_enable_the_default_group_before_allocating(monkeypatch, version) -> None:
    fake = FakeSymmMem(needs_group_info=True)
    heap = allocate(monkeypatch, version, fake, group="3")
    assert heap.numel() == 4096 and heap.dtype == torch.uint8
    kinds = [kind for kind, _ in fake.calls]
    assert fake.enabled() == ["0", "3"]  # NVSHMEM's bootstrap group, then the group commbench uses
    order = [kinds.index(kind) for kind in ("set_backend", "enable", "empty", "rendezvous")]
    assert order == sorted(order)
    assert ("rendezvous", "3") in fake.calls
    # Each group once: a later allocation (a second setup) enables nothing again.
    allocate(monkeypatch, version, fake, group="3")
    assert fake.enabled() == ["0", "3"]


def test_torch_2_11_allocates_without_the_deprecated_call_and_without_warnings(monkeypatch) -> None:
    fake = FakeSymmMem(needs_group_info=False, deprecated=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        allocate(monkeypatch, "2.11.0+cu130", fake)
    assert fake.enabled() == [] and caught == []


def test_a_newer_torch_still_needing_group_info_gets_it_with_only_that_warning_quiet(monkeypatch) -> None:
    fake = FakeSymmMem(needs_group_info=True, deprecated=True)
    original = fake.enable_symm_mem_for_group

    def enable_and_warn_otherwise(name: str) -> None:
        original(name)
        warnings.warn("some other deprecation", FutureWarning, stacklevel=2)

    fake.enable_symm_mem_for_group = enable_and_warn_otherwise
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        allocate(monkeypatch, "2.12.0+cu130", fake)
    assert fake.enabled() == ["0"]  # after the first empty named the missing group, then once more
    assert [str(w.message) for w in caught] == ["some other deprecation"]


def test_a_failed_allocation_reports_its_own_cause_without_heap_advice(monkeypatch) -> None:
    cause = RuntimeError(
        "nvshmemx_init_attr failed: bootstrap_uid: no interface 'eth9'\n"
        "Exception raised from initialize_nvshmem_with_store at NVSHMEMSymmetricMemory.cu:243\n"
        "frame #0: c10::Error::Error(...)"
    )
    with pytest.raises(UsageError) as info:
        allocate(monkeypatch, "2.10.0+cu128", FakeSymmMem(needs_group_info=True, fail=cause))
    message = str(info.value)
    assert "\n" not in message
    assert "nvshmemx_init_attr failed: bootstrap_uid: no interface 'eth9'" in message
    assert "NVSHMEM_SYMMETRIC_SIZE" not in message and "frame #" not in message


def test_group_info_still_missing_is_reported_as_such(monkeypatch) -> None:
    cause = RuntimeError("get_group_info: no group info associated with the group name 7")
    with pytest.raises(UsageError, match="no group info associated with the group name 7") as info:
        allocate(monkeypatch, "2.9.0", FakeSymmMem(needs_group_info=False, fail=cause))
    assert "NVSHMEM_SYMMETRIC_SIZE" not in str(info.value)


@pytest.mark.parametrize(
    "cause",
    [
        RuntimeError("nvshmem_malloc: symmetric heap of 1073741824 bytes exhausted"),
        RuntimeError("NVSHMEM: out of memory in symmetric heap"),
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB"),
    ],
)
def test_heap_size_advice_only_when_the_error_is_about_memory(monkeypatch, cause) -> None:
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1073741824")
    with pytest.raises(UsageError) as info:
        allocate(monkeypatch, "2.11.0+cu130", FakeSymmMem(needs_group_info=False, fail=cause))
    message = str(info.value)
    assert "\n" not in message and str(cause).splitlines()[0] in message
    assert "NVSHMEM_SYMMETRIC_SIZE is 1073741824: set it above 8192 bytes" in message


def test_heap_size_and_pool_defaults_leave_user_values_alone(monkeypatch) -> None:
    allocate(monkeypatch, "2.11.0", FakeSymmMem(needs_group_info=False))
    import os

    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(1 << 30)  # max(1 GiB, 2 x heap + 256 MiB)
    assert os.environ["TORCH_SYMMMEM_IMPLICIT_POOL"] == "0"
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "8G")
    allocate(monkeypatch, "2.11.0", FakeSymmMem(needs_group_info=False))
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == "8G"


def test_another_symmetric_backend_in_the_process_is_refused(monkeypatch) -> None:
    fake = FakeSymmMem(needs_group_info=False)
    fake.get_backend = lambda device: "CUDA"
    with pytest.raises(UsageError, match="uses the CUDA backend in this process, not NVSHMEM"):
        allocate(monkeypatch, "2.11.0", fake)


REFUSAL = "SymmetricMemory backend NVSHMEM is not available: libnvshmem_host.so.3 not found"


def test_set_backends_refusal_is_the_cause_the_failed_allocation_names(monkeypatch) -> None:
    """torch's set_backend ("Note that the backend cannot be changed once a symmetric memory tensor has been
    allocated", torch/distributed/_symmetric_memory/__init__.py set_backend) raises RuntimeError; its words
    reach the one-line error of what fails next instead of being swallowed."""
    fake = FakeSymmMem(needs_group_info=False, fail=RuntimeError("empty: no allocator for backend"))

    def refuse(name: str) -> None:
        raise RuntimeError(REFUSAL)

    fake.set_backend = refuse
    with pytest.raises(UsageError) as info:
        allocate(monkeypatch, "2.11.0", fake)
    message = str(info.value)
    assert "\n" not in message and "empty: no allocator for backend" in message
    assert f"set_backend('NVSHMEM') had said RuntimeError: {REFUSAL}" in message


def test_a_refused_set_backend_with_another_backend_in_use_says_both(monkeypatch) -> None:
    fake = FakeSymmMem(needs_group_info=False)
    fake.get_backend = lambda device: "CUDA"

    def refuse(name: str) -> None:
        raise RuntimeError("cannot change the backend after a symmetric tensor was allocated")

    fake.set_backend = refuse
    with pytest.raises(UsageError) as info:
        allocate(monkeypatch, "2.11.0", fake)
    message = str(info.value)
    assert "uses the CUDA backend in this process, not NVSHMEM: set_backend('NVSHMEM') said" in message
    assert "cannot change the backend after a symmetric tensor was allocated" in message


def test_a_repeated_set_backend_refusal_is_harmless_when_nvshmem_is_in_use(monkeypatch) -> None:
    """An earlier set-up in this process chose NVSHMEM already: set_backend may refuse, the heap comes."""
    fake = FakeSymmMem(needs_group_info=False)

    def refuse(name: str) -> None:
        raise RuntimeError("backend already set")

    fake.set_backend = refuse
    assert allocate(monkeypatch, "2.11.0", fake).numel() == 4096

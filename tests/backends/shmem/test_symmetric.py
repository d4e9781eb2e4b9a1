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
        self,
        needs_group_info: bool,
        deprecated: bool = False,
        fail: BaseException | None = None,
        registered: tuple[str, ...] = ("NVSHMEM", "CUDA"),
        chosen: str | None = None,
    ) -> None:
        self.needs_group_info, self.deprecated, self.fail = needs_group_info, deprecated, fail
        self.registered, self.chosen, self.in_use = registered, chosen, chosen is not None
        self.calls: list[tuple[str, str]] = []

    def set_backend(self, name: str) -> None:
        """torch/csrc/distributed/c10d/symm_mem/SymmetricMemory.cpp, ``AllocatorMap::set_backend``:
        ``TORCH_CHECK(it != avail_map_.end(), "SymmetricMemory does not find allocation backend ", name)``;
        the one already chosen: ``return``; another: ``TORCH_CHECK(!in_use_, "Backend can not be changed
        after use.")``. ``registered``: the allocators that registered (NVSHMEM's registers when its library
        loads); ``chosen``: a backend that already allocated in this process."""
        self.calls.append(("set_backend", name))
        if name not in self.registered:
            raise RuntimeError(f"SymmetricMemory does not find allocation backend {name}")
        if self.chosen == name:
            return
        if self.chosen is not None and self.in_use:
            raise RuntimeError("Backend can not be changed after use.")
        self.chosen = name

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
    need = 4096 + symm.NVSHMEM_RESERVED_BYTES  # the heap and NVSHMEM's own
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1M")
    with pytest.raises(UsageError) as info:
        allocate(monkeypatch, "2.11.0+cu130", FakeSymmMem(needs_group_info=False, fail=cause))
    message = str(info.value)
    assert "\n" not in message and str(cause).splitlines()[0] in message
    assert f"NVSHMEM_SYMMETRIC_SIZE is 1M: set it to at least {need} bytes" in message
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1073741824")  # large enough: the GPU itself is full
    with pytest.raises(UsageError, match=f"holds the {need} bytes this setup needs, so the GPU has no room"):
        allocate(monkeypatch, "2.11.0+cu130", FakeSymmMem(needs_group_info=False, fail=cause))


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


def test_a_torch_without_the_nvshmem_allocator_says_so_in_torchs_words(monkeypatch) -> None:
    """set_backend's failure was swallowed before: the allocation then failed with a vaguer error."""
    fake = FakeSymmMem(needs_group_info=False, registered=("CUDA",))
    with pytest.raises(UsageError) as info:
        allocate(monkeypatch, "2.11.0", fake)
    message = str(info.value)
    assert "\n" not in message and "SymmetricMemory does not find allocation backend NVSHMEM" in message
    assert "NVSHMEM library" in message and "did not load" in message
    assert [kind for kind, _ in fake.calls] == ["set_backend"]  # nothing allocated after it


def test_another_backend_that_allocated_first_is_named_in_torchs_words(monkeypatch) -> None:
    with pytest.raises(UsageError, match="Backend can not be changed after use.*allocated first") as info:
        allocate(monkeypatch, "2.11.0", FakeSymmMem(needs_group_info=False, chosen="CUDA"))
    assert "\n" not in str(info.value)


def test_nvshmem_chosen_again_by_a_later_setup_is_fine(monkeypatch) -> None:
    fake = FakeSymmMem(needs_group_info=False, chosen="NVSHMEM")
    allocate(monkeypatch, "2.11.0", fake)
    allocate(monkeypatch, "2.11.0", fake)
    assert [kind for kind, _ in fake.calls].count("rendezvous") == 2


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("20m", 20 << 20),
        ("3.1M", 3250586),
        (".5m", 1 << 19),
        ("20kk", 20 << 10),
        ("8G", 8 << 30),
        ("4096", 4096),
    ],
)
def test_nvshmem_symmetric_size_is_read_as_nvshmem_reads_it(text: str, size: int) -> None:
    """NVSHMEM's environment variable documentation: "20m" is 20971520, "3.1M" 3250586, ".5m" as "0.5m",
    one multiplier (what follows it ignored: "20kk" is "20k")."""
    assert symm.parse_symmetric_size(text) == size
    assert symm.symmetric_size(1, {"NVSHMEM_SYMMETRIC_SIZE": text}) == size


def test_an_unset_or_unreadable_symmetric_size_is_commbenchs_default() -> None:
    assert symm.parse_symmetric_size("lots") is None
    for environ in ({}, {"NVSHMEM_SYMMETRIC_SIZE": "lots"}):
        assert (
            symm.symmetric_size(3 << 30, environ)
            == symm.default_symmetric_size(3 << 30)
            == (6 << 30) + (256 << 20)
        )

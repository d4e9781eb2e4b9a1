"""Finding NVSHMEM's device bitcode and handing it to torch's Triton linker through NVSHMEM_LIB_DIR."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from commbench.backends.shmem import bitcode


def no_gpu() -> tuple[int, int]:
    raise AssertionError("the GPU's architecture is asked only when no generic bitcode is there")


def make(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"BC\xc0\xde " + name.encode())
    return folder


def test_generic_bitcode_outside_torchs_search_is_passed_on(tmp_path) -> None:
    user_site = make(tmp_path / "user" / "nvidia" / "nvshmem" / "lib", "libnvshmem_device.bc")
    environ: dict[str, str] = {}
    assert bitcode.export_device_library([str(user_site)], no_gpu, environ) == str(user_site)
    assert environ == {"NVSHMEM_LIB_DIR": str(user_site)}


def test_per_architecture_bitcode_is_linked_under_the_name_torch_reads(tmp_path, monkeypatch) -> None:
    wheel = make(tmp_path / "lib", "libnvshmem_device_sm_80.bc", "libnvshmem_device_sm_90.bc")
    environ: dict[str, str] = {}
    folder = bitcode.export_device_library([str(wheel)], lambda: (9, 0), environ)
    assert folder and environ["NVSHMEM_LIB_DIR"] == folder and folder != str(wheel)
    linked = Path(folder) / "libnvshmem_device.bc"
    assert linked.resolve() == (wheel / "libnvshmem_device_sm_90.bc").resolve()
    # torch's own finder takes exactly that file from the variable.
    nvshmem_triton = pytest.importorskip("torch.distributed._symmetric_memory._nvshmem_triton")
    finder = nvshmem_triton.NvshmemLibFinder
    monkeypatch.setattr(finder, "found_device_lib_path", None)
    monkeypatch.setenv("NVSHMEM_LIB_DIR", folder)
    assert Path(finder.find_device_library()).resolve() == linked.resolve()


def test_same_major_architecture_when_the_exact_one_is_missing(tmp_path) -> None:
    wheel = make(tmp_path / "lib", "libnvshmem_device_sm_90a.bc", "libnvshmem_device_sm_100.bc")
    found = bitcode.find_device_bitcode([str(wheel)], lambda: (9, 0))
    assert found == str(wheel / "libnvshmem_device_sm_90a.bc")


def test_the_nvshmem_next_to_torch_wins_over_later_folders(tmp_path) -> None:
    near_torch = make(tmp_path / "torch_site", "libnvshmem_device_sm_90.bc")
    system = make(tmp_path / "usr_lib", "libnvshmem_device.bc")
    found = bitcode.find_device_bitcode([str(near_torch), str(system)], lambda: (9, 0))
    assert found == str(near_torch / "libnvshmem_device_sm_90.bc")


def test_a_users_nvshmem_lib_dir_wins_and_nothing_found_changes_nothing(tmp_path) -> None:
    wheel = make(tmp_path / "lib", "libnvshmem_device.bc")
    environ = {"NVSHMEM_LIB_DIR": "/opt/mine"}
    assert bitcode.export_device_library([str(wheel)], no_gpu, environ) is None
    assert environ == {"NVSHMEM_LIB_DIR": "/opt/mine"}
    empty: dict[str, str] = {}
    assert bitcode.export_device_library([str(make(tmp_path / "none"))], no_gpu, empty) is None
    assert empty == {}


def test_candidates_include_pythonpath_folders_and_nvshmem_home(tmp_path, monkeypatch) -> None:
    target = tmp_path / "site"  # a pip --target folder on PYTHONPATH
    wheel = make(target / "nvidia" / "nvshmem" / "lib", "libnvshmem_device.bc")
    home = make(tmp_path / "nvshmem_home" / "lib")
    monkeypatch.setattr(sys, "path", [*sys.path, str(target)])
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path / "nvshmem_home"))
    folders = [os.path.realpath(f) for f in bitcode.candidate_dirs()]
    assert os.path.realpath(wheel) in folders and os.path.realpath(home) in folders
    assert folders.index(os.path.realpath(wheel)) < folders.index(os.path.realpath(home))

"""Where NVSHMEM's device bitcode is, for torch's Triton linker (NVSHMEM_LIB_DIR); no GPU imports.

torch's ``_nvshmem_triton.NvshmemLibFinder`` (2.9 to 2.11) takes ``$NVSHMEM_LIB_DIR/libnvshmem_device.bc``
when the variable is set, and otherwise looks only in ``<purelib>/nvidia/nvshmem/lib``, ``/usr/local/lib``,
``/usr/lib``, ``/opt/nvidia/nvshmem/lib`` and the RPATH of ``libtorch_nvshmem.so`` (read with ``readelf``,
whose absence it does not catch). It never looks in the user site, a ``pip --target`` folder on PYTHONPATH or
``$NVSHMEM_HOME``, and it wants the generic name while nvidia-nvshmem 3.8 wheels ship per-architecture
bitcode only (``libnvshmem_device_sm_90.bc``). So commbench finds the bitcode itself, preferring the NVSHMEM
next to torch (the one ``libtorch_nvshmem.so`` loads), and sets NVSHMEM_LIB_DIR to its folder, or to a
temporary folder that links the per-architecture file under the generic name. A user's NVSHMEM_LIB_DIR wins.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib.util
import os
import shutil
import site
import sys
import sysconfig
import tempfile
from collections.abc import Callable, MutableMapping, Sequence

GENERIC = "libnvshmem_device.bc"
WHEEL_LIB = os.path.join("nvidia", "nvshmem", "lib")
SYSTEM_DIRS = ("/usr/local/lib", "/usr/lib", "/opt/nvidia/nvshmem/lib")


def _torch_site() -> str | None:
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec else None
    return os.path.dirname(os.path.dirname(origin)) if origin else None


def candidate_dirs() -> list[str]:
    """Folders that may hold NVSHMEM's device bitcode, the NVSHMEM that torch links first; existing ones."""
    sites = [_torch_site(), sysconfig.get_path("purelib")]
    with contextlib.suppress(ImportError, ValueError, AttributeError):
        spec = importlib.util.find_spec("nvidia.nvshmem")  # the wheel wherever it is installed
        for folder in (spec.submodule_search_locations or []) if spec else []:
            sites.append(os.path.dirname(os.path.dirname(folder)))
    with contextlib.suppress(AttributeError):
        sites.append(site.getusersitepackages())
    sites += [entry for entry in sys.path if entry]  # PYTHONPATH, pip --target folders
    folders = [os.path.join(s, WHEEL_LIB) for s in sites if s]
    if os.environ.get("NVSHMEM_HOME"):
        folders.append(os.path.join(os.environ["NVSHMEM_HOME"], "lib"))
    folders += SYSTEM_DIRS
    unique: dict[str, str] = {}
    for folder in folders:
        if os.path.isdir(folder):
            unique.setdefault(os.path.realpath(folder), folder)
    return list(unique.values())


def _gpu_capability() -> tuple[int, int]:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def find_device_bitcode(
    folders: Sequence[str], capability: Callable[[], tuple[int, int]] = _gpu_capability
) -> str | None:
    """The first folder's ``libnvshmem_device.bc``, else its bitcode for this GPU's architecture (sm_XY,
    then any sm_X*); None when no folder has either. ``capability`` is asked only for the second kind."""
    arch: tuple[int, int] | None = None
    for folder in folders:
        generic = os.path.join(folder, GENERIC)
        if os.path.isfile(generic):
            return generic
        if not glob.glob(os.path.join(folder, "libnvshmem_device_sm_*.bc")):
            continue
        arch = arch or capability()
        major, minor = arch
        exact = os.path.join(folder, f"libnvshmem_device_sm_{major}{minor}.bc")
        same_major = sorted(glob.glob(os.path.join(folder, f"libnvshmem_device_sm_{major}*.bc")))
        for path in [exact, *same_major]:
            if os.path.isfile(path):
                return path
    return None


def _linked_folder(bitcode: str) -> str:
    """A new temporary folder holding ``libnvshmem_device.bc`` -> ``bitcode`` (removed at exit)."""
    folder = tempfile.mkdtemp(prefix="commbench-nvshmem-bc-")
    os.symlink(os.path.realpath(bitcode), os.path.join(folder, GENERIC))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def export_device_library(
    folders: Sequence[str] | None = None,
    capability: Callable[[], tuple[int, int]] = _gpu_capability,
    environ: MutableMapping[str, str] | None = None,
) -> str | None:
    """Set NVSHMEM_LIB_DIR to a folder whose ``libnvshmem_device.bc`` is the bitcode found; returns it.

    None, changing nothing, when NVSHMEM_LIB_DIR is already set (the user's choice) or no bitcode is found
    (torch's own search then reports where it looked).
    """
    environ = os.environ if environ is None else environ
    if environ.get("NVSHMEM_LIB_DIR"):
        return None
    bitcode = find_device_bitcode(candidate_dirs() if folders is None else folders, capability)
    if bitcode is None:
        return None
    folder = os.path.dirname(bitcode) if os.path.basename(bitcode) == GENERIC else _linked_folder(bitcode)
    environ["NVSHMEM_LIB_DIR"] = folder
    return folder

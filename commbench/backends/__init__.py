"""Backend registry: the built-in backends plus those other packages register under the entry point group
``commbench.backends``. Modules are imported lazily, so GPU-only dependencies never load on a CPU machine.

A package registers a backend in its metadata (``pyproject.toml``)::

    [project.entry-points."commbench.backends"]
    mydispatcher = "my_package.bench:MyBackend"

The class subclasses ``commbench.run.interface.Backend`` and ``commbench.backends.options.DeclaredOptions``
(docs/plugins.md). Discovery reads the installed distributions' metadata only; a plug-in's module is
imported when it is chosen (``get_backend``) or listed (``commbench backends``). A plug-in that does not
import, or whose object is not such a class, never breaks commbench: it is listed as unavailable with the
reason, and choosing it is one line, exit code 2. A plug-in whose name is a built-in's is refused (the
built-in wins), and so is a second package registering a name already taken.

A backend describes itself in its class's attributes (``run.interface.Backend``: process group, GPU fabric,
one-sided, emulated, bandwidth vocabulary, kernel names, ...); the other stages read them through
``get_backend`` or ``loaded_backends``, so adding a backend is its own file plus one line below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from commbench.errors import UsageError

ENTRY_POINT_GROUP = "commbench.backends"

# name -> "module:Class" of the backends shipped with commbench; "auto" is resolved by the CLI (nccl with
# GPUs, gloo without). The adapters drive other libraries' dispatchers (commbench/backends/adapters/).
BUILTIN_BACKENDS: dict[str, str] = {
    "nccl": "commbench.backends.torchdist:NcclBackend",
    "gloo": "commbench.backends.torchdist:GlooBackend",
    "mock": "commbench.backends.mock:MockBackend",
    "sim": "commbench.backends.sim:SimBackend",
    "shmem-emu": "commbench.backends.shmem.emu:ShmemEmuBackend",
    "nvshmem": "commbench.backends.shmem.nvshmem:NvshmemBackend",
    "deep-ep": "commbench.backends.adapters.deep_ep:DeepEpBackend",
    "uccl-ep": "commbench.backends.adapters.uccl_ep:UcclEpBackend",
    "pplx": "commbench.backends.adapters.pplx:PplxBackend",
    "nccl-ep": "commbench.backends.adapters.nccl_ep:NcclEpBackend",
}


@dataclass(frozen=True)
class BackendEntry:
    """One backend name as the registry knows it: where its class is and where it comes from."""

    name: str
    target: str  # "module:Class" (an entry point's value: "module:attr.path")
    package: str = ""  # the distribution that registered it; "" for a built-in
    version: str = ""  # that distribution's version
    refused: str = ""  # why the registry does not use it (a name clash); "" when it is used

    @property
    def builtin(self) -> bool:
        return not self.package

    @property
    def source(self) -> str:
        """Where the backend comes from: "built-in" or "<package> <version>"."""
        return "built-in" if self.builtin else f"{self.package} {self.version}".strip()


def _discover(builtins: dict[str, str]) -> tuple[list[BackendEntry], str]:
    """(every entry point of ENTRY_POINT_GROUP as an entry, clashes marked refused; why discovery failed
    or "")."""
    try:
        points = sorted(
            metadata.entry_points(group=ENTRY_POINT_GROUP),
            key=lambda point: (point.name, getattr(point.dist, "name", "") or ""),
        )
    except Exception as exc:  # noqa: BLE001 - broken metadata of some package must not break commbench
        return [], f"reading the installed packages' entry points failed: {type(exc).__name__}: {exc}"
    entries: list[BackendEntry] = []
    taken: dict[str, str] = {}
    for point in points:
        dist = point.dist
        package = str(getattr(dist, "name", "") or "unknown package")
        version = str(getattr(dist, "version", "") or "")
        refused = ""
        if point.name in builtins or point.name == "auto":
            refused = f"the name {point.name!r} is a built-in backend's; the built-in is used"
        elif point.name in taken:
            refused = f"the name {point.name!r} is already registered by {taken[point.name]}"
        else:
            taken[point.name] = f"{package} {version}".strip()
        entries.append(BackendEntry(point.name, point.value, package, version, refused))
    return entries, ""


def _registry() -> tuple[dict[str, BackendEntry], list[BackendEntry], str]:
    plugins, error = _discover(BUILTIN_BACKENDS)
    entries = {name: BackendEntry(name, target) for name, target in BUILTIN_BACKENDS.items()}
    entries.update((entry.name, entry) for entry in plugins if not entry.refused)
    return entries, [entry for entry in plugins if entry.refused], error


# Every usable backend name (built-ins first, then plug-ins), the refused plug-ins, and why discovery failed.
ENTRIES, REFUSED, DISCOVERY_ERROR = _registry()
# name -> "module:Class", as existing callers (the --backend choices) read it.
BACKENDS: dict[str, str] = {name: entry.target for name, entry in ENTRIES.items()}


def _resolve(target: str) -> Any:
    """The object an entry point value "module:attr.path" (extras "[...]" ignored) names."""
    module_name, _, attr = target.split("[")[0].strip().partition(":")
    found: Any = importlib.import_module(module_name.strip())
    for part in attr.strip().split(".") if attr.strip() else ():
        found = getattr(found, part)
    return found


def not_a_backend(found: Any) -> str:
    """Why ``found`` cannot serve as a backend class, or "" when it can."""
    from commbench.backends.options import DeclaredOptions
    from commbench.run.describe import PROCESS_GROUPS
    from commbench.run.interface import Backend

    if not isinstance(found, type):
        return (
            f"it names a {type(found).__name__}, not a subclass of commbench.run.interface.Backend "
            "(see docs/plugins.md)"
        )
    if not issubclass(found, Backend):
        return f"class {found.__qualname__} does not subclass commbench.run.interface.Backend"
    if not issubclass(found, DeclaredOptions):
        return (
            f"class {found.__qualname__} does not declare its options: subclass "
            "commbench.backends.options.DeclaredOptions too (OPTIONS = () for none)"
        )
    if found.process_group not in PROCESS_GROUPS:
        return (
            f"class {found.__qualname__} sets process_group = {found.process_group!r}; use one of: "
            f"{', '.join(PROCESS_GROUPS)}"
        )
    if getattr(found, "__abstractmethods__", None):
        missing = ", ".join(sorted(found.__abstractmethods__))
        return f"class {found.__qualname__} does not implement {missing}"
    return ""


def load_backend(name: str) -> tuple[type | None, str]:
    """(the backend class of ``name``, "") or (None, why it cannot be loaded: its import failed, or it is
    not a Backend). Never raises for a registered name; UsageError for an unknown one."""
    entry = ENTRIES.get(name)
    if entry is None:
        raise UsageError(f"unknown backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    try:
        found = _resolve(entry.target)
    except Exception as exc:  # noqa: BLE001 - any failure of a third-party import is a reason, not a crash
        text = " ".join(str(exc).split()) or "(no message)"
        return None, f"importing {entry.target} failed: {type(exc).__name__}: {text}"[:400]
    reason = not_a_backend(found)
    return (None, f"{entry.target}: {reason}") if reason else (found, "")


def get_backend(name: str) -> type:
    """The backend class registered as ``name``; UsageError (one line, exit code 2) when it is unknown or
    its package's class cannot be used, naming the package and the reason."""
    backend_class, reason = load_backend(name)
    if backend_class is None:
        entry = ENTRIES[name]
        where = "built-in backend" if entry.builtin else f"backend from package {entry.source}"
        raise UsageError(f"--backend {name}: the {where} cannot be used: {reason}")
    return backend_class


def loaded_backends() -> list[tuple[str, type]]:
    """(name, class) of every registered backend whose class loads, in registry order (built-ins first):
    what the report assembles from the backends' own descriptions (kernel names, bandwidth vocabularies).
    One that does not load is left out (``commbench backends`` says why)."""
    found = []
    for name in ENTRIES:
        backend_class, _ = load_backend(name)
        if backend_class is not None:
            found.append((name, backend_class))
    return found


def availability(name: str) -> tuple[bool, str]:
    """(whether ``name`` can run on this host, why not): the class loads, its ``check_available`` (a
    classmethod raising UsageError with the reason, e.g. "needs CUDA GPUs and deep_ep") passes, and this
    host can form its ``process_group``: nccl needs CUDA devices and torch's NCCL, gloo torch's gloo."""
    backend_class, reason = load_backend(name)
    if backend_class is None:
        return False, reason
    check = getattr(backend_class, "check_available", None)
    try:
        if callable(check):
            check()
    except UsageError as exc:
        return False, " ".join(str(exc).split())
    except Exception as exc:  # noqa: BLE001 - a plug-in's check may fail any way: that is its answer
        return False, f"its availability check failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
    return _process_group_available(backend_class.process_group)


def _process_group_available(process_group: str) -> tuple[bool, str]:
    import torch
    import torch.distributed as dist

    if process_group == "gloo":
        return (True, "") if dist.is_gloo_available() else (False, "this torch build has no gloo")
    if not dist.is_nccl_available():
        return False, "this torch build has no NCCL"
    if torch.cuda.device_count() < 1:
        return False, "this host has no CUDA device"
    return True, ""

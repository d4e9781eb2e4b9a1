"""Fake dispatcher libraries for the adapter tests: modules with the API shape of DeepEP, UCCL-EP,
pplx-kernels and NCCL EP whose calls really move the rows between gloo ranks (all_to_all_single), with each
library's receive layouts and combine arithmetic (bf16 output), so an adapter's mapping is exercised on CPU.
Each fake's ``install`` puts it into ``sys.modules`` under the library's import name."""

from __future__ import annotations

import sys
from types import ModuleType


def install_modules(modules: dict[str, ModuleType]) -> None:
    """Make ``import NAME`` return ``modules[NAME]`` (parents first, a child an attribute of its parent)."""
    for name in sorted(modules, key=lambda text: text.count(".")):
        module = modules[name]
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def remove_modules(*prefixes: str) -> None:
    """Forget every module named ``prefix`` or ``prefix.*`` (a test installs fakes for itself only)."""
    for name in list(sys.modules):
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes):
            del sys.modules[name]

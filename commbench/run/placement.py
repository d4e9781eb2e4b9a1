"""The run's layout: every rank's place (host, GPU, NVLink fabric clique) gathered into one ``Layout``."""

from __future__ import annotations

from typing import Any

from commbench.hardware.probes import local_place
from commbench.inputs.layout import Layout, build_layout
from commbench.run.config import RunOptions


def gather_layout(comm: Any, opts: RunOptions) -> Layout:
    """Collective: every rank all-gathers its ``local_place`` and builds the same layout (the
    ``ranks_per_domain`` / ``ranks_per_host`` overrides win over what was found)."""
    device = getattr(comm, "device", None)
    index = device.index if device is not None and device.type == "cuda" else None
    places = comm.all_gather_object(local_place(index))
    return build_layout(comm.world_size, opts.ranks_per_domain, opts.ranks_per_host, discovered=places)

"""The value types a backend describes itself with (``run.interface.Backend``'s class attributes): how its
library defines the bandwidth it prints, and the names of its GPU kernels.

They live in the run stage, beside the interface, so that a backend declares them without importing the
report, and the report reads them from the backend classes (``backends.describe``). Nothing heavy here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Process groups a backend's ranks can join (``Backend.process_group``): one GPU per rank, or CPU processes.
PROCESS_GROUPS = ("nccl", "gloo")

COMMUNICATION = "communication"
COMPUTE = "compute"
KINDS = (COMMUNICATION, COMPUTE)


@dataclass(frozen=True)
class LibraryBandwidth:
    """One figure a library prints: ``bytes_column`` / ``time_column`` of a result row, the bytes counted as
    the library counts them: each of the row's rows (``bytes_column`` / ``row_bytes``) plus what the library
    sends with it, ``extra_bytes_per_row`` (a message header) and the row's ``extra_bytes_column`` (per-token
    metadata whose size the adapter reports as a column, e.g. top-k ids and weights)."""

    library: str  # "DeepEP"
    phase: str  # "dispatch" | "combine"
    label: str  # how the library's own output names the figure, e.g. "GB/s (NVL)"
    bytes_column: str  # a byte column of the row, e.g. "max_recv_bytes"
    time_column: str  # a time column of the row, e.g. "time_us_mean"
    bytes_meaning: str  # what the library counts
    time_meaning: str  # what the library times
    modes: tuple[str, ...] = ()  # the adapter's ``mode`` knob values it applies to; () = every mode
    extra_bytes_per_row: int = 0  # bytes the library sends with every row (DeepEP low-latency: 16)
    extra_bytes_column: str = ""  # a row column: more bytes per row (the adapter's knob), "" = none

    def applies(self, phase: str, mode: str) -> bool:
        return phase == self.phase and (not self.modes or mode in self.modes)


@dataclass(frozen=True)
class KernelPattern:
    """Kernels of ``library`` whose demangled name matches ``pattern`` are ``kind`` (communication or
    compute); ``report.profiler.kernels`` assembles every backend's into its registry."""

    library: str
    kind: str
    pattern: re.Pattern[str]
    source: str  # where the names come from (repository and file), to re-check when a library changes


def kernel_names(body: str) -> re.Pattern[str]:
    """A kernel name pattern: ``body`` at the very start of the demangled name (after an optional return
    type ``void``), followed by the end of the name, template arguments or the parameter list, so that
    ``dispatch`` does not match ``dispatch_layout``."""
    return re.compile(rf"^(?:void )?(?:{body})(?:<|\(|$)")

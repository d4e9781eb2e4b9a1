"""The NVSHMEM backend's put path: one phase's put and wait kernel launches, their arguments and errors.

A mixin of ``NvshmemBackend`` (``shmem.nvshmem``), which holds the state these methods read: the signal
trackers, the device tables (host-laid-out, or counts=device's ``shmem.device_counts.DeviceLayout``), the
heap's symmetric addresses, the pinned timeout flags and the loaded kernels (``shmem.kernels``, Triton,
imported only when the backend loads them).
"""

from __future__ import annotations

from typing import Any

from commbench.backends.shmem import protocol as proto
from commbench.backends.shmem import symmetric as symm
from commbench.errors import CommbenchError, UsageError

KERNEL_HINT = (
    "it needs Triton >= 3.4 and NVSHMEM device bitcode (libnvshmem_device.bc, NVSHMEM_LIB_DIR) of the "
    "NVSHMEM version torch pins; see docs/nvshmem.md"
)


class PutPath:
    """The put path of ``NvshmemBackend`` (module docstring)."""

    _device: Any
    _device_tables: dict[str, Any]
    _trackers: dict[str, proto.SignalTracker]
    _layout: Any
    _addr: dict[str, int]
    _errors: dict[str, Any]
    _slots: int
    _put: Any
    _wait: Any
    _launched: set[str]
    settings: dict[str, Any]
    num_warps: int
    num_blocks: int
    comm: Any
    steps: Any

    def _run_phase(self, phase: str, layout: proto.PhaseLayout, row_bytes: int) -> int:
        """Launch the put and wait kernels of one iteration; returns the receive buffer's parity."""
        epoch, _expected = self._trackers[phase].advance(layout)
        if self._device is not None:  # counts=device: each source's running total advanced on the device
            self._device.advance(phase)
        with self.steps("put issue"):  # the put kernel (CUDA events around it under --profile)
            self.launch_puts(phase, layout, row_bytes, epoch)
        with self.steps("signal wait"):  # the wait kernel: until every source's signals arrived
            self._launch_waits(phase, layout, epoch)
        return proto.parity(epoch)

    def _put_launch(
        self, phase: str, layout: proto.PhaseLayout, row_bytes: int, epoch: int
    ) -> tuple[tuple[int], tuple[Any, ...], dict[str, Any]]:
        """The put kernel's (grid, arguments, keyword arguments) for one iteration of ``phase``."""
        items, _waits, _epoch0 = self._device_tables[phase]
        recv_region = self._layout[f"{phase}_recv"]  # type: ignore[index]
        recv_addr = self._addr[f"{phase}_recv"] + proto.parity(epoch) * (recv_region.nbytes // 2)
        signals = layout.signals
        args = (
            items,
            self._addr[f"{phase}_send"],
            recv_addr,
            self._addr[f"{phase}_signal"],
            int(items.shape[0]),  # counts=device: the fixed grid, inactive items marked rows -1
            row_bytes,
            proto.signal_value(signals.op, epoch),
            signals.nvshmem_op,
        )
        kwargs = {"BLOCKING": self.settings["put"] == "blocking", "num_warps": self.num_warps}
        return (min(self.num_blocks, int(items.shape[0])),), args, kwargs

    def _wait_launch(
        self, phase: str, layout: proto.PhaseLayout, epoch: int
    ) -> tuple[tuple[int], tuple[Any, ...], dict[str, Any]]:
        """The wait kernel's (grid, arguments, keyword arguments) for one iteration of ``phase``."""
        _items, waits, epoch0 = self._device_tables[phase]
        args = (
            waits,
            self._addr[f"{phase}_signal"],
            0 if self._slots else epoch - epoch0,  # counts=device: the table holds the total itself
            epoch,
            int(self.comm.timeout_s * 1e9),
            self._errors[phase].data_ptr(),
        )
        kwargs = {
            "USE_SET": layout.signals.op == "set",
            "SPIN": self.settings["wait"] == "spin",
            "num_warps": 1,
        }
        return (int(waits.shape[0]),), args, kwargs

    def launch_puts(self, phase: str, layout: proto.PhaseLayout, row_bytes: int, epoch: int) -> None:
        """The put kernel alone (benchmarks/gpu_check.py times it back to back: loopback bandwidth)."""
        grid, args, kwargs = self._put_launch(phase, layout, row_bytes, epoch)
        try:
            self._put[grid](*args, **kwargs)
        except Exception as exc:
            self._kernel_failed("put", exc)
        self._launched.add("put")

    def _launch_waits(self, phase: str, layout: proto.PhaseLayout, epoch: int) -> None:
        grid, args, kwargs = self._wait_launch(phase, layout, epoch)
        try:
            self._wait[grid](*args, **kwargs)
        except Exception as exc:
            self._kernel_failed("wait", exc)
        self._launched.add("wait")

    def _kernel_failed(self, kernel: str, exc: Exception) -> None:
        """Re-raise a kernel's error: a one-line UsageError when it never compiled and launched before (a
        Triton / NVSHMEM bitcode mismatch), the error itself after that (a fault at run time)."""
        if kernel in self._launched or isinstance(exc, CommbenchError):
            raise exc
        raise UsageError(
            f"--backend nvshmem: the Triton {kernel} kernel failed to build or launch "
            f"({symm.error_summary(exc)}); {KERNEL_HINT}"
        ) from exc

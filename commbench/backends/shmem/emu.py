"""CPU emulator of the one-sided (NVSHMEM-style) dispatch/combine: a symmetric heap shared by local processes.

Runs the layout and signalling of the shmem protocol (the same code the GPU backend uses) with
real concurrent processes, so CI tests the put-based algorithm with verification on. Its timings are those of
Python copies on a CPU: reports label the backend "shmem-emu (CPU emulator)" and never as GPU figures.

The heap is one file in /dev/shm holding ``world_size`` equal PE regions, created by rank 0, mapped by every
rank after a barrier and unlinked as soon as all have mapped it (nothing is left behind if a rank dies).

Operations (one process = one PE; every item is issued by its source, as a GPU thread block would):

* ``put``: copy rows into a peer's receive buffer (``SharedHeap.put``).
* ``put-with-signal``: put, then ``fence``, then the signal word store, so a receiver that sees the signal
  sees the payload. Every signal word has a single writer (the word belongs to one source), so ADD is a
  plain read-modify-write by that writer and 8-byte aligned stores are atomic on the hosts we run on.
* ``fence`` / ``quiet``: a full memory barrier (CPython's lock acquire/release is an atomic read-modify-write,
  a full barrier on x86-64 and AArch64); puts are synchronous copies, so quiet is a fence.
* ``signal wait``: poll the receiver's own words until each reaches its expected value (``CMP_GE``), with
  the communicator's timeout; a timeout raises CommError naming the sources that never signalled.

Counts (``--backend-option counts=host|device``, ``protocol``'s module docstring): host all-gathers the
count matrix with the process group; device runs the protocol's "counts" phase through this heap (each rank
puts its count row with a signal into every PE's ``counts_recv``, then waits for every source) and lays the
data phases out from the received matrix with ``protocol.device_tables`` (torch on CPU tensors here: the
same function the GPU backend runs on the device), so CI runs the count protocol NVSHMEM runs. The count
slots are not poisoned: they are metadata, and a stale matrix equals the current one (verification of the
rows they lay out still catches a lost exchange only when the counts changed).

Before each timed iteration the harness poisons this rank's receive buffers, both sides of each phase's
double buffer (``poison_receive_buffers``), so puts that are lost while their signals arrive leave the
sentinel, not the previous iteration's rows.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from commbench.backends.base import CombineReduction
from commbench.backends.options import BackendOption, PutSignalOptions, put_signal_options
from commbench.backends.shmem import protocol as proto
from commbench.errors import CommError, UsageError
from commbench.run.interface import Backend, ExchangeShape
from commbench.run.processes import scratch_name
from commbench.traffic.payload import POISON_BYTE
from commbench.traffic.plan import RankPlan

_FENCE_LOCK = threading.Lock()
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 2e-3


def fence() -> None:
    """Full memory barrier between this process's earlier and later stores (see module docstring)."""
    with _FENCE_LOCK:
        pass


def host_identity() -> str:
    """Host name plus boot id: equal only for processes on the same machine (containers included)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def heap_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedHeap:
    """``world_size`` PE regions of ``pe_bytes`` each, mapped from one shared file."""

    def __init__(self, path: str, world_size: int, pe_bytes: int, create: bool) -> None:
        self.path = path
        self.world_size = world_size
        self.pe_bytes = pe_bytes
        size = world_size * pe_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)  # zero-filled: every signal word starts at 0
                try:
                    # Reserve the pages now: a sparse file on a full /dev/shm maps fine and then ends the
                    # rank with SIGBUS at the first write.
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    free = shutil.disk_usage(os.path.dirname(path)).free
                    raise UsageError(
                        f"shmem-emu needs a {size / 2**20:.0f} MiB heap in {os.path.dirname(path)}, which "
                        f"has {free / 2**20:.0f} MiB free ({exc.strerror}); use fewer tokens or ranks, or a "
                        "larger /dev/shm (docker run --shm-size)"
                    ) from None
            elif os.fstat(fd).st_size != size:
                raise CommError(f"shmem-emu heap {path} has {os.fstat(fd).st_size} bytes, expected {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            if fd >= 0:
                os.close(fd)
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)

    def view(self, pe: int, region: proto.Region) -> np.ndarray:
        """``region`` of PE ``pe`` as a numpy array (int64 signal words, uint8 rows)."""
        start = pe * self.pe_bytes + region.offset
        raw = self.bytes[start : start + region.nbytes]
        dtype = np.int64 if region.dtype == torch.int64 else np.uint8
        return raw.view(dtype).reshape(region.shape)

    def put(self, pe: int, region: proto.Region, side: int, first_row: int, rows: np.ndarray) -> None:
        """Copy ``rows`` into side ``side`` of PE ``pe``'s double-buffered ``region``, from row
        ``first_row`` on (the payload half of a put-with-signal)."""
        self.view(pe, region)[side, first_row : first_row + rows.shape[0]] = rows

    def close(self) -> None:
        self.bytes = np.empty(0, dtype=np.uint8)
        # A caller may still hold a returned view: then the mapping goes when that is collected.
        with contextlib.suppress(BufferError):
            self._map.close()


class ShmemEmuBackend(PutSignalOptions, Backend):
    name = "shmem-emu"
    emulated = True
    one_sided = True  # nvshmem's heap layout: each receive buffer has two sides

    OPTIONS: ClassVar[tuple[BackendOption, ...]] = put_signal_options(default_chunk_bytes=64 * 1024)

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.settings = self.check_options(self.options)
        self.chunk_rows: int | None = self.settings["chunk_rows"]
        self.chunk_bytes: int = self.settings["chunk_bytes"]
        self.device_counts = self.settings["counts"] == "device"
        if comm.device.type != "cpu":
            raise UsageError(
                f"backend shmem-emu runs on CPU processes, got device {comm.device}; "
                "use --backend nvshmem on GPUs"
            )
        self._heap: SharedHeap | None = None
        self._heap_key: tuple[Any, ...] | None = None
        self._reduce = CombineReduction()
        self._reset_layout()

    @property
    def label(self) -> str:
        return "shmem-emu (CPU emulator)"

    @classmethod
    def symmetric_memory_bytes(cls, shape: ExchangeShape) -> int:
        """One PE's region of the shared heap file (host memory in /dev/shm; every rank holds one region of
        it), as ``setup`` lays it out from the busiest rank's capacity, with the signal words of the widest
        signal option (``protocol.widest_heap``)."""
        rows = np.asarray(shape.rows)
        return proto.widest_heap(
            rows, shape.dispatch_row_bytes, shape.combine_row_bytes, rows.shape[0], shape.slots
        ).nbytes

    def knobs(self) -> dict[str, Any]:
        dispatch = self._signals[0] if self._signals else None
        return {
            "chunk_rows": dispatch.chunk_rows if dispatch else self.chunk_rows,
            "signal": self.settings["signal"],
            "signal_op": self.settings["signal_op"],
            "counts": self.settings["counts"],
        }

    # ------------------------------------------------------------------------------------------------
    # Setup: same-host check, worst-case sizing from every rank's counts, heap creation.

    def _reset_layout(self) -> None:
        self._signals: tuple[proto.SignalConfig, proto.SignalConfig] | None = None
        self._capacity: proto.Capacity | None = None
        self._layout: proto.HeapLayout | None = None
        self._matrix_key: bytes | None = None
        self._phases: dict[str, proto.PhaseLayout] = {}
        self._trackers: dict[str, proto.SignalTracker] = {}
        self._slots = 0  # counts on the device: count columns per destination (0: counts on the host)

    @property
    def _signalled(self) -> tuple[str, ...]:
        """The protocol phases with signal words in this heap: dispatch, combine (and counts)."""
        return (*proto.PHASES, "counts") if self._slots else proto.PHASES

    def setup(self, plan: RankPlan) -> None:
        hosts = self.comm.all_gather_object(host_identity())
        if len(set(hosts)) != 1:
            raise UsageError(
                "backend shmem-emu needs every rank on one host (a shared-memory heap); ranks run on "
                f"{len(set(hosts))} hosts: use --backend gloo, nccl or nvshmem across hosts"
            )
        matrix = self._gather_counts(plan.send_counts)
        self._signals = proto.phase_signal_configs(
            self.settings["signal"],
            self.settings["signal_op"],
            plan.dispatch_row_bytes,
            plan.combine_row_bytes,
            self.chunk_rows,
            self.chunk_bytes,
        )
        self._capacity = proto.buffer_capacity(matrix)
        self._slots = int(plan.send_counts.shape[1]) if self.device_counts else 0
        self._layout = proto.heap_layout(
            self._capacity,
            plan.dispatch_row_bytes,
            plan.combine_row_bytes,
            self._signals[0],
            self._signals[1],
            self.comm.world_size,
            self._slots,
        )
        key = (self._layout.nbytes, tuple(self._layout.regions.values()))
        if self._heap is None or self._heap_key != key:
            self._open_heap()
            self._heap_key = key
        # Fresh counters need fresh (zero) signal words: a new heap is zero; a reused one is cleared, then
        # every rank waits at a barrier so nobody signals into a word that is still being cleared.
        else:
            for phase in self._signalled:
                self._heap.view(self.comm.rank, self._layout[f"{phase}_signal"])[:] = 0
            fence()
            self.comm.barrier()
        self._trackers = {
            phase: proto.SignalTracker(self.settings["signal_op"], self._layout[f"{phase}_signal"].shape[0])
            for phase in self._signalled
        }
        self._matrix_key = None
        self._use_matrix(matrix)
        if self._slots:
            self._phases["counts"] = proto.count_layout(self.comm.world_size, self.comm.rank)
            self._use_device_matrix(matrix)

    def _open_heap(self) -> None:
        if self._heap is not None:
            self.comm.barrier()  # nobody still reads the old heap
            self._heap.close()
            self._heap = None
        assert self._layout is not None
        comm = self.comm
        # Named after the launch: a launcher whose ranks were killed mid-setup removes it (run.liveness).
        name = scratch_name("shmem-emu") if comm.rank == 0 else None
        path = os.path.join(heap_directory(), comm.all_gather_object(name)[0])
        created = False
        try:
            if comm.rank == 0:
                self._heap = SharedHeap(path, comm.world_size, self._layout.nbytes, create=True)
                created = True
            comm.barrier()  # the file exists and has its size
            if comm.rank != 0:
                self._heap = SharedHeap(path, comm.world_size, self._layout.nbytes, create=False)
            comm.barrier()  # every rank has mapped it
        finally:
            if created:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _gather_counts(self, send_counts: torch.Tensor) -> np.ndarray:
        """Every rank's send counts: int64 [src, dst, slots] (a real MoE layer exchanges these too)."""
        local = send_counts.detach().to(device="cpu", dtype=torch.int64).contiguous()
        gathered = [torch.empty_like(local) for _ in range(self.comm.world_size)]
        with self.comm.guard("shmem-emu count exchange"):
            dist.all_gather(gathered, local, group=self.comm.group)
        return torch.stack(gathered).numpy()

    def _use_matrix(self, matrix: np.ndarray) -> None:
        rows = proto.row_counts(matrix)
        key = rows.tobytes()
        if key == self._matrix_key:
            return
        assert self._capacity is not None and self._signals is not None
        if not self._capacity.covers(rows):
            raise UsageError(
                "shmem-emu: the exchanged counts exceed the symmetric buffers sized at setup; call setup "
                "with the plan whose counts are exchanged"
            )
        rank = self.comm.rank
        self._phases = {
            "dispatch": proto.phase_layout(rows, rank, self._signals[0], self._capacity),
            "combine": proto.phase_layout(rows.T, rank, self._signals[1], self._capacity),
        }
        self._matrix_key = key

    def _use_device_matrix(self, matrix: np.ndarray) -> None:
        """Counts on the device: the data phases' put items and wait increments from ``matrix`` by
        ``protocol.device_tables`` (what the GPU backend computes on its GPU), the rest of each layout (its
        splits) from the same matrix."""
        assert self._capacity is not None and self._signals is not None
        rows = proto.row_counts(matrix)
        if not self._capacity.covers(rows):
            raise UsageError("shmem-emu: the exchanged counts exceed the symmetric buffers sized at setup")
        rank, phases = self.comm.rank, {}
        for phase, phase_rows, signals in (
            ("dispatch", rows, self._signals[0]),
            ("combine", np.ascontiguousarray(rows.T), self._signals[1]),
        ):
            chunks = proto.max_chunks(signals, self._capacity)
            items, increments = proto.device_tables(torch.from_numpy(phase_rows), rank, signals, chunks)
            table = proto.active_items(items.numpy())
            host = proto.phase_layout(phase_rows, rank, signals, self._capacity)
            phases[phase] = replace(
                host,
                item_dst=table[:, 0],
                item_src_row=table[:, 1],
                item_dst_row=table[:, 2],
                item_rows=table[:, 3],
                item_word=table[:, 4],
                wait_increment=increments.numpy()[host.wait_source],
            )
        self._phases.update(phases)
        self._matrix_key = rows.tobytes()

    def _device_counts(self, send_counts: torch.Tensor) -> np.ndarray:
        """The counts phase: this rank's count row put into every PE's ``counts_recv`` row ``rank`` with a
        signal, then every source's row waited for; the received matrix int64 [src, dst, slots]."""
        heap, regions = self._heap_and_layout()
        staging = heap.view(self.comm.rank, regions["counts_send"])
        staging.view(np.int64)[0, :] = send_counts.detach().to(torch.int64).reshape(-1).numpy()
        received = self._run_phase("counts", self._phase("counts"), staging)
        world = self.comm.world_size
        return received.view(np.int64).reshape(world, world, self._slots).copy()

    # ------------------------------------------------------------------------------------------------
    # The backend contract.

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        if self._slots:
            matrix = self._device_counts(send_counts)
            self._use_device_matrix(matrix)
            return torch.from_numpy(np.ascontiguousarray(matrix[:, self.comm.rank, :]))
        matrix = self._gather_counts(send_counts)
        if self._capacity is not None:
            self._use_matrix(matrix)
        return torch.from_numpy(np.ascontiguousarray(matrix[:, self.comm.rank, :])).to(send_counts.device)

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        layout = self._phase("dispatch")
        heap, regions = self._heap_and_layout()
        staging = torch.from_numpy(heap.view(self.comm.rank, regions["dispatch_send"]))[: layout.send_rows]
        with self.steps("pack"):
            if plan.send_mode == "balanced":
                staging.copy_(tokens)
            else:
                torch.index_select(tokens, 0, plan.send_token_index, out=staging)
        buffer = self._run_phase("dispatch", layout, staging.numpy())
        return torch.from_numpy(buffer[: layout.recv_rows])

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        layout = self._phase("combine")
        heap, regions = self._heap_and_layout()
        rows, hidden = int(expert_out.shape[0]), int(expert_out.shape[1])
        row_bytes = hidden * expert_out.element_size()
        if rows != layout.send_rows or row_bytes != plan.combine_row_bytes:
            raise ValueError(
                f"combine got {rows} rows of {row_bytes} B, expected {layout.send_rows} rows of "
                f"{plan.combine_row_bytes} B"
            )
        staging = heap.view(self.comm.rank, regions["combine_send"])[:rows]
        with self.steps("pack"):
            torch.from_numpy(staging).copy_(expert_out.contiguous().view(torch.uint8))
        buffer = self._run_phase("combine", layout, staging)
        returned = torch.from_numpy(buffer[: layout.recv_rows]).view(expert_out.dtype)
        with self.steps("weighted reduce"):
            return self._reduce(returned, plan.send_token_index, plan.combine_weight, plan.num_tokens)

    def poison_receive_buffers(self) -> None:
        # Only this PE's regions: peers poison their own, before the barrier that precedes their puts.
        if self._heap is not None and self._layout is not None:
            for phase in proto.PHASES:
                self._heap.view(self.comm.rank, self._layout[f"{phase}_recv"]).fill(POISON_BYTE)

    def synchronize(self) -> None:
        pass  # puts and waits are synchronous

    def close(self) -> None:
        if self._heap is not None:
            self._heap.close()
            self._heap = None
        self._heap_key = None
        self._reset_layout()

    # ------------------------------------------------------------------------------------------------
    # One phase: puts with signals to every destination, then the wait for every source.

    def _phase(self, phase: str) -> proto.PhaseLayout:
        if phase not in self._phases:
            raise RuntimeError("shmem-emu: setup(plan) must run before dispatch/combine")
        return self._phases[phase]

    def _heap_and_layout(self) -> tuple[SharedHeap, proto.HeapLayout]:
        if self._heap is None or self._layout is None:
            raise RuntimeError("shmem-emu: setup(plan) must run before dispatch/combine")
        return self._heap, self._layout

    def _run_phase(self, phase: str, layout: proto.PhaseLayout, staging: np.ndarray) -> np.ndarray:
        """Issue this rank's items, wait for its own signals; returns its receive buffer of this epoch."""
        heap, regions = self._heap_and_layout()
        epoch, expected = self._trackers[phase].advance(layout)
        side = proto.parity(epoch)
        recv_region, signal_region = regions[f"{phase}_recv"], regions[f"{phase}_signal"]
        value = proto.signal_value(layout.signals.op, epoch)
        add = layout.signals.op == "add"
        with self.steps("put issue"):
            for dst, src_row, dst_row, rows, word in layout.items_table().tolist():
                if rows:
                    heap.put(dst, recv_region, side, dst_row, staging[src_row : src_row + rows])
                fence()  # the payload is visible before the signal
                words = heap.view(dst, signal_region)
                words[word] = words[word] + value if add else value
            fence()  # quiet: every put of this rank is complete
        with self.steps("signal wait"):
            self._wait(phase, layout, heap.view(self.comm.rank, signal_region), expected, epoch)
        return heap.view(self.comm.rank, recv_region)[side]

    def _wait(
        self, phase: str, layout: proto.PhaseLayout, words: np.ndarray, expected: np.ndarray, epoch: int
    ) -> None:
        timeout_s = float(self.comm.timeout_s)
        deadline = time.monotonic() + timeout_s
        pause = _POLL_MIN_S
        profiling = self.steps.enabled
        sources = sorted({int(src) for src in layout.wait_source})
        while True:
            if profiling:  # when each source's signals were first all seen (the per-peer arrival matrix)
                missing = set(proto.missing_sources(layout, words, expected))
                for src in sources:
                    if src not in missing:
                        self.steps.peer_arrival(src)
            if np.all(words[layout.wait_word] >= expected):
                fence()  # reads of the payload come after the signal reads
                return
            if time.monotonic() > deadline:
                missing = proto.missing_sources(layout, words, expected)
                raise CommError(
                    f"shmem-emu: rank {self.comm.rank} waited {timeout_s:g} s in {phase} (iteration {epoch}) "
                    f"for the signals of rank(s) {', '.join(map(str, missing))}; a peer died, hung or ran "
                    "a different plan"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

"""NVSHMEM device-initiated puts: the one-sided dispatch/combine path (DeepEP / pplx-kernels style) on GPUs.

NVSHMEM is bootstrapped from the running torch.distributed job through torch symmetric memory
(``set_backend("NVSHMEM")``, ``empty``, ``rendezvous``: torch shares NVSHMEM's unique id over the process
group's store), so the same torchrun / Slurm launch serves the NCCL and NVSHMEM backends. Every PE holds the
symmetric heap of ``commbench.backends.shmem.protocol.heap_layout`` in one symmetric allocation.

Per phase the host launches, with no loop over peers:

1. a local gather of the rows to send into the symmetric staging buffer (dispatch: ``index_select`` of the
   token rows, as every dispatcher packs; combine: a copy of the expert outputs),
2. the put kernel (Triton, ``num_blocks`` programs): every program takes work items (chunks or whole
   segments, from ``shmem_protocol.phase_layout``) and issues one ``nvshmemx_putmem_signal_nbi_block`` each,
   straight into the destination's receive buffer, then ``nvshmem_quiet``,
3. the wait kernel: one program per expected signal word, waiting until it reaches its expected value
   (``CMP_GE``), by default spinning with a timeout (a dead peer becomes CommError, not a hang),
4. combine only: the weighted reduction into token order (``index_add_``, as the all-to-all backends).

The layout (offsets, items, waits) comes from the exchanged counts. counts=host (default): an NCCL
all-gather, copied to the host and laid out there (a device-to-host sync inside the timed dispatch);
counts=device: the protocol's counts phase through the same kernels, the layout computed on the device
(``shmem.device_counts``), no host read, so the calls can be captured into a CUDA graph. ``setup`` also
compiles and loads both kernels (Triton's ``run(..., warmup=True)`` with the first launch's arguments, so
the launch finds them in Triton's cache; torch's post-compile hook initialises NVSHMEM in the loaded
module), under heartbeats, then the ranks meet: the first timed (or warm-up) call never
compiles. The variant ``vdev2d`` allocates only its own symmetric buffers, not the put heap.

Options (``--backend-option KEY=VALUE``, all in every result row through ``knobs``):
``num_blocks`` (programs = SMs used; default: all SMs), ``num_warps`` (threads per program / 32),
``chunk_bytes`` or ``chunk_rows``, ``signal`` (chunk | segment), ``signal_op`` (add | set),
``wait`` (spin | nvshmem), ``put`` (nbi | blocking), ``counts`` (host | device), ``variant`` (put |
vdev2d: torch's ``torch.ops.symm_mem.all_to_all_vdev_2d`` expert-major exchange as a reference, in
``shmem.vdev2d``).

Needs torch >= 2.9 (``shmem.symmetric`` says why and sets up the groups, the heap and its errors).

All GPU imports are lazy: on a machine without CUDA devices the constructor (and ``check_available``)
raises UsageError, which the CLI turns into a one-line message and exit code 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from commbench.backends.base import CombineReduction
from commbench.backends.options import MAX_BLOCKS, WARPS, BackendOption, PutSignalOptions, put_signal_options
from commbench.backends.shmem import protocol as proto
from commbench.backends.shmem import symmetric as symm
from commbench.backends.shmem.device_counts import DeviceLayout, graph_refusal
from commbench.backends.shmem.names import KERNELS
from commbench.backends.shmem.put_path import KERNEL_HINT, PutPath
from commbench.backends.shmem.vdev2d import Vdev2dExchange
from commbench.errors import CommError, UsageError
from commbench.run.heartbeats import beat_interval_s
from commbench.run.interface import Backend, ExchangeShape
from commbench.run.liveness import KeepAlive
from commbench.traffic.payload import poison_
from commbench.traffic.plan import RankPlan

# How long heartbeats cover one set-up step the main thread cannot beat in: NVSHMEM's start-up with the
# first symmetric allocation, and compiling and loading the Triton kernels (a cold cache links NVSHMEM's
# device bitcode: tens of seconds). Past it the step counts as hung (run.liveness.KeepAlive).
SETUP_STEP_BOUND_S = 600.0


class NvshmemBackend(PutPath, PutSignalOptions, Backend):
    name = "nvshmem"
    process_group = "nccl"  # one GPU per rank; NVSHMEM bootstraps over the group's store
    gpu_fabric = True
    one_sided = True
    kernel_patterns = KERNELS
    captures_graphs = True  # with counts=device: Triton kernel launches and torch ops on the current stream

    @classmethod
    def graph_refusal(cls, job_kind: str, options: Mapping[str, Any], calls: int) -> str:
        """Only counts=device, variant=put and an even N can be captured (``device_counts.graph_refusal``)."""
        return graph_refusal(cls.check_options(options), calls)

    @classmethod
    def check_available(cls) -> None:
        """UsageError (one line, exit 2) unless this host has CUDA devices and torch >= 2.9 with NVSHMEM."""
        symm.check_available()

    OPTIONS: ClassVar[tuple[BackendOption, ...]] = (
        BackendOption(
            "variant",
            str,
            "put",
            "put: these kernels; vdev2d: torch's all_to_all_vdev_2d",
            choices=("put", "vdev2d"),
        ),
        BackendOption("num_blocks", int, 0, "programs; 0 = one per SM", minimum=0, maximum=MAX_BLOCKS),
        BackendOption("num_warps", int, 16, "threads per program / 32", choices=WARPS, minimum=1, maximum=32),
        *put_signal_options(default_chunk_bytes=128 * 1024),
        BackendOption(
            "wait",
            str,
            "spin",
            "spin (timeout -> CommError) or nvshmem (signal_wait_until, no timeout)",
            choices=("spin", "nvshmem"),
        ),
        BackendOption("put", str, "nbi", "nbi or blocking put-with-signal", choices=("nbi", "blocking")),
    )

    def __init__(self, comm: Any, options: dict[str, Any] | None = None) -> None:
        super().__init__(comm, options)
        self.settings = self.check_options(self.options)
        self.num_blocks: int = self.settings["num_blocks"]
        self.num_warps: int = self.settings["num_warps"]
        self.chunk_rows: int | None = self.settings["chunk_rows"]
        self.chunk_bytes: int = self.settings["chunk_bytes"]
        self.variant = self.settings["variant"]
        self.device_counts = self.settings["counts"] == "device"
        self.check_available()
        self._bind_device()
        self._heap: torch.Tensor | None = None
        self._heap_bytes = 0
        self._reset()

    def _bind_device(self) -> None:
        comm = self.comm
        if comm.device.type != "cuda":
            raise UsageError(f"--backend nvshmem runs one rank per GPU, got device {comm.device}")
        group = comm.group if comm.group is not None else dist.group.WORLD
        if dist.get_world_size() != comm.world_size:
            raise UsageError(
                "--backend nvshmem runs on the whole job (NVSHMEM PEs = global ranks), not a subgroup"
            )
        self._group = group
        self._group_name = group.group_name
        # NVSHMEM bootstraps over the default group (torch 2.9/2.10 look its info up as group "0").
        self._world_group_name = dist.group.WORLD.group_name
        torch.cuda.set_device(comm.device)
        if self.num_blocks == 0:
            self.num_blocks = torch.cuda.get_device_properties(comm.device).multi_processor_count

    @property
    def label(self) -> str:
        return "nvshmem" if self.variant == "put" else "nvshmem vdev2d (torch)"

    def knobs(self) -> dict[str, Any]:
        dispatch = self._signals[0] if self._signals else None
        return {
            "variant": self.variant,
            "num_blocks": self.num_blocks,
            "num_warps": self.num_warps,
            "chunk_rows": dispatch.chunk_rows if dispatch else self.chunk_rows,
            "chunk_bytes": dispatch.chunk_rows * self._row_bytes if dispatch else self.chunk_bytes,
            "signal": self.settings["signal"],
            "signal_op": self.settings["signal_op"],
            "wait": self.settings["wait"],
            "put": self.settings["put"],
            "counts": self.settings["counts"],
        }

    @classmethod
    def symmetric_allocation_bytes(cls, shape: ExchangeShape) -> int:
        """The symmetric bytes one setup for ``shape`` allocates, the most over its variants and options
        (``symmetric.setup_symmetric_bytes``); ``setup`` sizes NVSHMEM_SYMMETRIC_SIZE from it."""
        return symm.setup_symmetric_bytes(shape)

    @classmethod
    def symmetric_memory_bytes(cls, shape: ExchangeShape) -> int:
        """GPU bytes per rank for ``shape`` (``symmetric.device_bytes``): the heap NVSHMEM reserves, at least
        what is allocated in it, and vdev2d's one ordinary buffer beside it."""
        return symm.device_bytes(shape)

    def _reset(self) -> None:
        self._signals: tuple[proto.SignalConfig, proto.SignalConfig] | None = None
        self._capacity: proto.Capacity | None = None
        self._layout: proto.HeapLayout | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._addr: dict[str, int] = {}
        self._phases: dict[str, proto.PhaseLayout] = {}
        self._device_tables: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._trackers: dict[str, proto.SignalTracker] = {}
        self._matrix_key: bytes | None = None
        self._errors: dict[str, torch.Tensor] = {}
        self._row_bytes = self._combine_row_bytes = 0
        self._reduce = CombineReduction()
        self._vdev: Vdev2dExchange | None = None
        self._slots = 0  # counts=device: count columns per destination (0: counts on the host)
        self._device: DeviceLayout | None = None  # counts=device: the tables laid out on the device
        # Kernels that compiled and launched once: later errors pass through unchanged.
        self._launched: set[str] = set()

    # ------------------------------------------------------------------------------------------------
    # Setup: NVSHMEM bootstrap through torch symmetric memory, worst-case heap, kernels.

    def setup(self, plan: RankPlan) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        matrix = self._gather_counts(plan.send_counts)
        self._signals = proto.phase_signal_configs(
            self.settings["signal"],
            self.settings["signal_op"],
            plan.dispatch_row_bytes,
            plan.combine_row_bytes,
            self.chunk_rows,
            self.chunk_bytes,
        )
        self._row_bytes = plan.dispatch_row_bytes
        self._combine_row_bytes = plan.combine_row_bytes
        # A previous setup's views and vdev buffers must not keep old symmetric memory alive (heap budget).
        self._views, self._addr, self._vdev = {}, {}, None
        self._capacity = proto.buffer_capacity(matrix)
        slots = int(plan.send_counts.shape[1])
        self._slots = slots if self.device_counts and self.variant == "put" else 0
        self._layout = proto.heap_layout(
            self._capacity,
            plan.dispatch_row_bytes,
            plan.combine_row_bytes,
            self._signals[0],
            self._signals[1],
            self.comm.world_size,
            self._slots,
        )
        # NVSHMEM's heap is sized from the same figure the launch's memory estimate counted.
        shape = ExchangeShape(
            proto.row_counts(matrix), plan.dispatch_row_bytes, plan.combine_row_bytes, slots
        )
        reserve = self.symmetric_allocation_bytes(shape)
        device, group, world_group = self.comm.device, self._group_name, self._world_group_name

        def symmetric(*dims: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
            return symm.allocate_symmetric(symm_mem, dims, dtype, device, group, world_group, reserve)

        with self._long_step("nvshmem start-up and symmetric allocation"):
            if self.variant == "vdev2d":  # its own buffers only: the put heap would be dead weight
                world = self.comm.world_size
                self._vdev = Vdev2dExchange(symmetric, plan, self._capacity, world, device, group)
            else:
                self._allocate(symm_mem, self._layout.nbytes, reserve)
                self._map_heap()
        # Nobody may signal into a word that a peer is still clearing.
        self._device_synchronize()
        self.comm.barrier()
        self._trackers = {
            phase: proto.SignalTracker(self.settings["signal_op"], self._layout[f"{phase}_signal"].shape[0])
            for phase in self._signalled
        }
        # Pinned: the wait kernel writes timeout flags there and the host reads them without a device copy.
        pinned = self.comm.device.type == "cuda"
        self._errors = {
            phase: torch.zeros(self._layout[f"{phase}_signal"].shape[0], dtype=torch.int32, pin_memory=pinned)
            for phase in self._signalled
        }
        self._matrix_key = None
        self._device_tables = {}
        self._use_matrix(matrix)
        if self._slots:  # counts=device: the fixed tables the kernels read, rewritten on the device
            self._device = DeviceLayout(
                self.comm.world_size, self.comm.rank, self._slots, self._capacity, self._signals, device
            )
            self._device.lay_out(torch.from_numpy(proto.row_counts(matrix)).to(device))
            self._phases["counts"] = self._device.counts
            self._device_tables = self._device.tables
        if self.variant == "put":
            self._put, self._wait = self._load_kernels()
            self._compile_kernels()

    def _map_heap(self) -> None:
        """The heap's regions as views and symmetric addresses; the signal words zeroed."""
        assert self._heap is not None and self._layout is not None
        base = self._heap.data_ptr()
        for name, region in self._layout.regions.items():
            raw = self._heap[region.offset : region.offset + region.nbytes]
            self._views[name] = raw.view(region.dtype).view(region.shape)
            self._addr[name] = base + region.offset
        for phase in self._signalled:
            self._views[f"{phase}_signal"].zero_()

    @contextlib.contextmanager
    def _long_step(self, step: str) -> Iterator[None]:
        """One set-up step that blocks the main thread for long: named in this rank's heartbeat (a peer's
        timeout says it is alive in it), with progress beats for at most SETUP_STEP_BOUND_S."""
        beats = KeepAlive(self.comm.heartbeat, beat_interval_s(self.comm.timeout_s), SETUP_STEP_BOUND_S)
        with self.comm.guard(step), beats:
            yield

    def _compile_kernels(self) -> None:
        """Compile and load both Triton kernels now, untimed (module docstring): each with the arguments of
        its first launch in either phase, so that launch is a cache hit (Triton's cache key is the arguments'
        types and specialisations plus the constexprs and options). Then the ranks meet: a rank compiling from
        a cold cache holds the others here, at most --timeout."""
        with self._long_step("nvshmem: compiling and loading the Triton kernels"):
            for phase in self._signalled:
                layout = self._phases[phase]
                epoch = self._trackers[phase].epoch + 1  # the phase's first launch
                row_bytes = self._phase_row_bytes(phase)
                launches = (
                    ("put", self._put, self._put_launch(phase, layout, row_bytes, epoch)),
                    ("wait", self._wait, self._wait_launch(phase, layout, epoch)),
                )
                for name, kernel, (grid, args, kwargs) in launches:
                    try:
                        # KernelInterface.warmup is run(..., warmup=True): older Tritons have it on
                        # JITFunction only, not on torch's requires_nvshmem wrapper; run() is on both.
                        kernel.run(*args, grid=grid, warmup=True, **kwargs)
                    except Exception as exc:  # noqa: BLE001 - one line, as a first launch's failure
                        self._kernel_failed(name, exc)
            self.comm.barrier()

    def _load_kernels(self) -> tuple[Any, Any]:
        try:
            from commbench.backends.shmem import kernels

            return kernels.launchers()
        except (ImportError, RuntimeError, OSError) as exc:  # no Triton; no bitcode (torch's finder)
            raise UsageError(f"--backend nvshmem: {symm.error_summary(exc)}; {KERNEL_HINT}") from None

    def _device_synchronize(self) -> None:
        if self.comm.device.type == "cuda":
            torch.cuda.synchronize(self.comm.device)

    def _allocate(self, symm_mem: Any, nbytes: int, reserve: int) -> None:
        """The put heap of ``nbytes`` (kept when the last one is large enough); ``reserve``: the setup's
        symmetric bytes, which NVSHMEM's heap is sized from when this allocation starts it."""
        if self._heap is not None and self._heap_bytes >= nbytes:
            return
        self._heap = None
        self._heap = symm.allocate_heap(
            symm_mem, nbytes, self.comm.device, self._group_name, self._world_group_name, reserve
        )
        self._heap_bytes = nbytes

    def _gather_counts(self, send_counts: torch.Tensor) -> np.ndarray:
        """Every rank's send counts [src, dst, slots] (all_gather on the job's process group)."""
        local = send_counts.detach().to(device=self.comm.device, dtype=torch.int64).contiguous()
        gathered = torch.empty((self.comm.world_size, *local.shape), dtype=torch.int64, device=local.device)
        with self.comm.guard("nvshmem count exchange"):
            dist.all_gather_into_tensor(gathered, local, group=self._group)
        return gathered.cpu().numpy()

    @property
    def _signalled(self) -> tuple[str, ...]:
        """The protocol phases with signal words in the heap: dispatch, combine (and counts=device's)."""
        return (*proto.PHASES, "counts") if self._slots else proto.PHASES

    def _phase_row_bytes(self, phase: str) -> int:
        if phase == "counts":
            return proto.count_row_bytes(self.comm.world_size, self._slots)
        return self._row_bytes if phase == "dispatch" else self._combine_row_bytes

    def _exchange_on_device(self, send_counts: torch.Tensor) -> torch.Tensor:
        """counts=device: the counts phase (this rank's row put into every PE's count slot, every source's
        waited for), then the phases laid out on the device from what arrived (``DeviceLayout``)."""
        assert self._device is not None
        self._views["counts_send"].view(torch.int64).view(-1).copy_(send_counts.reshape(-1))
        side = self._run_phase("counts", self._phases["counts"], self._phase_row_bytes("counts"))
        return self._device.receive(self._views["counts_recv"][side])

    def _use_matrix(self, matrix: np.ndarray) -> None:
        rows = proto.row_counts(matrix)
        key = rows.tobytes() + np.asarray(matrix).tobytes()
        if key == self._matrix_key:
            return
        assert self._capacity is not None and self._signals is not None
        if not self._capacity.covers(rows):
            raise UsageError("nvshmem: exchanged counts exceed the symmetric buffers sized at setup")
        device = self.comm.device
        rank = self.comm.rank
        self._phases = {
            "dispatch": proto.phase_layout(rows, rank, self._signals[0], self._capacity),
            "combine": proto.phase_layout(rows.T, rank, self._signals[1], self._capacity),
        }
        for phase, layout in self._phases.items():
            tracker = self._trackers[phase]
            # Expected value of wait w at epoch e: base[w] + increment[w] * (e - epoch0) (ADD), e (SET).
            base = tracker.totals[layout.wait_word]
            waits = np.stack([layout.wait_word, base, layout.wait_increment], axis=1).astype(np.int64)
            items = torch.from_numpy(layout.items_table()).to(device)
            self._device_tables[phase] = (items, torch.from_numpy(waits).to(device), tracker.epoch)
        self._matrix = np.asarray(matrix)
        self._matrix_key = key
        if self._vdev is not None:
            self._vdev.forget_order()

    # ------------------------------------------------------------------------------------------------
    # The backend contract.

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        if self._slots:
            return self._exchange_on_device(send_counts)
        matrix = self._gather_counts(send_counts)
        if self._capacity is not None:
            self._use_matrix(matrix)
        return torch.from_numpy(np.ascontiguousarray(matrix[:, self.comm.rank, :])).to(send_counts.device)

    def dispatch(self, tokens: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        layout = self._phases["dispatch"]
        if self._vdev is not None:
            with self.steps("payload transfer"):
                return self._vdev.dispatch(tokens, plan, layout, self._matrix[:, self.comm.rank, :])
        staging = self._views["dispatch_send"][: layout.send_rows]
        with self.steps("pack"):
            if plan.send_mode == "balanced":
                staging.copy_(tokens)
            else:
                torch.index_select(tokens, 0, plan.send_token_index, out=staging)
        side = self._run_phase("dispatch", layout, plan.dispatch_row_bytes)
        return self._views["dispatch_recv"][side][: layout.recv_rows]

    def combine(self, expert_out: torch.Tensor, plan: RankPlan, recv_counts: torch.Tensor) -> torch.Tensor:
        layout = self._phases["combine"]
        rows, hidden = int(expert_out.shape[0]), int(expert_out.shape[1])
        if rows != layout.send_rows or hidden * expert_out.element_size() != plan.combine_row_bytes:
            raise ValueError(
                f"combine got {rows} rows of {hidden * expert_out.element_size()} B, expected "
                f"{layout.send_rows} of {plan.combine_row_bytes}"
            )
        if self._vdev is not None:
            with self.steps("payload transfer"):
                returned = self._vdev.combine(expert_out, plan, recv_counts, layout)
        else:
            with self.steps("pack"):
                self._views["combine_send"][:rows].copy_(expert_out.contiguous().view(torch.uint8))
            side = self._run_phase("combine", layout, plan.combine_row_bytes)
            returned = self._views["combine_recv"][side][: layout.recv_rows].view(expert_out.dtype)
        with self.steps("weighted reduce"):
            return self._reduce(returned, plan.send_token_index, plan.combine_weight, plan.num_tokens)

    def poison_receive_buffers(self) -> None:
        # Both sides of each receive region, and the vdev2d variant's outputs (memsets; the harness syncs).
        views = [self._views.get(f"{phase}_recv") for phase in proto.PHASES]
        for buffer in [*views, *(self._vdev.receive_buffers() if self._vdev is not None else [])]:
            if buffer is not None:
                poison_(buffer)

    def synchronize(self) -> None:
        self._device_synchronize()
        for phase, flags in self._errors.items():
            if flags.any():  # pinned host memory the wait kernel wrote: no device round trip
                failed = np.flatnonzero(flags.numpy()[: self._phases[phase].wait_word.size])
                sources = sorted({int(s) for s in self._phases[phase].wait_source[failed]})
                flags.zero_()
                raise CommError(
                    f"nvshmem: rank {self.comm.rank} waited {self.comm.timeout_s:g} s in {phase} for the "
                    f"signals of rank(s) {', '.join(map(str, sources))}; a peer died or hung"
                )

    def close(self) -> None:
        if self._heap is not None or self._vdev is not None:
            self._device_synchronize()
        # Symmetric memory is freed collectively by torch when the last reference goes.
        self._heap = None
        self._heap_bytes = 0
        self._reset()

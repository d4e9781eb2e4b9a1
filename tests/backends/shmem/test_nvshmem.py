"""The NVSHMEM backend: a clean refusal on CPU machines, and (with a GPU) one-PE runs with verification."""

from __future__ import annotations

import ast
import contextlib
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from commbench.backends import get_backend
from commbench.backends.shmem.nvshmem import NvshmemBackend
from commbench.cli import cli
from commbench.errors import UsageError
from tests.run.capture import capture_guard, device_work

HAS_GPU = torch.cuda.device_count() > 0
cpu_only = pytest.mark.skipif(HAS_GPU, reason="checks the refusal on machines without CUDA devices")
gpu_only = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")


def fake_comm() -> SimpleNamespace:
    return SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), timeout_s=1.0, group=None)


def test_registry_and_lazy_gpu_imports() -> None:
    assert get_backend("nvshmem") is NvshmemBackend
    # The Triton kernel module loads only when a backend is set up on a GPU, never at import.
    if not HAS_GPU:
        assert "commbench.backends.shmem.kernels" not in sys.modules


def test_bad_options_are_usage_errors_before_any_device_work() -> None:
    with pytest.raises(UsageError, match="no option"):
        NvshmemBackend(fake_comm(), {"blocks": 4})
    with pytest.raises(UsageError, match="variant"):
        NvshmemBackend(fake_comm(), {"variant": "magic"})
    with pytest.raises(UsageError, match="num_blocks"):
        NvshmemBackend(fake_comm(), {"num_blocks": -1})


@cpu_only
def test_check_available_names_gpus_and_nvshmem() -> None:
    with pytest.raises(UsageError, match="needs CUDA GPUs and NVSHMEM") as info:
        NvshmemBackend.check_available()
    assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="needs CUDA GPUs and NVSHMEM"):
        NvshmemBackend(fake_comm(), {})


@cpu_only
def test_cli_backend_nvshmem_on_cpu_is_one_line_exit_2() -> None:
    result = CliRunner().invoke(cli, ["run", "--backend", "nvshmem", "--world-size", "1", "--tokens", "8"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "nvshmem" in lines[0] and "error" in lines[0]


@pytest.mark.parametrize("version", ["2.8.0+cu128", "2.7.1+cu126", "2.4.0"])
def test_torch_before_2_9_is_refused_in_one_line_naming_both_versions(monkeypatch, version: str) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(UsageError) as info:
        NvshmemBackend.check_available()
    message = str(info.value)
    assert "\n" not in message and f"found torch {version}" in message and "needs torch >= 2.9" in message


def test_cli_refuses_old_torch_before_launch_exit_2(monkeypatch) -> None:
    # A GPU host as the pre-launch checks see it (device count, memory per device), torch 2.8.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = SimpleNamespace(total_memory=141 << 30, name="GPU", multi_processor_count=132, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: gpu)
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu128")
    result = CliRunner().invoke(cli, ["run", "--backend", "nvshmem", "--world-size", "1", "--tokens", "8"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs torch >= 2.9" in lines[0] and "2.8.0+cu128" in lines[0]


# ----------------------------------------------------------------------------------------------------------
# GPU: one PE putting to itself (the lent H200 runs these; benchmarks/gpu_check.sh covers more).


def _one_pe_entry(comm, options: dict, send_mode: str, graph_calls: int = 0) -> list[dict]:
    from commbench.backends.shmem.nvshmem import NvshmemBackend
    from commbench.inputs.models import ModelConfig
    from commbench.inputs.skew import parse_skew
    from commbench.run.config import RunOptions
    from commbench.run.harness import run_jobs
    from commbench.run.jobs import MoeJob
    from commbench.traffic.routing import RoutingConfig

    # 16 experts: torch's all_to_all_vdev_2d (variant=vdev2d) takes at most 16 per rank.
    model = ModelConfig(name="small", hidden=1024, num_experts=16, topk=4, dispatch_dtype="fp8")
    cfg = RoutingConfig(model=model, skew=parse_skew("zipf:1.2"), world_size=1, tokens_per_rank=512, seed=2)
    timing = "graph" if graph_calls else "iteration"
    job = MoeJob("small", cfg, send_mode, warmup=2, iters=3, timing=timing, graph_calls=graph_calls)
    rows, _ = run_jobs(comm, [job], RunOptions("nvshmem", options, timeout_s=30.0), NvshmemBackend)
    return rows


@gpu_only
def test_gpu_machine_passes_the_torch_gate_and_finds_the_device_bitcode() -> None:
    from commbench.backends.shmem import bitcode

    NvshmemBackend.check_available()  # torch >= 2.9 with NVSHMEM
    found = os.environ.get("NVSHMEM_LIB_DIR") or bitcode.find_device_bitcode(bitcode.candidate_dirs())
    assert found, f"no NVSHMEM device bitcode in {bitcode.candidate_dirs()}"


@gpu_only
@pytest.mark.parametrize(
    ("options", "send_mode"),
    [
        ({}, "token"),
        ({"signal": "segment", "signal_op": "set", "wait": "nvshmem"}, "selection"),
        ({"chunk_rows": 3, "num_blocks": 4, "put": "blocking"}, "token"),
        ({"variant": "vdev2d"}, "selection"),
        ({"counts": "device"}, "token"),
        ({"counts": "device", "chunk_rows": 3}, "selection"),
    ],
)
def test_one_pe_dispatch_and_combine_verified(options: dict, send_mode: str) -> None:
    from commbench.run import dist

    rows = dist.launch(1, _one_pe_entry, (options, send_mode), process_group="nccl", timeout_s=60.0)
    assert [r["phase"] for r in rows] == ["dispatch", "combine"]
    assert all(r["wrong"] == 0 and not r["emulated"] for r in rows)
    assert all(r["variant"] == options.get("variant", "put") for r in rows)


# ----------------------------------------------------------------------------------------------------------
# CPU: the GPU backend's host side (layout tables, addresses, parity, epochs, expected signal values, the
# combine reduction) with the two Triton kernels replaced by Python versions of what they do on one PE.


def _do_not_specialize() -> dict[str, tuple[int, ...]]:
    """Each Triton kernel's ``do_not_specialize`` argument positions, from its ``@triton.jit(...)`` in
    shmem/kernels.py (which imports Triton, absent on CPU machines: its source is read instead)."""
    import commbench.backends.shmem as package

    tree = ast.parse((Path(package.__file__).parent / "kernels.py").read_text())
    found = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "jit":
                names = [a.arg for a in node.args.args]
                for keyword in decorator.keywords:
                    if keyword.arg == "do_not_specialize":
                        listed = {element.value for element in keyword.value.elts}  # type: ignore[attr-defined]
                        found[node.name] = tuple(i for i, name in enumerate(names) if name in listed)
    return found


DO_NOT_SPECIALIZE = _do_not_specialize()


class FakeTritonKernel:
    """A Triton kernel as torch's ``requires_nvshmem`` hands it out, with Triton's compile cache.

    Contract: torch/distributed/_symmetric_memory/_nvshmem_triton.py returns
    ``GridCallableWithExtern(KernelInterface)``, whose ``run(*args, **kwargs)`` calls
    ``self.jit_func.run(*args, **kwargs, extern_libs=self.extern_libs)``. triton/runtime/jit.py (3.4):
    ``KernelInterface.__getitem__(grid)`` is ``lambda *args, **kwargs: self.run(grid=grid, warmup=False,
    *args, **kwargs)`` and has no ``warmup`` (only ``JITFunction.warmup`` does, in that release, so this fake
    has none either); ``JITFunction.run(*args, grid, warmup, **kwargs)`` keys its cache by
    ``str(specialization) + str(options)`` (each argument's type: a pointer and its 16-byte alignment, an
    int as i32 / i64 / u64 by value, and unless it is in ``do_not_specialize`` whether it is 1 or a multiple
    of 16; the constexpr and option keywords), compiles on a miss (``_do_compile(..., warmup)``, which calls
    ``jit_post_compile_hook``, torch's NVSHMEM module init) and launches only ``if not warmup``."""

    name = ""

    def __init__(self) -> None:
        self.dns = DO_NOT_SPECIALIZE[self.name]
        self.compiled: set[str] = set()
        self.compiled_at_launch = 0  # launches that had to compile first (inside a timed region)
        self.launches = 0
        self.on_compile: Any = None  # called while "compiling"

    def key(self, args: tuple, kwargs: dict) -> str:
        parts: list[tuple] = []
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                parts.append((f"*{arg.dtype}", arg.data_ptr() % 16 == 0))
            elif isinstance(arg, bool):
                parts.append(("i1",))
            else:
                value = int(arg)
                kind = "i32" if -(2**31) <= value < 2**31 else "i64" if value < 2**63 else "u64"
                parts.append((kind,) if i in self.dns else (kind, value == 1, value % 16 == 0))
        return str(parts) + str(sorted(kwargs.items()))

    def __getitem__(self, grid: tuple[int]) -> Any:
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args: Any, grid: tuple[int], warmup: bool, **kwargs: Any) -> None:
        with device_work():  # this Python is what the GPU runs: its host reads are the device's
            self._run(*args, grid=grid, warmup=warmup, **kwargs)

    def _run(self, *args: Any, grid: tuple[int], warmup: bool, **kwargs: Any) -> None:
        key = self.key(args, kwargs)
        if key not in self.compiled:
            if self.on_compile is not None:
                self.on_compile()
            self.compiled.add(key)
            self.compiled_at_launch += not warmup
        if not warmup:
            self.launches += 1
            self.execute(grid, *args, **kwargs)

    def execute(self, grid: tuple[int], *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError


class FakePut(FakeTritonKernel):
    """commbench_put_items on one PE: copy each item's rows inside the heap, then its signal op."""

    name = "commbench_put_items"

    def __init__(self, heap: torch.Tensor, drop: bool = False) -> None:
        super().__init__()
        self.heap, self.drop = heap, drop

    def execute(
        self, grid, items, send_addr, recv_addr, sig_addr, num_items, row_bytes, sig_value, sig_op, **_
    ):
        base = self.heap.data_ptr()
        assert items.shape == (num_items, 5) and 1 <= grid[0] <= num_items
        for pe, src_row, dst_row, rows, word in items.tolist():
            assert pe == 0
            if self.drop or rows < 0:  # rows -1: counts=device's grid past a segment (the kernel skips it)
                continue
            src = send_addr - base + src_row * row_bytes
            dst = recv_addr - base + dst_row * row_bytes
            self.heap[dst : dst + rows * row_bytes] = self.heap[src : src + rows * row_bytes].clone()
            offset = sig_addr - base + word * 8
            signal = self.heap[offset : offset + 8].view(torch.int64)
            signal.copy_(signal + sig_value if sig_op == 10 else torch.full_like(signal, sig_value))


class FakeWait(FakeTritonKernel):
    """commbench_wait_signals without waiting: flags every word short of its expected value."""

    name = "commbench_wait_signals"

    def __init__(self, heap: torch.Tensor, flags: dict) -> None:
        super().__init__()
        self.heap, self.flags = heap, flags

    def execute(self, grid, waits, sig_addr, epoch_delta, epoch, timeout_ns, err_addr, USE_SET, SPIN, **_):  # noqa: N803
        words = self.heap[sig_addr - self.heap.data_ptr() :].view(torch.int64)
        table = waits.tolist()
        assert len(table) == grid[0] and timeout_ns > 0
        for i, (word, base, increment) in enumerate(table):
            expected = epoch if USE_SET else base + increment * epoch_delta
            if int(words[word]) < expected:
                self.flags[err_addr][i] = 1


class FakeComm:
    """One rank's Comm for the host-side tests: collectives do nothing; operations and beats recorded."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        self.device, self.timeout_s, self.group = torch.device("cpu"), 1.0, None
        self.operations: list[str] = []
        self.beats = 0

    @contextlib.contextmanager
    def guard(self, operation: str):
        self.operations.append(operation)
        yield

    def heartbeat(self) -> None:
        self.beats += 1

    def barrier(self) -> None:
        pass


def host_side_backend(
    monkeypatch, options: dict, drop: bool = False, world: int = 1, rank: int = 0, matrix=None
) -> NvshmemBackend:
    """The backend with a CPU tensor as its heap and the fake kernels; ``matrix``: every rank's send counts
    [src, dst, slots] (one rank's own by default). ``backend.allocations``: (heap bytes, reserve) of each
    heap allocation."""
    allocations: list[tuple[int, int]] = []

    def allocate(self, symm_mem, nbytes, reserve):  # a CPU tensor stands in for the symmetric heap
        allocations.append((nbytes, reserve))
        self._heap = torch.zeros(nbytes + 4096, dtype=torch.uint8)
        self._heap_bytes = nbytes

    def load_kernels(self):
        flags = {tensor.data_ptr(): tensor for tensor in self._errors.values()}
        return FakePut(self._heap, drop), FakeWait(self._heap, flags)

    monkeypatch.setattr(NvshmemBackend, "check_available", classmethod(lambda cls: None))

    def bind_device(self):  # the default group's name, as on a one-rank job
        self._group_name = self._world_group_name = "0"

    def gather_counts(self, counts):
        return counts.numpy()[None].copy() if matrix is None else np.asarray(matrix).copy()

    monkeypatch.setattr(NvshmemBackend, "_bind_device", bind_device)
    monkeypatch.setattr(NvshmemBackend, "_allocate", allocate)
    monkeypatch.setattr(NvshmemBackend, "_load_kernels", load_kernels)
    monkeypatch.setattr(NvshmemBackend, "_gather_counts", gather_counts)
    backend = NvshmemBackend(FakeComm(rank, world), {"num_blocks": 4, **options})
    backend.allocations = allocations  # type: ignore[attr-defined]
    return backend


@pytest.mark.parametrize(
    ("options", "send_mode", "captured"),
    [
        ({}, "token", False),
        ({"chunk_rows": 3, "signal_op": "set"}, "selection", False),
        ({"signal": "segment"}, "selection", False),
        ({"counts": "device"}, "token", True),
        ({"counts": "device", "chunk_rows": 3}, "selection", True),
        ({"counts": "device", "signal": "segment"}, "selection", True),
    ],
)
def test_host_side_over_iterations_with_python_kernels(
    monkeypatch, options: dict, send_mode: str, captured: bool
) -> None:
    """``captured``: counts=device's exchange, dispatch and combine run inside the fake CUDA graph capture
    (tests/run/capture.py: no host read of a device value, no host-to-device copy; the Python kernels'
    own reads are the GPU's), as a graph would capture them."""
    import torch.distributed._symmetric_memory  # noqa: F401 - setup imports it (CPU builds ship it)

    from commbench.inputs.models import ModelConfig
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.payload import (
        count_wrong_combine,
        count_wrong_rows,
        decode_header,
        encode_rows,
        expected_combine,
        expected_rows,
        expert_outputs,
        received_keys,
    )
    from commbench.traffic.plan import plan_rank
    from commbench.traffic.routing import RoutingConfig, route_rank

    model = ModelConfig(name="small", hidden=32, num_experts=8, topk=3, dispatch_dtype="fp8", scale_block=16)
    cfg = RoutingConfig(model=model, skew=parse_skew("zipf:1.3"), world_size=1, tokens_per_rank=40, seed=4)
    plan = plan_rank(route_rank(cfg, 0), model, 1, send_mode)
    backend = host_side_backend(monkeypatch, options)
    backend.setup(plan)
    # Both kernels compiled in setup, none launched: the first timed call finds them in Triton's cache.
    assert backend._put.compiled and backend._wait.compiled
    assert backend._put.launches == backend._wait.launches == 0
    tokens = encode_rows(0, torch.arange(plan.num_tokens), plan.dispatch_row_bytes)
    reference, tolerance = expected_combine(plan, model.hidden)
    capture = capture_guard if captured else contextlib.nullcontext
    for _ in range(3):  # epochs 1..3: both receive buffers, running signal totals / epochs
        with capture():
            counts = backend.exchange_counts(plan.send_counts)
            received = backend.dispatch(tokens, plan, counts)
        backend.synchronize()
        assert count_wrong_rows(received, expected_rows([plan], 0)) == 0
        src, token = decode_header(received)
        expert_out = expert_outputs(src, token, received_keys(counts, 0, send_mode), model.hidden)
        with capture():
            combined = backend.combine(expert_out, plan, counts)
        backend.synchronize()
        assert count_wrong_combine(combined, reference, tolerance) == 0
    assert backend._put.launches == (9 if captured else 6)  # counts=device: the counts phase's puts too
    assert backend._put.compiled_at_launch == backend._wait.compiled_at_launch == 0
    knobs = backend.knobs()
    assert knobs["counts"] == options.get("counts", "host")
    assert knobs["num_blocks"] == 4 and knobs["chunk_bytes"] == knobs["chunk_rows"] * plan.dispatch_row_bytes
    backend.close()


def test_host_side_missing_signals_become_comm_error(monkeypatch) -> None:
    import torch.distributed._symmetric_memory  # noqa: F401

    from commbench.errors import CommError
    from commbench.inputs.models import ModelConfig
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.payload import encode_rows
    from commbench.traffic.plan import plan_rank
    from commbench.traffic.routing import RoutingConfig, route_rank

    model = ModelConfig(name="small", hidden=32, num_experts=8, topk=3, dispatch_dtype="fp8", scale_block=16)
    cfg = RoutingConfig(model=model, skew=parse_skew("uniform"), world_size=1, tokens_per_rank=16, seed=0)
    plan = plan_rank(route_rank(cfg, 0), model, 1, "token")
    backend = host_side_backend(monkeypatch, {}, drop=True)
    backend.setup(plan)
    counts = backend.exchange_counts(plan.send_counts)
    backend.dispatch(encode_rows(0, torch.arange(plan.num_tokens), plan.dispatch_row_bytes), plan, counts)
    with pytest.raises(CommError, match=r"in dispatch for the signals of rank\(s\) 0"):
        backend.synchronize()


def _small_selection_plan(num_experts: int):
    from commbench.inputs.models import ModelConfig
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.plan import plan_rank
    from commbench.traffic.routing import RoutingConfig, route_rank

    model = ModelConfig(
        name="small", hidden=32, num_experts=num_experts, topk=3, dispatch_dtype="fp8", scale_block=16
    )
    cfg = RoutingConfig(model=model, skew=parse_skew("uniform"), world_size=1, tokens_per_rank=16, seed=0)
    return plan_rank(route_rank(cfg, 0), model, 1, "selection")


def test_vdev2d_beyond_torch_tile_limits_is_a_usage_error(monkeypatch) -> None:
    import torch.distributed._symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem

    # 32 experts on one rank: torch's all_to_all_vdev_2d would fail its TORCH_CHECK (<= 16 per rank).
    backend = host_side_backend(monkeypatch, {"variant": "vdev2d"})
    with pytest.raises(UsageError, match="at most 16 experts per rank") as info:
        backend.setup(_small_selection_plan(32))
    assert "\n" not in str(info.value)


def test_first_kernel_failure_is_one_line_later_ones_pass_through(monkeypatch) -> None:
    import torch.distributed._symmetric_memory  # noqa: F401

    from commbench.traffic.payload import encode_rows

    plan = _small_selection_plan(8)
    backend = host_side_backend(monkeypatch, {})
    backend.setup(plan)
    tokens = encode_rows(0, torch.arange(plan.num_tokens), plan.dispatch_row_bytes)
    working = backend._put

    class Broken:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise RuntimeError(
                    "at 12:8:\n    _quiet()\n    ^\nLLVM ERROR: cannot link libnvshmem_device.bc"
                )

            return run

    backend._put = Broken()
    counts = backend.exchange_counts(plan.send_counts)
    with pytest.raises(UsageError, match="put kernel failed to build or launch.*cannot link") as info:
        backend.dispatch(tokens, plan, counts)
    assert "\n" not in str(info.value)
    backend._put = working  # compiles and launches: from now on a failure is a run-time fault, raised as is
    backend.dispatch(tokens, plan, counts)
    backend._put = Broken()
    with pytest.raises(RuntimeError, match="LLVM ERROR"):
        backend.dispatch(tokens, plan, counts)


def test_the_kernels_compile_in_setup_under_heartbeats(monkeypatch) -> None:
    """A compile that takes a while (a cold Triton cache) runs in setup, named in this rank's heartbeat and
    with progress beats all along: the launcher's hang bound does not call it a hang."""
    import torch.distributed._symmetric_memory  # noqa: F401

    backend = host_side_backend(monkeypatch, {})
    comm = backend.comm
    seen: list[int] = []

    def slow_compile() -> None:  # returns once three beats came in while "compiling" (a timeout fails)
        start = comm.beats
        deadline = time.monotonic() + 30
        while comm.beats < start + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen.append(comm.beats - start)

    real_load = NvshmemBackend._load_kernels

    def load_slow_kernels(self):
        put, wait = real_load(self)
        put.on_compile = slow_compile
        return put, wait

    monkeypatch.setattr(NvshmemBackend, "_load_kernels", load_slow_kernels)
    backend.setup(_small_selection_plan(8))
    assert seen and all(beats >= 3 for beats in seen)
    assert "nvshmem: compiling and loading the Triton kernels" in comm.operations


def test_a_kernel_that_fails_to_compile_in_setup_is_one_line(monkeypatch) -> None:
    import torch.distributed._symmetric_memory  # noqa: F401

    backend = host_side_backend(monkeypatch, {})
    real_load = NvshmemBackend._load_kernels

    def load_broken(self):
        put, wait = real_load(self)

        def broken() -> None:
            raise RuntimeError("at 12:8:\n    _quiet()\n    ^\nLLVM ERROR: cannot link libnvshmem_device.bc")

        wait.on_compile = broken
        return put, wait

    monkeypatch.setattr(NvshmemBackend, "_load_kernels", load_broken)
    with pytest.raises(UsageError, match="wait kernel failed to build or launch.*cannot link") as info:
        backend.setup(_small_selection_plan(8))
    assert "\n" not in str(info.value)


def _skewed_world(world: int, mode: str):
    """A hot-expert MoE job on ``world`` ranks: every rank's plan, and the [src, dst, slots] counts."""
    from commbench.inputs.models import ModelConfig
    from commbench.inputs.skew import parse_skew
    from commbench.run.jobs import MoeJob
    from commbench.traffic.plan import plan_rank
    from commbench.traffic.routing import RoutingConfig, route_rank

    model = ModelConfig(name="small", hidden=64, num_experts=16, topk=4, dispatch_dtype="fp8", scale_block=32)
    cfg = RoutingConfig(
        model=model, skew=parse_skew("hot:2:0.45"), world_size=world, tokens_per_rank=64, seed=3
    )
    plans = [plan_rank(route_rank(cfg, src), model, world, mode) for src in range(world)]
    counts = np.stack([plan.send_counts.numpy() for plan in plans])
    return MoeJob(name="small hot", routing=cfg, send_mode=mode), plans, counts


@pytest.mark.parametrize("options", [{}, {"chunk_rows": 1, "signal_op": "set"}])
def test_the_put_heap_is_sized_with_the_launch_estimates_function(monkeypatch, options: dict) -> None:
    """Every rank's setup for a skewed pattern: the heap it allocates and the symmetric bytes it sizes
    NVSHMEM_SYMMETRIC_SIZE from come from the function the launch's memory estimate calls, and stay within
    that estimate (tests/cli/test_resources.py does the same for shmem-emu's heap on real ranks)."""
    import torch.distributed._symmetric_memory  # noqa: F401

    from commbench.backends.shmem import symmetric as symm
    from commbench.cli.resources import job_memory
    from commbench.run.interface import ExchangeShape

    world = 4
    job, plans, counts = _skewed_world(world, "selection")
    estimate = job_memory(job, world, False, NvshmemBackend)
    shape = ExchangeShape(counts.sum(axis=2), plans[0].dispatch_row_bytes, plans[0].combine_row_bytes, 4)
    for rank in range(world):
        backend = host_side_backend(monkeypatch, options, world=world, rank=rank, matrix=counts)
        backend.setup(plans[rank])
        ((heap, reserve),) = backend.allocations
        assert reserve == NvshmemBackend.symmetric_allocation_bytes(shape)
        assert heap + symm.ALLOCATION_OVERHEAD_BYTES <= reserve
        assert max(symm.symmetric_size(reserve), reserve) <= estimate.symmetric
        backend.close()


def test_vdev2d_allocates_only_its_own_buffers_within_the_estimate(monkeypatch) -> None:
    """variant=vdev2d allocates no put heap: only its symmetric tensors, every one sized from the setup's
    symmetric bytes, which the launch's estimate counts."""
    import torch.distributed._symmetric_memory  # noqa: F401

    from commbench.backends.shmem import symmetric as symm
    from commbench.cli.resources import job_memory

    world = 4
    job, plans, counts = _skewed_world(world, "selection")
    tensors: list[tuple[int, int]] = []

    def allocate_symmetric(symm_mem, dims, dtype, device, group, world_group, reserve):
        tensor = torch.zeros(*(max(1, n) for n in dims), dtype=dtype)
        tensors.append((tensor.numel() * tensor.element_size(), reserve))
        return tensor

    monkeypatch.setattr(symm, "allocate_symmetric", allocate_symmetric)
    backend = host_side_backend(monkeypatch, {"variant": "vdev2d"}, world=world, rank=0, matrix=counts)
    backend.setup(plans[0])
    assert backend.allocations == []  # no put heap
    assert len(tensors) == 8 and len({reserve for _, reserve in tensors}) == 1
    reserve = tensors[0][1]
    assert sum(nbytes + symm.ALLOCATION_OVERHEAD_BYTES for nbytes, _ in tensors) <= reserve
    assert reserve <= job_memory(job, world, False, NvshmemBackend).symmetric


def test_host_side_counts_on_the_host_cannot_be_captured(monkeypatch) -> None:
    """counts=host reads the all-gathered counts on the host each call (here the fake all-gather's
    ``.numpy()``; on a GPU ``.cpu()``): refused inside a capture, which is why graph_refusal asks for
    counts=device."""
    import torch.distributed._symmetric_memory  # noqa: F401

    from tests.run.capture import CaptureUnsupported

    plan = _small_selection_plan(8)
    backend = host_side_backend(monkeypatch, {})
    backend.setup(plan)
    with capture_guard(), pytest.raises(CaptureUnsupported):
        backend.exchange_counts(plan.send_counts)


@gpu_only
@pytest.mark.parametrize("send_mode", ["token", "selection"])
def test_one_pe_cuda_graph_of_device_counts_verified(send_mode: str) -> None:
    """--cuda-graph on a real GPU: counts=device's exchange, dispatch and combine captured by
    torch.cuda.graph (torch's own capture checks, not the fake's), replayed, the last replay verified."""
    from commbench.run import dist

    options = {"counts": "device"}
    rows = dist.launch(1, _one_pe_entry, (options, send_mode, 4), process_group="nccl", timeout_s=120.0)
    assert [(r["phase"], r["timing"], r["graph_calls"], r["wrong"]) for r in rows] == [
        ("dispatch", "graph", 4, 0),
        ("combine", "graph", 4, 0),
    ]
    assert all(r["counts"] == "device" and r["time_us_min"] > 0 for r in rows)

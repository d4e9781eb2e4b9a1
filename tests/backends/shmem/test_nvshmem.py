"""The NVSHMEM backend: a clean refusal on CPU machines, and (with a GPU) one-PE runs with verification."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from commbench.backends import get_backend
from commbench.backends.shmem.nvshmem import NvshmemBackend
from commbench.cli import cli
from commbench.errors import UsageError

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


def _one_pe_entry(comm, options: dict, send_mode: str) -> list[dict]:
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
    job = MoeJob(name="small", routing=cfg, send_mode=send_mode, warmup=2, iters=3)
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


class FakePut:
    """commbench_put_items on one PE: copy each item's rows inside the heap, then its signal op."""

    def __init__(self, heap: torch.Tensor, drop: bool = False) -> None:
        self.heap, self.drop, self.launches = heap, drop, 0

    def __getitem__(self, grid: tuple[int]):
        def run(items, send_addr, recv_addr, sig_addr, num_items, row_bytes, sig_value, sig_op, **_):
            self.launches += 1
            base = self.heap.data_ptr()
            assert items.shape == (num_items, 5) and 1 <= grid[0] <= num_items
            for pe, src_row, dst_row, rows, word in items.tolist():
                assert pe == 0
                if self.drop:
                    continue
                src = send_addr - base + src_row * row_bytes
                dst = recv_addr - base + dst_row * row_bytes
                self.heap[dst : dst + rows * row_bytes] = self.heap[src : src + rows * row_bytes].clone()
                offset = sig_addr - base + word * 8
                signal = self.heap[offset : offset + 8].view(torch.int64)
                signal.copy_(signal + sig_value if sig_op == 10 else torch.full_like(signal, sig_value))

        return run


class FakeWait:
    """commbench_wait_signals without waiting: flags every word short of its expected value."""

    def __init__(self, heap: torch.Tensor, flags: dict) -> None:
        self.heap, self.flags = heap, flags

    def __getitem__(self, grid: tuple[int]):
        def run(waits, sig_addr, epoch_delta, epoch, timeout_ns, err_addr, USE_SET, SPIN, **_):  # noqa: N803
            words = self.heap[sig_addr - self.heap.data_ptr() :].view(torch.int64)
            table = waits.tolist()
            assert len(table) == grid[0] and timeout_ns > 0
            for i, (word, base, increment) in enumerate(table):
                expected = epoch if USE_SET else base + increment * epoch_delta
                if int(words[word]) < expected:
                    self.flags[err_addr][i] = 1

        return run


def host_side_backend(monkeypatch, options: dict, drop: bool = False) -> NvshmemBackend:
    def allocate(self, symm_mem, nbytes):  # a CPU tensor stands in for the symmetric heap
        self._heap = torch.zeros(nbytes + 4096, dtype=torch.uint8)
        self._heap_bytes = nbytes

    def load_kernels(self):
        flags = {tensor.data_ptr(): tensor for tensor in self._errors.values()}
        return FakePut(self._heap, drop), FakeWait(self._heap, flags)

    monkeypatch.setattr(NvshmemBackend, "check_available", classmethod(lambda cls: None))

    def bind_device(self):  # the default group's name, as on a one-rank job
        self._group_name = self._world_group_name = "0"

    monkeypatch.setattr(NvshmemBackend, "_bind_device", bind_device)
    monkeypatch.setattr(NvshmemBackend, "_allocate", allocate)
    monkeypatch.setattr(NvshmemBackend, "_load_kernels", load_kernels)
    monkeypatch.setattr(NvshmemBackend, "_gather_counts", lambda self, counts: counts.numpy()[None].copy())
    comm = SimpleNamespace(**vars(fake_comm()), barrier=lambda: None)
    return NvshmemBackend(comm, {"num_blocks": 4, **options})


@pytest.mark.parametrize(
    ("options", "send_mode"),
    [
        ({}, "token"),
        ({"chunk_rows": 3, "signal_op": "set"}, "selection"),
        ({"signal": "segment"}, "selection"),
    ],
)
def test_host_side_over_iterations_with_python_kernels(monkeypatch, options: dict, send_mode: str) -> None:
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
    tokens = encode_rows(0, torch.arange(plan.num_tokens), plan.dispatch_row_bytes)
    reference, tolerance = expected_combine(plan, model.hidden)
    for _ in range(3):  # epochs 1..3: both receive buffers, running signal totals / epochs
        counts = backend.exchange_counts(plan.send_counts)
        received = backend.dispatch(tokens, plan, counts)
        backend.synchronize()
        assert count_wrong_rows(received, expected_rows([plan], 0)) == 0
        src, token = decode_header(received)
        expert_out = expert_outputs(src, token, received_keys(counts, 0, send_mode), model.hidden)
        combined = backend.combine(expert_out, plan, counts)
        backend.synchronize()
        assert count_wrong_combine(combined, reference, tolerance) == 0
    assert backend._put.launches == 6
    knobs = backend.knobs()
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

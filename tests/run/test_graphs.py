"""CUDA graph timing (``--cuda-graph N``, run.graphs): the options and backends it is refused for, torch's
capture rules enforced by a fake CUDA graph, and a gloo launch whose backend is marked capturable so that
the harness's graph path (capture, poison, replays, verification of the last replay) runs on CPU.

The fake enforces what a real capture refuses:

- capture on the legacy default stream: pytorch aten/src/ATen/cuda/CUDAGraph.cpp, ``CUDAGraph::capture_begin``
  (``TORCH_CHECK(stream != at::cuda::getDefaultCUDAStream(), "CUDA graphs must be captured on a non-default
  stream. ...")``); torch.cuda.graph makes its side stream current first (torch/cuda/graphs.py:437-466,
  torch 2.13: ``torch.cuda.synchronize()``, ``self.stream_ctx.__enter__()``, ``capture_begin``);
- warm-up before capture on a side stream (torch/cuda/graphs.py:643-647, ``make_graphed_callables``:
  synchronize, then the warm-up iterations under ``torch.cuda.stream(torch.cuda.Stream())``);
- no host synchronisation inside a capture: a device value read on the host (``.item()``, ``.tolist()``,
  ``.cpu()``, ``.numpy()``, ``bool(tensor)``, ``nonzero``), ``torch.cuda.synchronize`` and a copy of host
  data to the device (``torch.tensor``, ``torch.from_numpy``, ``torch.as_tensor``: a pageable H2D copy)
  fail the capture with cudaErrorStreamCaptureUnsupported, "operation not permitted when stream is
  capturing" (torch/cuda/__init__.py:1309-1320, ``set_sync_debug_mode`` lists such synchronizing ops).

Kinder than a real graph (said here, proven only on a GPU): the fake's replay re-runs the captured calls'
host code, where a real replay runs their device work alone; host state a call changes would be frozen at
the capture's values on a GPU (why the NVSHMEM backend keeps its signal totals on the device and takes an
even N). ``test_a_replay_that_writes_nothing_is_caught`` covers the other side: a replay that moves nothing
leaves the poison, which the check finds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from commbench.backends import BACKENDS, get_backend
from commbench.backends.shmem import protocol as proto
from commbench.backends.shmem.device_counts import DeviceLayout
from commbench.backends.shmem.nvshmem import NvshmemBackend
from commbench.backends.torchdist import GlooBackend, NcclBackend
from commbench.errors import UsageError
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import parse_skew
from commbench.run import graphs
from commbench.run.config import InjectedDelay, RunConfig, RunOptions
from commbench.run.jobs import BalancedJob, MoeJob
from commbench.traffic.routing import RoutingConfig
from tests.run.capture import CAPTURE_ERROR, CaptureUnsupported, FakeGraphs, capture_guard

SMALL = ModelConfig(name="small", hidden=48, num_experts=8, topk=2, dispatch_dtype="bf16")


# ---------------------------------------------------------------------------------------------------------
# Refused before launch: options that cannot hold, backends that cannot capture


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"profile": True}, "--cuda-graph 4 replays the calls without the host"),
        ({"timing": "iteration"}, "drop --timing iteration or --cuda-graph"),
        ({"check": "every"}, "drop --check every"),
        ({"inject_delay": (InjectedDelay(1, None, 0.001),)}, "--inject-delay"),
        ({"send_mode": "node", "imbalance_cost": False}, "use --send-mode token or selection"),
    ],
)
def test_options_that_cannot_hold_with_a_graph_are_refused(values: dict, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        RunConfig.from_options("run", {"world_size": 4, "cuda_graph": 4, **values})


def test_graph_timing_flows_into_every_job_kind() -> None:
    config = RunConfig.from_options("run", {"world_size": 2, "cuda_graph": 6})
    assert config.timing.job_timing("checksum", "iteration") == "graph"
    from commbench.cli.inputs import balanced_job

    job = balanced_job([1024], config)
    assert (job.timing, job.graph_calls) == ("graph", 6)
    with pytest.raises(UsageError, match="graph timing needs --cuda-graph N"):
        BalancedJob("b", [1024], timing="graph").check(2)


@pytest.mark.parametrize("backend", ["gloo", "mock", "shmem-emu"])
def test_a_backend_that_cannot_capture_is_refused_in_one_line(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import commbench.run.dist

    monkeypatch.setattr(commbench.run.dist, "launch", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    args = ["run", "--world-size", "2", "--backend", backend, "--pattern", "balanced", "--cuda-graph", "4"]
    result = CliRunner().invoke(__import__("commbench.cli", fromlist=["cli"]).cli, [*args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"commbench: error: --cuda-graph 4 on --backend {backend}:"
    )
    assert "use --backend nccl or nvshmem" in lines[0] and not out.exists()


def test_each_backend_class_says_whether_it_captures() -> None:
    capturing = {name for name in BACKENDS if get_backend(name).captures_graphs}
    assert capturing == {"nccl", "nvshmem"}
    for name in set(BACKENDS) - capturing:
        assert "cannot be captured" in get_backend(name).graph_refusal("balanced", {}, 4)
    # nccl: the balanced sweep's splits are fixed; the MoE phases read their counts on the host.
    assert NcclBackend.graph_refusal("balanced", {}, 3) == ""
    assert NcclBackend.graph_refusal("matrix", {}, 3) == ""
    assert "host split sizes" in NcclBackend.graph_refusal("moe", {}, 4)
    # nvshmem: counts on the device, the put path, an even N.
    assert NvshmemBackend.graph_refusal("moe", {"counts": "device"}, 4) == ""
    assert "add --backend-option counts=device" in NvshmemBackend.graph_refusal("moe", {}, 4)
    assert "variant=put" in NvshmemBackend.graph_refusal("moe", {"counts": "device", "variant": "vdev2d"}, 4)
    assert "use 6" in NvshmemBackend.graph_refusal("balanced", {"counts": "device"}, 5)
    with pytest.raises(UsageError, match="counts=device keeps the signal totals on the device"):
        NvshmemBackend.check_options({"counts": "device", "signal_op": "set"})


def test_graph_refusal_names_the_job_and_setting() -> None:
    job = MoeJob("small", RoutingConfig(SMALL, parse_skew("uniform"), 2, 8), timing="graph", graph_calls=4)
    assert graphs.graph_refusal(NcclBackend, [job], [{}]).startswith("--cuda-graph 4 on --backend nccl:")
    assert graphs.graph_refusal(NvshmemBackend, [job], [{"counts": "device"}]) == ""
    assert "counts=device" in graphs.graph_refusal(NvshmemBackend, [job], [{"counts": "device"}, {}])


# ---------------------------------------------------------------------------------------------------------
# torch's capture: a side stream, warmed up first


class _FakeStream:
    default: _FakeStream | None = None

    def wait_stream(self, other: _FakeStream) -> None:
        pass


class _FakeCuda:
    """The torch.cuda calls ``TorchGraphs`` makes, with CUDAGraph.capture_begin's non-default-stream check
    (module docstring) and a record of what ran on which stream."""

    def __init__(self) -> None:
        self.default = _FakeStream()
        self.current = self.default
        self.events: list[tuple[str, bool]] = []  # (what, on the default stream)

    def Stream(self, device: Any = None) -> _FakeStream:  # noqa: N802 - torch's name
        return _FakeStream()

    def current_stream(self, device: Any = None) -> _FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: _FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def CUDAGraph(self) -> Any:  # noqa: N802 - torch's name
        cuda = self

        class Graph:
            def capture_begin(self) -> None:
                if cuda.current is cuda.default:
                    raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
                cuda.events.append(("capture", False))

            def replay(self) -> None:
                cuda.events.append(("replay", cuda.current is cuda.default))

        return Graph()

    @contextlib.contextmanager
    def graph(self, graph: Any, stream: _FakeStream | None = None) -> Iterator[None]:
        with self.stream(stream if stream is not None else _FakeStream()):
            graph.capture_begin()
            with capture_guard():
                yield


def test_torch_graphs_warm_up_and_capture_on_a_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _FakeCuda()
    for name in ("Stream", "current_stream", "stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    calls: list[bool] = []

    def call() -> int:
        calls.append(cuda.current is cuda.default)
        return len(calls)

    replay, output = graphs.TorchGraphs(torch.device("cuda", 0)).capture(call, 3)
    assert calls == [False, False, False, False]  # warm-up and the 3 captured calls, none on the default
    assert output == 4 and cuda.events == [("capture", False)]
    replay()
    assert cuda.events[-1] == ("replay", True)  # replayed on the caller's (default) stream


def test_the_fake_capture_refuses_host_syncs() -> None:
    tensor = torch.arange(4)
    for read in (
        lambda: tensor.item(),
        lambda: tensor.tolist(),
        lambda: bool(tensor[0]),
        lambda: tensor.cpu(),
    ):
        with capture_guard(), pytest.raises(CaptureUnsupported, match=CAPTURE_ERROR):
            read()
    assert tensor.tolist() == [0, 1, 2, 3]  # restored after the capture
    with pytest.raises(UsageError, match="this rank runs on cpu"):
        graphs.torch_graphs(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------
# counts=device: the layout the NVSHMEM kernels read, computed with no host read


def test_the_device_layout_is_the_hosts_and_reads_nothing_on_the_host() -> None:
    """``DeviceLayout.receive`` runs inside the fake capture (no host read, no host-to-device copy) and lays
    out what ``protocol.phase_layout`` lays out on the host; its running totals are what the host's
    SignalTracker expects, call after call (a graph's replays keep advancing them)."""
    rng = np.random.default_rng(3)
    world, slots = 4, 2
    counts = rng.integers(0, 9, (world, world, slots))
    counts[1, 2] = 0  # an empty segment still signals
    rows = counts.sum(axis=2)
    capacity = proto.buffer_capacity(rows + 3)  # sized at set-up for at least these counts
    for signals in (
        proto.SignalConfig("chunk", "add", 3),
        proto.SignalConfig("segment", "add", 3),
    ):
        for rank in range(world):
            layout = DeviceLayout(world, rank, slots, capacity, (signals, signals), torch.device("cpu"))
            slot_bytes = torch.from_numpy(counts.astype(np.int64).reshape(world, -1)).view(torch.uint8)
            trackers = {phase: proto.SignalTracker("add", world) for phase in proto.PHASES}
            for _ in range(3):
                with capture_guard():
                    recv_counts = layout.receive(slot_bytes)
                    for phase in proto.PHASES:
                        layout.advance(phase)
                assert torch.equal(recv_counts, torch.from_numpy(counts[:, rank, :].astype(np.int64)))
                for phase, phase_rows in (("dispatch", rows), ("combine", rows.T)):
                    host = proto.phase_layout(phase_rows, rank, signals, capacity)
                    items, waits, _ = layout.tables[phase]
                    assert np.array_equal(proto.active_items(items.numpy()), host.items_table())
                    _, expected = trackers[phase].advance(host)
                    assert np.array_equal(waits[:, 1].numpy()[host.wait_source], expected)
    # The host path reads the counts on the host: refused inside a capture.
    with capture_guard(), pytest.raises(CaptureUnsupported):
        proto.row_counts(torch.from_numpy(rows))


# ---------------------------------------------------------------------------------------------------------
# The harness's graph path and the emulated count protocol on 2 gloo ranks (one launch)


class CapturableGloo(GlooBackend):
    """gloo's all-to-all marked capturable: the harness's graph path on CPU, with the fake graphs."""

    captures_graphs = True


def _jobs(graph_calls: int) -> dict[str, Any]:
    routing = RoutingConfig(SMALL, parse_skew("zipf:1.2"), 2, 16)
    return {
        "balanced": BalancedJob("balanced", [1024, 4096], warmup=1, iters=3, timing="graph", graph_calls=4),
        "moe_graph": MoeJob("small", routing, warmup=1, iters=2, timing="graph", graph_calls=graph_calls),
        "token": MoeJob("small", routing, warmup=1, iters=3),
        "selection": MoeJob("small", routing, "selection", warmup=1, iters=3),
    }


def _entry(comm: Any) -> dict[str, Any]:
    from commbench.backends.shmem.emu import ShmemEmuBackend
    from commbench.errors import CommbenchError
    from commbench.run.harness import run_jobs

    jobs, out = _jobs(4), {}
    opts = RunOptions(backend="gloo", timeout_s=30)
    graphs.make_graphs = lambda device: FakeGraphs()
    rows, _ = run_jobs(comm, [jobs["balanced"]], opts, CapturableGloo)
    out["graph_rows"] = [
        (r["size_bytes"], r["timing"], r["graph_calls"], r["check"], r["wrong"]) for r in rows
    ]
    try:  # the --corrupt hook: the last replay's output is what is verified
        run_jobs(
            comm,
            [jobs["balanced"]],
            RunOptions(backend="gloo", timeout_s=30, corrupt="dispatch"),
            CapturableGloo,
        )
    except CommbenchError as exc:
        out["corrupt"] = str(exc)
    graphs.make_graphs = lambda device: FakeGraphs(replays=False)
    try:
        run_jobs(comm, [jobs["balanced"]], opts, CapturableGloo)
    except CommbenchError as exc:
        out["no_replay"] = str(exc)
    emu = RunOptions(backend="shmem-emu", backend_options={"counts": "device"}, timeout_s=30)
    for mode in ("token", "selection"):
        emu_rows, _ = run_jobs(comm, [jobs[mode]], emu, ShmemEmuBackend)
        out[f"emu_{mode}"] = [(r["phase"], r["wrong"], r["knobs"]["counts"]) for r in emu_rows]
    graphs.make_graphs = lambda device: FakeGraphs()
    try:  # last: the MoE phases of the all-to-all backends read their counts on the host
        run_jobs(comm, [jobs["moe_graph"]], opts, CapturableGloo)
    except CommbenchError as exc:
        out["moe"] = str(exc)
    return out


@pytest.fixture(scope="module")
def graph_launch() -> dict[str, Any]:
    from commbench.run.dist import launch

    return launch(2, _entry, (), "gloo", 60)


def test_graph_rows_are_timed_verified_and_say_so(graph_launch: dict[str, Any]) -> None:
    assert graph_launch["graph_rows"] == [
        (1024, "graph", 4, "window-last", 0),
        (4096, "graph", 4, "window-last", 0),
    ]
    assert "in the last of 3 back-to-back replays of a CUDA graph of 4 calls" in graph_launch["corrupt"]


def test_a_replay_that_writes_nothing_is_caught(graph_launch: dict[str, Any]) -> None:
    # Poisoned before the replays, outside the timer: a graph that moves nothing leaves the sentinel.
    assert "#wrong=" in graph_launch["no_replay"] and "CUDA graph" in graph_launch["no_replay"]


def test_moe_phases_with_host_counts_cannot_be_captured(graph_launch: dict[str, Any]) -> None:
    # Why nccl's graph_refusal refuses them: all_to_all_single's splits are read with .tolist().
    assert CAPTURE_ERROR in graph_launch["moe"] and "tolist" in graph_launch["moe"]


def test_the_emulator_runs_the_device_count_protocol_verified(graph_launch: dict[str, Any]) -> None:
    for mode in ("token", "selection"):
        assert graph_launch[f"emu_{mode}"] == [("dispatch", 0, "device"), ("combine", 0, "device")]


def test_reports_say_cuda_graph_of_n_calls() -> None:
    import pandas as pd

    from commbench.report.pages.console import sweep_config
    from commbench.report.pages.modes import timing_how, timing_text

    frame = pd.DataFrame(
        {
            "timing": ["graph", "iteration"],
            "graph_calls": [10, None],
            "size_bytes": [1024, 2048],
            "iters": [5, 5],
        }
    )
    text = timing_text(frame)
    assert text is not None and text.startswith("graph (CUDA graph of 10 calls: --cuda-graph")
    assert "window / (replays x calls per graph)" in text and "; iteration (" in text
    assert timing_how(frame, "graph").startswith("CUDA graph of 10 calls")
    # nccl-tests' JSON: graph = launches of the graph (the replays), 0 without --cuda-graph.
    assert sweep_config(frame, {"config": {"timing": {"cuda_graph": 10, "iters": 5}}})["graph"] == 5
    assert sweep_config(frame, {"config": {"timing": {"iters": 5}}})["graph"] == 0

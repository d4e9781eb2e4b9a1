"""CUDA graph timing (``--cuda-graph N``, nccl-tests' ``-G``): a phase's calls captured N at a time, replayed.

nccl-tests (src/common.cu, ``BenchTime``) captures its ``-n`` timed calls into one graph and launches it
``-G`` times: time = elapsed / (iters x launches). commbench captures N calls into one graph and replays it
``--iters`` times: the same number of calls and the same per-call time, the two numbers' roles swapped so
that N says how many calls one graph holds (what a serving engine captures: a decode step's layers).

The steps (``timed_graph``), after the harness's warm-up:

1. one call on the capture stream: torch's graph notes warm up on the side stream the capture uses, so lazy
   set-up (the allocator's, a communicator's) happens before, not inside, the capture;
2. capture: ``torch.cuda.graph(graph, stream=side)`` around N calls. torch makes the side stream current
   (capture on the legacy default stream is refused) and records device work only: a call's host code runs
   once, here, never at a replay. So a captured call must not read device values on the host (``.item()``,
   ``.tolist()``, ``.cpu()``, a synchronize: cudaErrorStreamCaptureUnsupported), nor copy pageable host
   memory to the device, nor rely on host state it changes per call (the reason one-sided backends keep
   their signal totals on the device);
3. the receive buffers poisoned (outside the timer; the graph's buffers are fixed, every replay writes the
   same tensors), a synchronize, a barrier;
4. one timer around ``iters`` back-to-back replays, seconds per call = window / (iters x N); the last
   replay's output (the last captured call's return value) verified byte for byte ("window-last").

Which backend can be captured is its class's fact (``Backend.captures_graphs``), and which of its jobs and
options hold under capture its ``graph_refusal`` (nccl: not the MoE phases, whose split sizes are read on the
host; nvshmem: only with device-side counts); ``graph_refusal`` here asks it for every job and knob setting
before launch. The decode case is graph-timed wherever that is "" (``with_graphs``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from commbench.errors import UsageError
from commbench.run.declare import GRAPH_TIMING
from commbench.run.jobs import Job, MoeJob

# The decode case's graph where the backend can capture it and --cuda-graph is not given: a few calls per
# graph, as a serving engine captures a decode step's layers (even: see NvshmemBackend.graph_refusal).
DECODE_GRAPH_CALLS = 10


class GraphCapture(Protocol):
    """What ``timed_graph`` needs of CUDA graphs: capture ``calls`` calls of ``call`` (returns the replay
    and the last call's output). ``TorchGraphs`` on a GPU; tests give a fake with the same contract."""

    def capture(self, call: Callable[[], Any], calls: int) -> tuple[Callable[[], None], Any]: ...


class TorchGraphs:
    """``torch.cuda.CUDAGraph`` captured through ``torch.cuda.graph`` on a side stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def capture(self, call: Callable[[], Any], calls: int) -> tuple[Callable[[], None], Any]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):  # the side-stream warm-up torch's notes ask for
            call()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        output = None
        with torch.cuda.graph(graph, stream=self.stream):
            for _ in range(calls):
                output = call()
        return graph.replay, output


def torch_graphs(device: torch.device) -> GraphCapture:
    """CUDA graphs on ``device``; UsageError on a CPU rank (no backend that runs there can be captured)."""
    if device.type != "cuda":
        raise UsageError(f"--cuda-graph captures CUDA work, this rank runs on {device}: drop --cuda-graph")
    return TorchGraphs(device)


# How the harness makes its graphs: torch's, or (tests) a fake that enforces the same capture rules.
make_graphs: Callable[[torch.device], GraphCapture] = torch_graphs


def timed_graph(
    comm: Any, backend: Any, call: Callable[[], Any], job: Job, checking: bool
) -> tuple[list[float], Any]:
    """Capture ``job.graph_calls`` calls of ``call``, then time ``job.iters`` replays in one window (module
    docstring): ([seconds per call], the last replay's output)."""
    calls, replays = job.graph_calls, job.iters
    replay, output = make_graphs(comm.device).capture(call, calls)
    if checking:  # every replay writes the captured buffers: poisoned once, the last replay must fill them
        backend.poison_receive_buffers()
        backend.synchronize()
    comm.barrier()
    timer = comm.timer()
    timer.start()
    for _ in range(replays):
        replay()
        comm.heartbeat()  # a shared-memory store: the watchdog's progress through a long window
    timer.stop(backend.synchronize)
    return [timer.seconds() / (replays * calls)], output


def wrong_where(job: Job, wrong_iters: int) -> str:
    """Where a job's #wrong was found, for its message: in how many timed iterations, or (window and graph
    timing: one checked output) in the last of the window's calls or of the graph's replays."""
    if job.timing == GRAPH_TIMING:
        return f"in the last of {job.iters} back-to-back replays of a CUDA graph of {job.graph_calls} calls"
    if job.timing == "window":
        return f"in the last of {job.iters} back-to-back timed iterations (window timing)"
    return f"in {wrong_iters} of {job.iters} timed iterations"


def graph_refusal(backend_class: Any, jobs: Sequence[Job], settings: Sequence[Mapping[str, Any]]) -> str:
    """Why one of ``jobs`` timed as a graph cannot be captured on ``backend_class`` with one of the knob
    ``settings`` ("" when all can): the backend's own ``graph_refusal``."""
    for job in jobs:
        if job.timing != GRAPH_TIMING:
            continue
        for options in settings or [{}]:
            setting = {**options, **(job.backend_options or {})}
            refusal = backend_class.graph_refusal(job.kind, setting, job.graph_calls)
            if refusal:
                return f"--cuda-graph {job.graph_calls} on --backend {backend_class.name}: {refusal}"
    return ""


def with_graphs(
    jobs: Sequence[Job], backend_class: Any, settings: Sequence[Mapping[str, Any]], allowed: bool
) -> list[Job]:
    """The jobs with the decode case graph-timed (``DECODE_GRAPH_CALLS``) where ``allowed`` (no option
    conflicts with graph timing and none chose another) and the backend can capture it with every setting;
    elsewhere it stays timed per iteration, and its rows say so."""
    out = []
    for job in jobs:
        if isinstance(job, MoeJob) and job.decode and job.timing != GRAPH_TIMING and allowed:
            graphed = replace(job, timing=GRAPH_TIMING, graph_calls=DECODE_GRAPH_CALLS)
            if not graph_refusal(backend_class, [graphed], settings):
                job = graphed
        out.append(job)
    return out

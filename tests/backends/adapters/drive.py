"""Drives an adapter rank by rank on gloo processes, as the harness does, beside gloo's own all-to-all.

``drive`` runs one MoE case through an adapter (over a fake library) and through ``TorchDistBackend`` on the
same plans: the adapter's received rows must be byte-identical to gloo's and to what every source's plan says
(``expected_rows``), in two rounds with the receive buffers poisoned before each; its combine output is
compared with the float64 reference at the library's precision (``combine_rtol``: the libraries hand back
bf16). Every timed round is watched for host reads of a tensor made by adapter code (``HostReads``): the
libraries' own benchmarks time the call alone, and an adapter's ``.tolist()`` or ``bool(tensor)`` inside it
would add a device synchronization to every figure. ``balanced`` runs the balanced all-to-all through the
real harness (``run_jobs``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from commbench.backends.torchdist import TorchDistBackend
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import parse_skew
from commbench.run.config import RunOptions
from commbench.run.harness import run_jobs
from commbench.run.jobs import BalancedJob
from commbench.run.steps import StepRecorder
from commbench.traffic.payload import (
    COMBINE_ATOL,
    COMBINE_RTOL,
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

TIMEOUT_S = 60.0
# Rows of a multiple of 16 bytes, as the libraries move them: FP8 128 + 4 scales x 4 B = 144 B; BF16 256 B.
FP8 = ModelConfig(name="tiny-fp8", hidden=128, num_experts=16, topk=4, dispatch_dtype="fp8", scale_block=32)
BF16 = ModelConfig(name="tiny-bf16", hidden=128, num_experts=16, topk=4, dispatch_dtype="bf16")
# The low-latency kernels compile for a few hidden sizes only (DeepEP's SWITCH_HIDDEN, launch.cuh:113-134;
# NCCL EP's, macros.cuh:161-171): 2048 is the smallest all of them take.
LL = ModelConfig(name="tiny-ll", hidden=2048, num_experts=16, topk=4, dispatch_dtype="bf16")
ADAPTERS = str(Path(__file__).resolve().parents[3] / "commbench" / "backends" / "adapters")
_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    """Records every host read of a tensor (``tolist``, ``item``, ``bool(t)``, ...) whose caller is adapter
    code, as "file:line", while ``watching`` (the libraries, real or fake, may read what they like)."""

    def __init__(self) -> None:
        self.found: list[str] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        originals = {name: getattr(torch.Tensor, name) for name in _READS}

        def wrap(name: str, original: Any) -> Any:
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(ADAPTERS):
                    self.found.append(f"{Path(caller).name}:{sys._getframe(1).f_lineno} {name}")
                return original(tensor, *args, **kwargs)

            return read

        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)


def routing(
    world: int, model: ModelConfig, skew: str, tokens: int = 24, mask_ratio: float = 0.0
) -> RoutingConfig:
    return RoutingConfig(
        model=model,
        skew=parse_skew(skew),
        world_size=world,
        tokens_per_rank=tokens,
        seed=3,
        mask_ratio=mask_ratio,
    )


def _dispatch(backend: Any, comm: Any, plans: list) -> tuple[torch.Tensor, torch.Tensor]:
    plan = plans[comm.rank]
    tokens = encode_rows(comm.rank, torch.arange(plan.num_tokens), plan.dispatch_row_bytes)
    backend.poison_receive_buffers()
    backend.steps.begin()
    counts = backend.exchange_counts(plan.send_counts)
    received = backend.dispatch(tokens, plan, counts).clone()
    backend.steps.end()
    return received, counts


def _combine(
    backend: Any, comm: Any, plans: list, mode: str, hidden: int, received: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    src, token = decode_header(received)
    expert_out = expert_outputs(src, token, received_keys(counts, comm.rank, mode), hidden)
    backend.steps.begin()
    combined = backend.combine(expert_out, plans[comm.rank], counts).clone()
    backend.steps.end()
    return combined


def _one_round(
    backend: Any, comm: Any, plans: list, mode: str, hidden: int
) -> tuple[torch.Tensor, torch.Tensor]:
    received, counts = _dispatch(backend, comm, plans)
    return received, _combine(backend, comm, plans, mode, hidden, received, counts)


def drive(
    comm: Any, backend_class: type, options: dict, cfg: RoutingConfig, mode: str, rounds: int = 2
) -> dict:
    """One rank's outcome of the case (see the module docstring)."""
    model = cfg.model
    plans = [plan_rank(route_rank(cfg, src), model, comm.world_size, mode) for src in range(comm.world_size)]
    plan = plans[comm.rank]
    reference = TorchDistBackend(comm, {})
    reference.steps = StepRecorder(comm.device)
    reference.setup(plan)
    want_rows, want_combined = _one_round(reference, comm, plans, mode, model.hidden)
    reference.close()
    backend = backend_class(comm, options)
    backend.steps = StepRecorder(comm.device)  # as --profile: a step inside another would raise
    backend.setup_peers(plans)
    backend.setup(plan)
    exact, tolerance = expected_combine(plan, model.hidden)
    # The library's precision: the same magnitude term, scaled by its combine_rtol instead of 1e-4.
    library_tolerance = (tolerance - COMBINE_ATOL) / COMBINE_RTOL * backend.combine_rtol + COMBINE_ATOL
    outcome: dict = {"rows_wrong": [], "same_as_gloo": [], "combine_wrong": [], "close_to_gloo": []}
    reads = HostReads()
    for _ in range(rounds):
        with reads.watching():
            received, counts = _dispatch(backend, comm, plans)
        outcome["rows_wrong"].append(count_wrong_rows(received, expected_rows(plans, comm.rank)))
        outcome["same_as_gloo"].append(bool(torch.equal(received, want_rows)))
        if outcome["rows_wrong"][-1]:  # as the harness: wrong rows end the case before combine
            break
        with reads.watching():
            combined = _combine(backend, comm, plans, mode, model.hidden, received, counts)
        outcome["combine_wrong"].append(count_wrong_combine(combined, exact, library_tolerance))
        outcome["close_to_gloo"].append(
            count_wrong_combine(combined, want_combined.double(), library_tolerance)
        )
    outcome["host_reads"] = sorted(set(reads.found))
    outcome["topk_width"] = backend.shape.topk if getattr(backend, "shape", None) is not None else None
    outcome["rows"] = int(received.shape[0])
    outcome["steps"] = sorted({name for it in backend.steps.take() for name, _, _ in it.steps})
    outcome["knobs"] = backend.knobs()
    outcome["label"] = backend.label
    backend.close()
    return outcome


def balanced(comm: Any, backend_class: type, name: str, options: dict, sizes: list[int]) -> list[dict]:
    """The balanced all-to-all of ``sizes`` through the harness on ``backend_class`` (rows on rank 0)."""
    job = BalancedJob(name="balanced", sizes=sizes, warmup=1, iters=2)
    rows, _ = run_jobs(comm, [job], RunOptions(name, options, TIMEOUT_S), backend_class)
    return rows


def assert_clean(outcomes: list[dict], rounds: int = 2) -> None:
    """Every rank's every round: no wrong row byte, as gloo's, combine within the library's precision."""
    for outcome in outcomes:
        assert outcome["rows_wrong"] == [0] * rounds, outcome
        assert outcome["same_as_gloo"] == [True] * rounds, outcome
        assert outcome["combine_wrong"] == [0] * rounds, outcome
        assert outcome["close_to_gloo"] == [0] * rounds, outcome
        assert outcome["host_reads"] == [], outcome  # no host sync added to the timed calls
    assert sum(outcome["rows"] for outcome in outcomes) > 0

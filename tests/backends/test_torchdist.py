"""TorchDistBackend on gloo processes, driven directly (without the harness) on hand-built routings."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from commbench.backends import get_backend
from commbench.backends.torchdist import TorchDistBackend
from commbench.errors import UsageError
from commbench.inputs.models import ModelConfig
from commbench.run.dist import launch
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
from commbench.traffic.plan import plan_rank, receive_offsets, row_matrix
from commbench.traffic.routing import Routing

# 6 experts over 3 ranks (2 each). Rank 2 routes nothing to rank 0 and rank 0 nothing to itself: zero splits.
MODEL = ModelConfig(name="tiny", hidden=12, num_experts=6, topk=2)
IDS = {
    0: [[2, 5], [3, -1], [4, 2]],
    1: [[0, 1], [5, 3], [1, 4], [2, -1]],
    2: [[4, 5], [2, 3]],
}


def routing(rank):
    ids = torch.tensor(IDS[rank])
    weights = torch.where(ids >= 0, 0.25 + 0.125 * torch.arange(ids.numel()).view(ids.shape), 0.0)
    return Routing(rank=rank, topk_ids=ids, topk_weights=weights.float())


def run_mode(comm, send_mode):
    plans = [plan_rank(routing(src), MODEL, comm.world_size, send_mode) for src in range(comm.world_size)]
    plan = plans[comm.rank]
    backend = get_backend(comm.process_group)(comm, {})
    assert isinstance(backend, TorchDistBackend) and backend.name == "gloo" and not backend.emulated
    backend.setup(plan)
    tokens = encode_rows(comm.rank, torch.arange(plan.num_tokens), plan.dispatch_row_bytes)
    outcome = {}
    for _ in range(2):  # the second round reuses the buffers grown by the first
        recv_counts = backend.exchange_counts(plan.send_counts)
        received = backend.dispatch(tokens, plan, recv_counts)
        src, token = decode_header(received)
        expert_out = expert_outputs(
            src, token, received_keys(recv_counts, comm.rank, send_mode), MODEL.hidden
        )
        combined = backend.combine(expert_out, plan, recv_counts)
        reference, tolerance = expected_combine(plan, MODEL.hidden)
        outcome = {
            "recv_counts": recv_counts.tolist(),
            "expected_counts": torch.stack([p.send_counts[comm.rank] for p in plans]).tolist(),
            "dispatch_wrong": count_wrong_rows(received, expected_rows(plans, comm.rank)),
            "sources": src.tolist(),
            "combine_wrong": count_wrong_combine(combined, reference, tolerance),
            "combined_dtype": str(combined.dtype),
        }
    backend.close()
    return comm.all_gather_object(outcome)


def backend_entry(comm, send_modes):
    return {mode: run_mode(comm, mode) for mode in send_modes}


@pytest.fixture(scope="module")
def gloo_outcomes():
    """One launch of 3 gloo ranks for both send modes (spawning costs seconds)."""
    return launch(3, backend_entry, (("token", "selection"),), process_group="gloo", timeout_s=60)


@pytest.mark.parametrize("send_mode", ["token", "selection"])
def test_gloo_dispatch_and_combine_with_uneven_and_zero_splits(gloo_outcomes, send_mode):
    outcomes = gloo_outcomes[send_mode]
    plans = [plan_rank(routing(src), MODEL, 3, send_mode) for src in range(3)]
    counts = row_matrix(plans)
    assert counts[0, 0] == 0 and counts[2, 0] == 0  # zero splits are exercised
    offsets = receive_offsets(counts)
    for dst, outcome in enumerate(outcomes):
        assert outcome["recv_counts"] == outcome["expected_counts"]
        assert outcome["dispatch_wrong"] == 0 and outcome["combine_wrong"] == 0
        assert outcome["combined_dtype"] == "torch.float32"
        # Received order == all_to_all_single output order: sources in rank order at receive_offsets.
        sources = np.array(outcome["sources"])
        for src in range(3):
            segment = sources[offsets[src, dst] : offsets[src, dst] + counts[src, dst]]
            assert (segment == src).all()


def test_options_are_rejected():
    comm = SimpleNamespace(process_group="gloo", device=torch.device("cpu"))
    with pytest.raises(UsageError, match="takes no options"):
        TorchDistBackend(comm, {"chunk_bytes": 1})
    assert TorchDistBackend(comm, {}).label == "gloo"

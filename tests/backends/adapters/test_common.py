"""What the adapters share: a plan as top-k routing, the shape every rank agrees on, rows back in order."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from commbench.backends.adapters.common import PeerShape, expert_major_slots, order_keys, routed_tokens
from commbench.inputs.models import ModelConfig
from commbench.traffic.payload import encode_rows
from commbench.traffic.plan import plan_balanced, plan_rank
from commbench.traffic.routing import Routing

# 8 experts over 2 ranks (4 each); -1 = a dropped selection.
MODEL = ModelConfig(name="tiny", hidden=64, num_experts=8, topk=3)
IDS = {0: [[1, 5, 6], [2, 3, -1], [7, 0, 4]], 1: [[4, 5, 6], [0, -1, -1]]}


def plans(mode: str) -> list:
    out = []
    for rank, ids in IDS.items():
        ids_t = torch.tensor(ids)
        weights = torch.where(ids_t >= 0, 0.1 * (1 + torch.arange(ids_t.numel()).view(ids_t.shape)), 0.0)
        out.append(
            plan_rank(Routing(rank=rank, topk_ids=ids_t, topk_weights=weights.float()), MODEL, 2, mode)
        )
    return out


def test_selection_mode_routing_is_the_plans_rows_with_their_weights():
    plan = plans("selection")[0]
    topk_idx, topk_weights = routed_tokens(plan, 3)
    assert topk_idx.tolist() == [[1, 5, 6], [2, 3, -1], [0, 4, 7]]  # a token's experts ascending
    assert torch.allclose(topk_weights[2], torch.tensor([0.8, 0.9, 0.7]))
    assert topk_weights[1, 2] == 0


def test_token_mode_routing_has_one_entry_per_destination_rank_with_the_summed_weight():
    plan = plans("token")[0]
    topk_idx, topk_weights = routed_tokens(plan, 2)
    assert topk_idx.tolist() == [[0, 1], [0, -1], [0, 1]]  # token 1's experts 2, 3 both live on rank 0
    assert torch.allclose(topk_weights[1], torch.tensor([0.4 + 0.5, 0.0]))
    assert torch.allclose(topk_weights[0], torch.tensor([0.1, 0.2 + 0.3]))


def test_every_rank_agrees_on_the_shape():
    selection = PeerShape.of(plans("selection"))
    assert (selection.topk, selection.experts_per_rank, selection.num_experts, selection.max_tokens) == (
        3,
        4,
        8,
        3,
    )
    assert not selection.uniform  # dropped selections
    token = PeerShape.of(plans("token"))
    assert (token.topk, token.experts_per_rank, token.num_experts, token.hidden) == (2, 1, 2, 64)
    balanced = PeerShape.of([plan_balanced(rank, 2, 64) for rank in range(2)])
    assert (balanced.topk, balanced.uniform, balanced.hidden, balanced.row_bytes) == (1, True, 0, 32)


def test_rows_sort_into_source_then_slot_then_token_order():
    rows = torch.cat([encode_rows(1, torch.tensor([5, 2]), 16), encode_rows(0, torch.tensor([9, 3]), 16)])
    keys = order_keys(rows, torch.tensor([0, 0, 1, 0]), 2)
    assert torch.argsort(keys).tolist() == [3, 2, 1, 0]  # (0, slot 0, 3), (0, 1, 9), (1, 0, 2), (1, 0, 5)


def test_expert_major_slots_index_the_valid_rows_of_each_expert():
    index, expert = expert_major_slots([2, 0, 1], 4, "cpu")
    assert index.tolist() == [0, 1, 8] and expert.tolist() == [0, 0, 2]


def test_an_adapter_puts_its_ranks_on_nccl_with_a_gpu_each(monkeypatch):
    """An adapter class says its ranks need NCCL and one GPU each (the launch reads ``process_group``), as
    nccl and nvshmem ranks, and with the library and GPUs present it is available."""
    from commbench.backends.adapters.pplx import PplxBackend
    from tests.backends.fakes import pplx_kernels, remove_modules

    assert PplxBackend.process_group == "nccl"
    pplx_kernels.install(with_cuda_core=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    try:
        PplxBackend.check_available()
    finally:
        remove_modules("pplx_kernels")


def test_the_host_read_watch_sees_a_read_made_by_adapter_code():
    """The watch every adapter test runs its timed rounds under (drive.HostReads) is not blind: PeerShape.of
    (set-up code, where host reads are fine) reads each plan's row counts with int(), and it is seen; a read
    made outside the adapters (here, the test itself) is not."""
    from tests.backends.adapters.drive import HostReads

    reads = HostReads()
    with reads.watching():
        PeerShape.of(plans("selection"))
        torch.tensor([1, 2]).tolist()
    assert reads.found and all(found.startswith("common.py:") for found in reads.found)


def test_an_adapters_gpu_run_is_judged_like_a_gpu_run():
    """An adapter describes itself as a GPU fabric's backend (its class's gpu_fabric, DispatcherBackend), so
    a report of its run is judged against the spec (cli.acceptance.choose_report_spec), and its rows, made on
    GPU ranks (RowMaker: emulated only for CPU ranks), get bandwidth verdicts, PASS or FAIL by their busbw,
    where the same rows from CPU ranks are skipped: the whole chain a deep-ep run on GPUs goes through."""
    import numpy as np

    from commbench.backends.adapters.deep_ep import DeepEpBackend
    from commbench.cli.acceptance import choose_report_spec
    from commbench.inputs.layout import build_layout
    from commbench.inputs.limits import load_limits
    from commbench.inputs.skew import parse_skew
    from commbench.report.frame import results_frame
    from commbench.report.judge.verdict import build_verdict
    from commbench.run.jobs import MoeJob
    from commbench.run.rows import RowMaker
    from commbench.traffic.routing import RoutingConfig

    spec, how, judged = choose_report_spec("gb300-nvl72", "deep-ep")
    assert judged == "gb300-nvl72" and "not judged" not in how
    world, per_peer = 8, 32 << 20
    cfg = RoutingConfig(MODEL, parse_skew("uniform"), world, 4096, seed=1)
    job = MoeJob("tiny", cfg)
    matrix = np.full((world, world), per_peer)
    verdicts = {}
    for device, busbw_GBps in (("cuda", 450.0), ("cuda", 1.0), ("cpu", 1.0)):
        backend = DeepEpBackend.__new__(DeepEpBackend)  # as built on a rank; the library is not needed here
        backend.comm = SimpleNamespace(device=torch.device(device))
        backend.mode, backend._sizes, backend.lib = "normal", {}, SimpleNamespace(__version__="2.1.0")
        seconds = np.full((world, 5), per_peer * (world - 1) / (busbw_GBps * 1e9))
        row, _ = RowMaker(job, backend, build_layout(world)).rows("dispatch", matrix, 7168, seconds, 0)
        assert row["emulated"] is (device == "cpu") and row["backend_name"] == "deep-ep"
        limits = load_limits(judged)
        verdict = build_verdict(results_frame([row], spec), limits, spec, how)
        (element,) = [e for e in verdict.elements if e.group == "moe"]
        verdicts[(device, busbw_GBps)] = element.status
    assert verdicts == {("cuda", 450.0): "PASS", ("cuda", 1.0): "FAIL", ("cpu", 1.0): "SKIP"}

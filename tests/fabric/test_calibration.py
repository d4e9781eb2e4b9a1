"""Calibration: the model against the published figures of calibration.yaml."""

from dataclasses import replace

import numpy as np
import pytest

from commbench.fabric.calibration import (
    case_traffic,
    case_value,
    deepep_node_traffic,
    deepep_test_hits,
    fit_table,
    predict_case,
)
from commbench.fabric.cases import REGIMES, calibration_cases, not_modelled, published_case
from commbench.fabric.model import compute_loads, make_fabric
from commbench.traffic.nodes import Nodes


def test_every_case_has_a_source_a_regime_and_a_published_figure():
    cases = calibration_cases()
    assert len(cases) > 100 and len({case.label for case in cases}) == len(cases)
    assert all(case.source and case.published > 0 for case in cases)
    assert all(case.size_bytes > 0 for case in cases if case.kind.startswith("nccl"))
    assert {case.case_regime for case in cases} == set(REGIMES)
    assert all(item.reason for item in not_modelled())  # listed with the reason the model has none


def test_published_entry_maps_its_conditions():
    entry = {
        "label": "x",
        "source": "s",
        "regime": "ep_multinode",
        "library": "hybrid-ep",
        "gpu": "H100",
        "world_size": 32,
        "gpus_per_node": 8,
        "metric": "IB GB/s (algorithm bandwidth)",
        "published": 50.0,
        "timing": "kernel_only",
        "dtype": "bf16",
        "sms": "16 (max)",
        "phase": "combine",
        "num_experts": 128,
    }
    sources = {"s": {"repo": "o/r", "path": "README.md", "commit": "0123456789abcdef"}}
    case = published_case(entry, sources)
    assert (case.kind, case.kernel, case.spec, case.sms, case.experts) == (
        "deepep_combine", "normal", "hgx-h100", 16, 128
    )  # fmt: skip
    assert case.cuda_graph and not case.dispatch_fp8 and case.source == "o/r README.md@01234567"
    assert case.max_nodes == 0  # no node limit stated: none
    skipped = published_case({**entry, "gpu": "MI300X"}, sources)
    assert skipped.reason == "no catalogue spec for GPU 'MI300X'"


def test_calibration_one_rack_and_cross_rack_nccl_large_sizes_within_15_percent():
    for case in calibration_cases():
        if case.kind == "nccl_busbw" and not case.note and not case.untrusted and case.size_bytes >= 1 << 33:
            value, _ = predict_case(case, None, tokens=0, seed=0)
            assert value == pytest.approx(case.published, rel=0.15), case.label


def test_calibration_deepep_intranode():
    for case in calibration_cases():
        if case.label.startswith("DeepEP EP8"):
            value, prediction = predict_case(case, None, tokens=4096, seed=0)
            assert value == pytest.approx(case.published, rel=0.15), case.label
            assert prediction.bottleneck_class == "nvlink"


def test_low_latency_kernel_is_nearly_flat_in_ep_size():
    # DeepEP's low-latency dispatch: 173 us at EP64, 194 at EP256; a host collective's per-peer latency
    # would add 3 us x 192 more peers. The engine overlaps them.
    by_label = {case.label: case for case in calibration_cases()}
    ep64 = predict_case(by_label["DeepEP V1 low-latency EP64 dispatch"], None, 0, 0)[0]
    ep256 = predict_case(by_label["DeepEP V1 low-latency EP256 dispatch"], None, 0, 0)[0]
    assert ep256 / ep64 < 1.3


def test_fit_recovers_a_parameter_from_the_model_s_own_figures():
    # Cases whose published figure is the model's own at nvlink_efficiency 0.5: the fit finds 0.5 again.
    cases = [c for c in calibration_cases() if c.case_regime == "node_or_rack" and c.kind == "nccl_busbw"]
    traffics = [case_traffic(case, 256, 0) for case in cases[:4]]
    table = {"nvlink_efficiency": 0.5}
    planted = [replace(t, case=replace(t.case, published=case_value(t, table)[0])) for t in traffics]
    fit = fit_table(planted, names=["nvlink_efficiency"])
    assert fit.values["nvlink_efficiency"] == pytest.approx(0.5, rel=1e-3)
    assert fit_table(planted, names=["per_sm_GBps"]).held == ["per_sm_GBps"]  # no SM-bound case


def test_deepep_traffic_counts_own_node_in_rdma_figure():
    # 2 nodes x 8 ranks; every token reaches every rank: RDMA counts both nodes, only one crosses a NIC.
    hits = np.ones((16, 4, 16), dtype=bool)
    nodes = Nodes.contiguous(16, 8)
    matrix, counted = deepep_node_traffic(hits, nodes, row_bytes=10)
    assert np.all(counted == 4 * 2 * 10)
    fabric = make_fabric("hgx-h800", 16, ranks_per_domain=8)
    loads = compute_loads(matrix, fabric)
    assert np.all(loads.bytes[:, 1, 0] == 4 * 1 * 10)  # NIC send: the remote node only
    assert np.all(loads.bytes[:, 1, 1] == 4 * 10)  # NIC recv from the same-rail rank of the other node
    # NVLink: each forwarder sends each token it holds to the 7 other ranks of its node, for its own
    # tokens and the remote peer's; no byte needs a PXN hop (stage 1 stays on its rail).
    assert np.all(loads.bytes[:, 0, 0] == 2 * 4 * 7 * 10) and loads.forwarded_bytes == 0
    combined, _ = deepep_node_traffic(hits, nodes, row_bytes=10, combine=True)
    assert np.array_equal(combined, matrix.T)


def test_deepep_test_routing_takes_any_node_size():
    hits = deepep_test_hits(8, 4, 16, np.random.default_rng(0), experts=8, topk=2, max_nodes=1)
    assert hits.shape == (8, 16, 8) and np.all(hits.sum(2) == 2)  # one expert per rank: 2 ranks a token
    by_node = hits.reshape(8, 16, 2, 4).any(3)
    assert np.all(by_node.sum(2) == 1)  # the node limit: every token stays inside one node

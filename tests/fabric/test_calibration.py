"""Calibration: the model against the published figures of calibration.yaml."""

import numpy as np
import pytest

from commbench.fabric.calibration import (
    calibration_cases,
    deepep_node_traffic,
    deepep_test_hits,
    predict_case,
)
from commbench.fabric.model import compute_loads, make_fabric
from commbench.traffic.nodes import Nodes


def test_every_case_has_a_source_and_a_published_figure():
    cases = calibration_cases()
    assert len(cases) == 21 and len({case.label for case in cases}) == len(cases)
    assert all(case.source and case.published > 0 for case in cases)
    assert all(case.size_bytes > 0 for case in cases if case.kind.startswith("nccl"))


def test_calibration_one_rack_and_cross_rack_nccl_within_10_percent():
    for case in calibration_cases():
        if case.kind.startswith("nccl") and not case.note:
            value, _ = predict_case(case, None, tokens=0, seed=0)
            assert value == pytest.approx(case.published, rel=0.10), case.label


def test_calibration_deepep_intranode():
    for case in calibration_cases():
        if case.label.startswith("DeepEP EP8"):
            value, prediction = predict_case(case, None, tokens=2048, seed=0)
            assert value == pytest.approx(case.published, rel=0.12), case.label
            assert prediction.bottleneck_class == "nvlink"


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

"""The fabric model: closed forms for balanced traffic, PXN forwarding, bottlenecks, uplinks, validation."""

from dataclasses import replace

import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.fabric.model import FabricParams, balanced_traffic, compute_loads, make_fabric, predict_phase
from commbench.inputs.specs import load_spec, parse_spec

B = 1_000_000.0  # bytes per peer


def test_balanced_one_domain_closed_form():
    n = 8
    fabric = make_fabric("gb300-nvl72", n)
    p = fabric.params
    pred = predict_phase(balanced_traffic(n, B), fabric)
    expected = (
        p.fixed_latency_s + (n - 1) * B / (900e9 * p.nvlink_efficiency) + (n - 1) * p.nvlink_peer_latency_s
    )
    assert pred.time_s == pytest.approx(expected, rel=1e-12)
    assert pred.bottleneck_class == "nvlink" and pred.scaleout_bytes == 0
    assert pred.self_bytes == n * B and pred.total_bytes == n * n * B
    # nccl-tests busbw of that run = (n-1)/n x size / time = the per-GPU link rate achieved.
    size = n * B
    busbw = size * (n - 1) / n / pred.time_s / 1e9
    assert busbw < 900 * p.nvlink_efficiency


def test_balanced_two_domains_closed_form_without_pxn():
    n, per_domain = 8, 4
    fabric = make_fabric("gb300-nvl72", n, ranks_per_domain=per_domain, rail_optimized=False)
    p = fabric.params
    pred = predict_phase(balanced_traffic(n, B), fabric)
    nic = 4 * B / (100e9 * p.scaleout_efficiency) + 4 * p.scaleout_peer_latency_s
    nvlink = 3 * B / (900e9 * p.nvlink_efficiency) + 3 * p.nvlink_peer_latency_s
    assert pred.time_s == pytest.approx(p.fixed_latency_s + max(nic, nvlink), rel=1e-12)
    assert pred.bottleneck_class == "scaleout"
    assert pred.scaleout_bytes == n * 4 * B and pred.nvlink_bytes == n * 3 * B


def test_pxn_forwards_over_nvlink_to_the_destination_rail():
    # 8 ranks, domains of 4, hosts of 2: rank 0 reaches 5 and 7 (rail 1) through rank 1's NIC.
    fabric = make_fabric("gb300-nvl72", 8, ranks_per_domain=4, ranks_per_host=2)
    loads = compute_loads(balanced_traffic(8, B), fabric)
    nvlink_send, nic_send, nic_recv = loads.bytes[:, 0, 0], loads.bytes[:, 1, 0], loads.bytes[:, 1, 1]
    assert np.allclose(nic_send, 4 * B) and np.allclose(nic_recv, 4 * B)  # balanced: same NIC load
    assert np.allclose(nvlink_send, 3 * B + 2 * B)  # 3 direct peers + 2 destinations forwarded
    assert loads.forwarded_bytes == 8 * 2 * B
    assert loads.messages[0, 1, 0] == 2  # carrier NIC of rank 0 serves destinations 4 and 6
    assert loads.messages[4, 1, 1] == 2  # rank 4 hears from two source hosts, not four ranks


def test_a_net_plugin_without_grouped_receives_sends_one_message_per_source_rank():
    # nccl's PXN carrier sends a remote rank the data of every local source; NCCL's IB transport receives
    # up to 8 of them as one (maxRecvs), aws-ofi-nccl before v1.19.1 one at a time (net_max_recvs 1).
    traffic = balanced_traffic(8, B)
    grouped = make_fabric("gb300-nvl72", 8, ranks_per_domain=4, ranks_per_host=2)
    single = make_fabric("gb300-nvl72", 8, ranks_per_domain=4, ranks_per_host=2, net_max_recvs=1)
    loads = compute_loads(traffic, single)
    assert loads.messages[0, 1, 0] == 4  # destinations 4 and 6, from sources 0 and 1 each
    assert loads.messages[4, 1, 1] == 4  # from ranks 0, 1 (carrier 0) and 2, 3 (carrier 2)
    assert np.array_equal(loads.bytes, compute_loads(traffic, grouped).bytes)  # same bytes, same path
    latency = grouped.params.scaleout_peer_latency_s
    assert predict_phase(traffic, single).time_s == pytest.approx(
        predict_phase(traffic, grouped).time_s + 2 * latency, rel=1e-9
    )
    with pytest.raises(UsageError, match="net_max_recvs must be >= 1"):
        FabricParams(net_max_recvs=0).validate()


def test_scaleout_bottleneck_names_the_hot_receiver():
    traffic = balanced_traffic(8, B)
    traffic[:4, 5] *= 10  # domain 0 floods rank 5 in domain 1
    fabric = make_fabric("gb200-nvl72", 8, ranks_per_domain=4, rail_optimized=False)
    pred = predict_phase(traffic, fabric)
    assert (pred.bottleneck_rank, pred.bottleneck_class, pred.bottleneck_dir) == (5, "scaleout", "recv")
    assert pred.bottleneck == "rank 5 scale-out NIC recv"
    assert pred.bottleneck_bytes == pytest.approx(4 * 10 * B)
    # With PXN every byte for rank 5 (rail 1) leaves through rank 1's NIC: sender and receiver tie, the
    # lower rank is named.
    pxn = predict_phase(traffic, make_fabric("gb200-nvl72", 8, ranks_per_domain=4))
    assert (pxn.bottleneck_rank, pxn.bottleneck_class, pxn.bottleneck_dir) == (1, "scaleout", "send")
    assert pxn.time_s == pytest.approx(pred.time_s - 3 * fabric.params.scaleout_peer_latency_s, rel=1e-9)


def test_oversubscribed_leaf_uplink_limits():
    n = 8
    fabric = make_fabric(
        "gb300-nvl72", n, ranks_per_domain=2, oversubscription=2.0, pod_gpus=4, rail_optimized=False
    )
    p = fabric.params
    pred = predict_phase(balanced_traffic(n, B), fabric)
    # Each 4-GPU pod sends 4 ranks x 4 remote-pod peers x B through 4 x 100 / 2 GB/s of uplink.
    uplink = 16 * B / (200e9 * p.scaleout_efficiency)
    assert pred.bottleneck_class == "uplink" and pred.bottleneck_rank == -1
    assert pred.time_s == pytest.approx(p.fixed_latency_s + uplink, rel=1e-12)
    assert (
        make_fabric("gb300-nvl72", n, ranks_per_domain=2, rail_optimized=False).params.oversubscription == 1
    )


def test_grouped_blocks_equal_the_block_diagonal_matrix():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 10_000_000, size=(3, 8, 8)).astype(np.float64)
    dense = np.zeros((24, 24))
    for g in range(3):
        dense[g * 8 : (g + 1) * 8, g * 8 : (g + 1) * 8] = blocks[g]
    for kwargs in (
        {"ranks_per_domain": 6, "ranks_per_host": 2},
        {"ranks_per_domain": 12, "rail_optimized": False},
    ):
        fabric = make_fabric("gb300-nvl72", 24, **kwargs)
        a, b = predict_phase(blocks, fabric), predict_phase(dense, fabric)
        assert a.time_s == pytest.approx(b.time_s, rel=1e-12)
        assert (a.bottleneck_rank, a.bottleneck_class) == (b.bottleneck_rank, b.bottleneck_class)
        assert np.allclose(a.rank_time_s, b.rank_time_s)


def test_no_link_bytes_costs_the_phase_latency():
    fabric = make_fabric("hgx-h100", 4)
    pred = predict_phase(np.diag([5.0, 5.0, 5.0, 5.0]), fabric)
    assert pred.bottleneck_class == "latency" and pred.time_s == fabric.params.fixed_latency_s


def test_params_from_spec_and_validation(tmp_path):
    spec = parse_spec(
        "name: x\ngpus_per_domain: 4\nnvlink_GBps_per_direction: 100\nnic_Gbps_per_direction: 100\n"
        "nvlink_efficiency: 0.5\nphase_latency_us: 0\nnet_max_recvs: 1\n"
    )
    params = FabricParams.from_spec(spec)
    assert params.nvlink_efficiency == 0.5 and params.phase_latency_s == 0 and params.net_max_recvs == 1
    assert FabricParams.from_spec(spec, net_max_recvs=8).net_max_recvs == 8  # a case's statement wins
    fabric = make_fabric(spec, 4, nvlink_peer_latency_s=0.0, cuda_graph=True)
    pred = predict_phase(balanced_traffic(4, B), fabric)
    assert pred.time_s == pytest.approx(3 * B / (100e9 * 0.5))
    with pytest.raises(UsageError, match="scaleout_efficiency"):
        make_fabric("gb300-nvl72", 8, scaleout_efficiency=0.0)
    with pytest.raises(UsageError, match="pod_gpus 6 is not a multiple"):
        make_fabric("gb300-nvl72", 8, pod_gpus=6, oversubscription=2.0)
    with pytest.raises(UsageError, match="covers 4 ranks"):
        predict_phase(balanced_traffic(4, B), make_fabric("gb300-nvl72", 8))


def test_gpu_initiated_engines_overlap_the_per_peer_latency():
    # 16 ranks in two domains, balanced: nccl pays every scale-out peer in sequence, the GPU-initiated
    # engines one message latency per resource (their peers are in flight at once).
    traffic = balanced_traffic(16, B)
    nccl = make_fabric("hgx-h100", 16, rail_optimized=False)
    normal = make_fabric("hgx-h100", 16, rail_optimized=False, kernel="normal", sms=0)
    p, q = nccl.params, normal.params
    so_bytes = 8 * B / (50e9 * p.scaleout_efficiency)
    assert predict_phase(traffic, nccl).time_s == pytest.approx(
        p.fixed_latency_s + so_bytes + 8 * p.scaleout_peer_latency_s, rel=1e-12
    )
    # ... and a normal kernel whose phase crosses the NIC pays its internode notify on top of its latency
    assert q.scaleout_kernel_latency_s > 0
    assert predict_phase(traffic, normal).time_s == pytest.approx(
        q.fixed_latency_s + q.scaleout_kernel_latency_s + so_bytes + q.scaleout_peer_latency_s, rel=1e-12
    )
    assert q.fixed_latency_s == q.kernel_latency_s + q.launch_s


def test_the_internode_notify_is_paid_only_by_a_phase_that_crosses_the_scaleout():
    # 16 ranks in two domains of 8: traffic inside each domain pays the kernel's fixed latency only; the same
    # bytes with one row crossing to the other domain pay the scale-out notify too, once, whatever crosses.
    normal = make_fabric("hgx-h100", 16, kernel="normal", sms=0, scaleout_kernel_latency_s=100e-6)
    inside = np.zeros((16, 16))
    inside[:8, :8] = inside[8:, 8:] = B
    np.fill_diagonal(inside, 0.0)
    crossing = inside.copy()
    crossing[0, 8] = 1.0  # one byte over the NIC
    p = normal.params
    alone = predict_phase(inside, normal).time_s
    assert alone == pytest.approx(
        p.fixed_latency_s + 7 * B / (450e9 * p.nvlink_efficiency) + p.nvlink_peer_latency_s
    )
    assert predict_phase(crossing, normal).time_s == pytest.approx(alone + 100e-6, rel=1e-6)
    nccl = make_fabric("hgx-h100", 16, scaleout_kernel_latency_s=100e-6)  # nccl has no such notify
    assert predict_phase(crossing, nccl).time_s < predict_phase(inside, nccl).time_s + 50e-6


def test_sm_bound_and_row_cost_of_a_normal_kernel():
    fabric = make_fabric("hgx-h100", 8, kernel="normal", sms=4, per_sm_GBps=10.0, row_cost_s=1e-6)
    row = 1000.0
    pred = predict_phase(balanced_traffic(8, B), fabric, message_bytes=row)
    handled = 7 * B  # bytes each rank sends (and receives) over NVLink; self traffic never leaves the GPU
    sm = handled / (4 * 10e9) + handled / row * 1e-6 / 4
    assert pred.bottleneck_class == "sm" and pred.bottleneck == "rank 0 SM throughput"
    assert pred.time_s == pytest.approx(fabric.params.fixed_latency_s + sm, rel=1e-12)


def test_an_sm_bound_combine_pays_its_reduction_and_a_link_bound_one_does_not():
    # combine_sm_speed slows only the SM resource of a combine (it reduces each token's returned rows); the
    # same bytes as a dispatch, or bound by NVLink, take what they took; a library's factor multiplies it.
    slow = make_fabric("hgx-h100", 8, kernel="normal", sms=4, per_sm_GBps=10.0, row_cost_s=0.0)
    slow = replace(slow, params=replace(slow.params, combine_sm_speed=0.5))
    traffic = balanced_traffic(8, B)
    dispatch = predict_phase(traffic, slow)
    combine = predict_phase(traffic, slow, combine=True)
    fixed = slow.params.phase_fixed_latency_s(combine=True, scaleout=False)
    assert combine.bottleneck_class == "sm"
    assert combine.time_s - fixed == pytest.approx(2 * (dispatch.time_s - slow.params.fixed_latency_s))
    wide = replace(slow, params=replace(slow.params, sms=1000))  # NVLink limits: no reduction cost shows
    assert predict_phase(traffic, wide, combine=True).bottleneck_class == "nvlink"
    spec = slow.spec
    table = {"combine_sm_speed": 0.8, "library.hybrid-ep.combine_sm_speed": 1.5}
    assert FabricParams.from_spec(spec, table, kernel="normal").combine_sm_speed == pytest.approx(0.8)
    hybrid = FabricParams.from_spec(spec, table, kernel="normal", library="hybrid-ep")
    assert hybrid.combine_sm_speed == pytest.approx(1.2)
    with pytest.raises(UsageError, match="combine_sm_speed must be > 0"):
        replace(slow.params, combine_sm_speed=0.0).validate()


def test_a_library_runs_the_engine_with_its_own_latency_and_sm_speed():
    # Factors on DeepEP's kernels (calibration.yaml library.*): the fixed latency scales, bytes per SM scale
    # (per_sm_GBps up, row cost down); DeepEP's own are the engine's; the nccl engine has no library.
    table = {"library.hybrid-ep.latency_factor": 0.5, "library.hybrid-ep.sm_speed": 2.0}
    spec = make_fabric("hgx-h100", 8).spec
    deepep = FabricParams.from_spec(spec, table, kernel="normal")
    hybrid = FabricParams.from_spec(spec, table, kernel="normal", library="hybrid-ep")
    assert deepep.library == "deepep"
    assert hybrid.kernel_latency_s == pytest.approx(0.5 * deepep.kernel_latency_s)
    assert hybrid.per_sm_GBps == pytest.approx(2 * deepep.per_sm_GBps)
    assert hybrid.row_cost_s == pytest.approx(deepep.row_cost_s / 2)
    nccl = FabricParams.from_spec(spec, table, library="hybrid-ep")
    assert nccl.phase_latency_s == FabricParams.from_spec(spec, table).phase_latency_s
    pplx = make_fabric("hgx-h100", 8, kernel="low-latency", library="pplx")
    assert "pplx's kernels" in pplx.describe()
    with pytest.raises(UsageError, match="library 'nvshmem-x' is not one of deepep"):
        make_fabric("hgx-h100", 8, kernel="normal", library="nvshmem-x")


def test_a_library_combine_has_its_own_fixed_latency_and_dispatch_keeps_its_own():
    # library.<name>.combine_latency_factor scales only a GPU-initiated combine's kernel latency: the same
    # bytes predict dispatch and combine apart by exactly that; nccl and DeepEP's own kernels are unchanged.
    table = {"library.trtllm.combine_latency_factor": 1.75}
    traffic = balanced_traffic(8, 1000.0)
    trt = _fabric_of(table, "low-latency", "trtllm")
    dispatch, combine = predict_phase(traffic, trt), predict_phase(traffic, trt, combine=True)
    assert combine.time_s - dispatch.time_s == pytest.approx(0.75 * trt.params.kernel_latency_s, rel=1e-9)
    assert dispatch.time_s == pytest.approx(
        trt.params.fixed_latency_s + max(dispatch.resource_time_s.values()), rel=1e-12
    )
    for kernel, library in (("nccl", "trtllm"), ("low-latency", "deepep")):
        other = _fabric_of(table, kernel, library)
        assert predict_phase(traffic, other, combine=True).time_s == predict_phase(traffic, other).time_s
    with pytest.raises(UsageError, match="combine_latency_factor must be > 0"):
        FabricParams(combine_latency_factor=0.0).validate()


def _fabric_of(table: dict, kernel: str, library: str):
    spec = load_spec("gb200-nvl72")
    return make_fabric(spec, 8, params=FabricParams.from_spec(spec, table, kernel=kernel, library=library))


def test_efa_message_cost_is_shared_by_the_nics_and_a_cuda_graph_drops_the_launch():
    traffic = balanced_traffic(16, B)
    base = {"rail_optimized": False, "kernel": "low-latency", "message_cost_s": 1e-6}
    one = make_fabric("hgx-h100", 16, transport="efa", **base)
    two = make_fabric("hgx-h100", 16, transport="efa", nics_per_gpu=2, **base)
    t1 = predict_phase(traffic, one, message_bytes=B / 100).time_s
    t2 = predict_phase(traffic, two, message_bytes=B / 100).time_s
    assert t1 - t2 == pytest.approx(8 * 100 * 1e-6 / 2, rel=1e-9)  # 800 messages, half the cost each
    assert one.params.scaleout_efficiency != make_fabric("hgx-h100", 16, **base).params.scaleout_efficiency
    graph = make_fabric("hgx-h100", 16, transport="efa", cuda_graph=True, **base)
    assert t1 - predict_phase(traffic, graph, message_bytes=B / 100).time_s == pytest.approx(
        one.params.launch_s
    )
    with pytest.raises(UsageError, match="transport 'tcp'"):
        make_fabric("hgx-h100", 16, transport="tcp")

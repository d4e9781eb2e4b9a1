from types import SimpleNamespace

import numpy as np
import pytest
import torch

from commbench.backends import get_backend
from commbench.backends.sim import SimBackend
from commbench.errors import UsageError
from commbench.fabric.model import balanced_traffic, make_fabric, predict_phase
from commbench.inputs.models import load_model
from commbench.inputs.skew import parse_skew
from commbench.traffic.plan import plan_balanced, plan_rank
from commbench.traffic.routing import RoutingConfig, route_rank


def _comm(rank: int, world: int) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu"))


def _ready(plans, options=None):
    backends = []
    for rank, plan in enumerate(plans):
        backend = SimBackend(_comm(rank, len(plans)), options)
        backend.setup_peers(plans)
        backend.setup(plan)
        backends.append(backend)
    return backends


def test_registry_and_labels():
    assert get_backend("sim") is SimBackend
    backend = SimBackend(_comm(0, 4), {"spec": "hgx-h100"})
    assert backend.emulated and "hgx-h100" in backend.label and "no data movement" in backend.label
    assert backend.knobs()["sim_spec"] == "hgx-h100" and backend.knobs()["sim_ranks_per_domain"] == 4


def test_balanced_time_is_the_fabric_model():
    world, size = 4, 64 * 1024
    plans = [plan_balanced(r, world, size) for r in range(world)]
    backends = _ready(plans, {"spec": "gb300-nvl72", "ranks_per_domain": "2"})
    fabric = make_fabric("gb300-nvl72", world, ranks_per_domain=2)
    expected = predict_phase(balanced_traffic(world, size // world), fabric)
    for rank, backend in enumerate(backends):
        received = backend.dispatch(torch.zeros(0), plans[rank], plans[rank].static_recv_counts)
        assert received.shape == (world, size // world) and received.dtype == torch.uint8
        assert backend.modelled_seconds() == pytest.approx(expected.time_s, rel=1e-12)
        assert backend.last_prediction.bottleneck_class == "scaleout"


def test_moe_shapes_counts_and_combine():
    model = load_model("qwen3-30b-a3b")
    world, tokens = 4, 32
    cfg = RoutingConfig(model=model, skew=parse_skew("uniform"), world_size=world, tokens_per_rank=tokens)
    plans = [plan_rank(route_rank(cfg, r), model, world) for r in range(world)]
    backends = _ready(plans, {"spec": "hgx-h100", "ranks_per_domain": 2, "pxn": "false"})
    rows = np.stack([p.send_counts.sum(1).numpy() for p in plans])
    for rank, backend in enumerate(backends):
        plan = plans[rank]
        recv_counts = backend.exchange_counts(plan.send_counts)
        assert recv_counts.shape == (world, 1) and recv_counts[:, 0].tolist() == rows[:, rank].tolist()
        received = backend.dispatch(torch.zeros(0), plan, recv_counts)
        assert received.shape == (int(rows[:, rank].sum()), plan.dispatch_row_bytes)
        dispatch_s = backend.modelled_seconds()
        assert dispatch_s > backend.phase_prediction("dispatch", plan).time_s  # + the counts exchange
        out = backend.combine(torch.zeros(received.shape[0], model.hidden), plan, recv_counts)
        assert out.shape == (tokens, model.hidden) and out.dtype == torch.float32
        assert backend.modelled_seconds() == backend.phase_prediction("combine", plan).time_s
    # Every rank reports the same phase time (the slowest resource of any rank).
    assert len({b.modelled_seconds() for b in backends}) == 1


def test_setup_needs_the_peers_and_options_are_checked():
    with pytest.raises(RuntimeError, match="setup_peers"):
        SimBackend(_comm(0, 2)).setup(plan_balanced(0, 2, 1024))
    with pytest.raises(UsageError, match="backend sim has no option.* bandwidth"):
        SimBackend(_comm(0, 2), {"bandwidth": 1})
    with pytest.raises(UsageError, match="true or false"):
        SimBackend.check_options({"pxn": "maybe"})
    with pytest.raises(UsageError, match="is not a number"):
        SimBackend.check_options({"nvlink_efficiency": "high"})
    parsed = SimBackend.check_options(
        {"nvlink_efficiency": "0.5", "phase_latency_us": "3", "rail_optimized": "no"}
    )
    assert parsed["nvlink_efficiency"] == 0.5 and parsed["phase_latency_us"] == 3.0
    assert parsed["rail_optimized"] is False and parsed["pxn"] is None  # None: the spec's value
    backend = SimBackend(_comm(0, 2), {"phase_latency_us": 3, "nvlink_efficiency": 0.5})
    assert backend.fabric.params.phase_latency_s == pytest.approx(3e-6)
    assert backend.fabric.params.nvlink_efficiency == 0.5


def _harness_entry(comm, jobs, opts):
    from commbench.backends import get_backend
    from commbench.run.harness import run_jobs

    return run_jobs(comm, jobs, opts, get_backend(opts.backend))


def test_harness_with_thread_ranks_reports_the_model():
    from commbench.run.config import RunOptions
    from commbench.run.jobs import BalancedJob, MoeJob
    from commbench.run.threads import run_threads

    world, size = 8, 1 << 16
    cfg = RoutingConfig(load_model("qwen3-30b-a3b"), parse_skew("uniform"), world, 32)
    jobs = [
        MoeJob("moe", routing=cfg, warmup=0, iters=2),
        BalancedJob("balanced", sizes=[size], warmup=0, iters=2),
    ]
    options = RunOptions("sim", {"spec": "gb200-nvl72", "ranks_per_domain": "4"})
    rows, _ = run_threads(world, _harness_entry, (jobs, options), timeout_s=120)
    assert [r["phase"] for r in rows] == ["dispatch", "combine", "alltoall"]
    for row in rows:
        assert row["emulated"] is True and row["sim_spec"] == "gb200-nvl72"
        assert row["wrong"] is None and row["check"] == "n/a"  # nothing moved: not verified, never 0
        assert row["time_us_p50"] == row["time_us_min"] > 0  # modelled: the same every iteration
    fabric = make_fabric("gb200-nvl72", world, ranks_per_domain=4)
    expected = predict_phase(balanced_traffic(world, size // world), fabric).time_s * 1e6
    assert rows[2]["time_us_p50"] == pytest.approx(expected, rel=1e-9)

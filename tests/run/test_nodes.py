"""--send-mode node on gloo (run.nodes): both stages run as all-to-alls on sub-groups, each phase and stage
timed, verified byte for byte and a row whose bytes are the node Pattern's; refusals before anything runs."""

from typing import ClassVar

import numpy as np
import pytest
import torch

from commbench.backends.mock import MockBackend
from commbench.backends.torchdist import TorchDistBackend
from commbench.errors import UsageError, VerificationError
from commbench.inputs.models import load_model
from commbench.inputs.skew import parse_skew
from commbench.run.config import RunOptions
from commbench.run.dist import launch
from commbench.run.harness import run_jobs
from commbench.run.jobs import MoeJob
from commbench.run.nodes import phase_matrix
from commbench.run.rows import byte_columns
from commbench.traffic.node_plan import group_ranks
from commbench.traffic.nodes import Nodes, node_phases
from commbench.traffic.pattern import build_pattern
from commbench.traffic.routing import RoutingConfig
from tests.launches import launch as cli_launch

BYTE_KEYS = ("size_bytes", "total_bytes", "self_bytes", "link_bytes", "max_send_bytes", "max_recv_bytes")


class StageBytes(TorchDistBackend):
    """gloo's all-to-all recording, per plan it was set up with (each stage's, in setup order), the bytes it
    received from each group member in dispatch and sent back to each in combine."""

    moved: ClassVar[list[dict[str, list[int]]]] = []

    def setup(self, plan):
        super().setup(plan)
        self.record: dict[str, list[int]] = {}
        StageBytes.moved.append(self.record)

    def dispatch(self, tokens, plan, recv_counts):
        received = super().dispatch(tokens, plan, recv_counts)
        self.record["dispatch"] = (recv_counts.sum(dim=1) * received.shape[1]).tolist()
        return received

    def combine(self, expert_out, plan, recv_counts):
        rows = recv_counts.sum(dim=1) * expert_out.shape[1] * expert_out.element_size()
        self.record["combine"] = rows.tolist()
        return super().combine(expert_out, plan, recv_counts)


def job(world, tokens=48):
    cfg = RoutingConfig(
        load_model("deepseek-v3"), parse_skew("zipf:1.2"), world, tokens, seed=1, mask_ratio=0.1
    )
    return MoeJob("deepseek-v3", cfg, "node", warmup=1, iters=3)


def node_entry(comm, jobs, opts):
    StageBytes.moved.clear()
    rows, rank_rows = run_jobs(comm, jobs, opts, StageBytes)
    moved = comm.all_gather_object(list(StageBytes.moved))
    detected = {}
    for phase in ("dispatch", "combine"):
        written: list[dict] = []
        try:
            sink = lambda r, rr, out=written: out.extend(r)  # noqa: E731
            run_jobs(comm, jobs, RunOptions("gloo", ranks_per_host=2, corrupt=phase), StageBytes, sink=sink)
        except VerificationError as exc:  # every rank, after the job's rows were written
            detected[phase] = (str(exc), [(r["phase"], r["wrong"]) for r in written])
    return rows, rank_rows, moved, detected


def test_gloo_world4_node_mode_stages_move_the_pattern_verified_and_corruption_is_counted_per_stage():
    jobs = [job(4)]
    opts = RunOptions("gloo", ranks_per_host=2)  # 2 hosts of 2 ranks, no fabric clique: 2 nodes
    rows, rank_rows, moved, detected = launch(
        4, node_entry, (jobs, opts), process_group="gloo", timeout_s=120
    )
    assert [r["phase"] for r in rows] == list(node_phases())
    assert all(r["wrong"] == 0 and r["check"] == "checksum" and r["send_mode"] == "node" for r in rows)
    assert all((r["num_domains"], r["ranks_per_domain"]) == (2, 2) for r in rows)
    nodes = Nodes.contiguous(4, 2)
    pattern = build_pattern(jobs[0].routing, "node", nodes)
    for row in rows:
        matrix = phase_matrix(pattern, row["phase"])
        assert {k: row[k] for k in BYTE_KEYS} == {k: byte_columns(matrix)[k] for k in BYTE_KEYS}, row["phase"]
        mine = sorted((r for r in rank_rows if r["phase"] == row["phase"]), key=lambda r: r["rank"])
        assert [r["sent_bytes"] for r in mine] == matrix.sum(axis=1).tolist()
    by_phase = {r["phase"]: r for r in rows}
    # The scale-out stage only crosses NICs, the NVLink stage never does; a phase row adds them up.
    for phase in ("dispatch", "combine"):
        scaleout, nvlink = by_phase[f"{phase}:scaleout"], by_phase[f"{phase}:nvlink"]
        assert scaleout["nvlink_bytes"] == 0 and scaleout["scaleout_bytes"] == scaleout["total_bytes"] > 0
        assert nvlink["scaleout_bytes"] == 0 and nvlink["nvlink_bytes"] > 0
        total = by_phase[phase]
        assert total["scaleout_bytes"] == scaleout["scaleout_bytes"]
        assert total["total_bytes"] == scaleout["total_bytes"] + nvlink["total_bytes"]
    token = build_pattern(jobs[0].routing, "token").dispatch_bytes
    between_nodes = token[np.ix_([0, 1], [2, 3])].sum() + token[np.ix_([2, 3], [0, 1])].sum()
    assert by_phase["dispatch:scaleout"]["total_bytes"] < between_nodes  # once per node, not per rank
    # What gloo moved on each sub-group is the Pattern's stage matrices (each rank: scale-out, then NVLink).
    for setup, stage in enumerate(("scaleout", "nvlink")):
        dispatch, combine = np.zeros((4, 4), np.int64), np.zeros((4, 4), np.int64)
        for rank in range(4):
            for member, received, sent in zip(
                group_ranks(nodes, rank, stage),
                moved[rank][setup]["dispatch"],
                moved[rank][setup]["combine"],
                strict=True,
            ):
                dispatch[member, rank] = received
                combine[rank, member] = sent
        assert np.array_equal(dispatch, pattern.stages["dispatch"][stage])
        assert np.array_equal(combine, pattern.stages["combine"][stage])
    # One flipped byte / changed element on rank 0 in each phase's last output: counted by that phase alone.
    message, written = detected["dispatch"]
    assert [w for p, w in written if p.startswith("dispatch")] == [1, 1, 1]
    assert [w for p, w in written if p.startswith("combine")] == [0, 0, 0]
    assert "dispatch:scaleout #wrong=1 bytes" in message and "combine" not in message
    message, written = detected["combine"]
    assert [w for p, w in written if p.startswith("combine")] == [1, 1, 1]
    assert "combine:nvlink #wrong=1 elements" in message


def test_gloo_world8_node_mode_from_the_cli(tmp_path):
    args = ["run", "--backend", "gloo", "--world-size", "8", "--ranks-per-host", "2", "--send-mode", "node"]
    args += ["--tokens", "16", "--warmup", "0", "--iters", "2"]
    run = cli_launch(args, tmp_path, codes=(0, 1))  # 1: a busy host's straggler may be flagged
    import pandas as pd

    results = pd.read_csv(run.out / "results.csv")
    assert results["phase"].tolist() == list(node_phases())
    assert (results["wrong"] == 0).all() and (results["send_mode"] == "node").all()
    assert (results["num_domains"] == 4).all()
    stage = results.set_index("phase")
    assert (
        stage.loc["dispatch:scaleout", "nvlink_bytes"] == 0
        and stage.loc["dispatch:nvlink", "scaleout_bytes"] == 0
    )
    assert "dispatch:scaleout" in (run.out / "summary.md").read_text()


def test_node_mode_needs_a_backend_that_runs_on_sub_groups():
    comm = type("Comm", (), {"rank": 0, "world_size": 4})()
    with pytest.raises(UsageError, match="--backend mock cannot"):
        run_jobs(comm, [job(4)], RunOptions("mock"), MockBackend)


def test_a_stages_steps_are_named_after_it_and_still_count_as_transfer():
    from commbench.run.nodes import _StageSteps
    from commbench.run.profile import is_transfer
    from commbench.run.steps import StepRecorder

    recorder = StepRecorder(torch.device("cpu"))
    recorder.begin()
    steps = _StageSteps(recorder, "scaleout", [0, 2])
    with steps("payload transfer"):
        steps.peer_arrival(1)  # group rank 1 is global rank 2
    recorder.end()
    (iteration,) = recorder.take()
    assert [name for name, _, _ in iteration.steps] == ["scaleout payload transfer"]
    assert list(iteration.peer_arrivals) == [2]
    assert is_transfer("scaleout payload transfer") and is_transfer("send-back")
    assert not is_transfer("forward") and not is_transfer("nvlink count exchange")

"""The decode case (issue 24 item 5): ``run --decode`` and the suite's decode case per model. The gloo run is
the shared ``decode_run`` launch (tests/conftest.py): it runs, is verified (#wrong 0) and appears in the
report and the verdict like any MoE case; gloo cannot be captured, so its rows say timing iteration."""

from __future__ import annotations

import pandas as pd
import pytest

from commbench.cli import run as cli_run
from commbench.errors import UsageError
from commbench.run.config import RunConfig
from commbench.run.graphs import DECODE_GRAPH_CALLS, with_graphs
from commbench.run.jobs import MoeJob
from tests.launches import Launch, not_failed_by_data_or_completion


def test_the_decode_run_is_verified_and_labelled_as_decode(decode_run: Launch) -> None:
    rows = pd.read_csv(decode_run.out / "results.csv")
    assert set(rows["phase"]) == {"dispatch", "combine"}
    assert set(rows["pattern"]) == {"small decode"}
    assert set(rows["tokens_per_rank"]) == {128} and set(rows["send_mode"]) == {"selection"}
    assert list(rows["wrong"]) == [0, 0]
    # gloo's calls cannot be captured: timed per iteration, and the rows say so.
    assert set(rows["timing"]) == {"iteration"} and rows["graph_calls"].isna().all()
    # A selection-mode dispatch moves a row per (token, expert) selection: 128 tokens x top-2 per rank.
    dispatch = rows[rows["phase"] == "dispatch"].iloc[0]
    assert dispatch["total_bytes"] == 2 * 128 * 2 * dispatch["row_bytes"]


def test_the_decode_case_is_in_the_report_and_the_verdict(decode_run: Launch) -> None:
    summary = (decode_run.out / "summary.md").read_text()
    assert "small decode" in summary
    verdict = decode_run.verdict()
    not_failed_by_data_or_completion(verdict)
    names = [element.name for element in verdict.elements if element.group == "moe"]
    assert any(name.startswith("small decode dispatch 128 tok/rank send selection") for name in names), names
    assert "small decode" in decode_run.stdout  # the console's MoE table


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"tokens": 64}, "--decode runs 128 tokens per rank; drop --tokens 64"),
        ({"send_mode": "node"}, "drop --send-mode node"),
        ({"pattern": "balanced"}, "--decode is an MoE case; drop --pattern balanced"),
    ],
)
def test_decode_refuses_what_contradicts_it(values: dict, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        RunConfig.from_options("run", {"world_size": 2, "decode": True, **values})


def test_the_suite_adds_one_decode_case_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list = []
    monkeypatch.setattr(cli_run, "launch", lambda config, jobs, plan, pairwise: launched.append((jobs, plan)))
    monkeypatch.setattr(cli_run, "check_jobs", lambda jobs, config: None)
    config = RunConfig.from_options("suite", {"world_size": 2, "quick": True, "models": ("deepseek-v3",)})
    cli_run.run_suite(config)
    jobs, plan = launched[0]
    decode = [job for job in jobs if isinstance(job, MoeJob) and job.decode]
    assert [job.name for job in decode] == ["deepseek-v3 decode"]
    assert decode[0].routing.tokens_per_rank == 128 and decode[0].send_mode == "selection"
    assert decode[0].routing.skew.text == "uniform" and plan["decode_tokens"] == 128
    # Timed as a CUDA graph where the backend can capture the decode case, per iteration elsewhere.
    from commbench.backends.shmem.nvshmem import NvshmemBackend
    from commbench.backends.torchdist import GlooBackend

    assert with_graphs(decode, GlooBackend, [{}], allowed=True)[0].timing == "iteration"
    graphed = with_graphs(decode, NvshmemBackend, [{"counts": "device"}], allowed=True)[0]
    assert (graphed.timing, graphed.graph_calls) == ("graph", DECODE_GRAPH_CALLS)
    assert with_graphs(decode, NvshmemBackend, [{"counts": "host"}], allowed=True)[0].timing == "iteration"
    assert with_graphs(decode, NvshmemBackend, [{"counts": "device"}], allowed=False)[0].timing == "iteration"

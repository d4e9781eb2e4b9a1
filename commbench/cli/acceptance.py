"""The acceptance verdict of ``run`` and ``suite``: the spec chosen from the hardware, the limits and
baseline checked before launch, slow ranks confirmed by rerunning their cases inside the launch, and the
judge that turns what finished into verdict.json and junit.xml.

Slow ranks: every rank records, per timed call, its arrival (host time from the call's common start until it
entered the call: ``run.harness``); the report's outlier rule (``report.outliers``) runs over each case's
per-rank p50 arrival. A flagged case is rerun ``spread.confirm_reruns`` times in the same launch (all ranks
take part; nothing of the reruns is written to results.csv) and the flag is FAIL only when it repeats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from commbench.inputs.layout import Layout
    from commbench.inputs.limits import Limits
    from commbench.inputs.specs import SystemSpec
    from commbench.report.judge.outliers import CaseSpread, SpreadOutcome
    from commbench.report.judge.verdict import Element, RunStatus, Verdict
    from commbench.run.config import AcceptanceConfig, RunOptions
    from commbench.run.jobs import Job

ARRIVAL_COLUMN = "arrival_us_p50"


@dataclass(frozen=True)
class Acceptance:
    """What a launch is judged by (handed to every rank): the spec whose limits apply (None: no bandwidth
    judged), how it was chosen, the limits (the spec's shipped ones with the user's file and overrides laid
    over them) and the baseline, each read and checked once, in the launching process (``load``)."""

    spec: SystemSpec | None
    spec_how: str
    limits: Limits
    baseline: dict[str, Any] | None
    files: AcceptanceConfig
    baseline_warn_pct: float = 5.0
    baseline_fail_pct: float = 10.0

    @classmethod
    def load(
        cls, files: AcceptanceConfig, spec: SystemSpec | None, spec_how: str, chosen: str | None
    ) -> Acceptance:
        """Read the limits (of ``chosen``: the catalogue name or file the spec came from) and the baseline of
        ``files`` (UsageError, one line, for a bad file or override: before anything launches)."""
        from commbench.inputs.limits import load_limits
        from commbench.report.judge.baseline import read_baseline

        limits = load_limits(chosen if spec is not None else None, files.limits, files.limit)
        baseline = read_baseline(files.baseline) if files.baseline else None
        return cls(spec, spec_how, limits, baseline, files)

    def to_meta(self) -> dict[str, Any]:
        return {
            "spec": self.spec.name if self.spec is not None else None,
            "how_chosen": self.spec_how,
            "limits_file": self.files.limits,
            "limit_overrides": list(self.files.limit),
            "baseline_file": self.files.baseline,
            "baseline_warn_pct": self.baseline_warn_pct,
            "baseline_fail_pct": self.baseline_fail_pct,
        }


def unfinished_judge(meta: dict[str, Any]) -> Any:
    """The judge of a launch's folder that no process of the run got to finish (killed whole: no verdict, no
    INCOMPLETE mark; ``report.render_folder``): the acceptance meta.json records (the spec's limits, the
    limits file and overrides, the baseline) read again, the run INCOMPLETE. A limits or baseline file that
    cannot be read now is left out (said on stderr): the verdict still says what finished."""
    import click

    from commbench.errors import UsageError
    from commbench.report import spec_from_meta
    from commbench.report.folder.reading import incomplete_reason
    from commbench.report.judge.verdict import RunStatus
    from commbench.run.config import AcceptanceConfig

    saved = meta.get("acceptance") if isinstance(meta.get("acceptance"), dict) else {}
    chosen = saved.get("spec") if isinstance(saved.get("spec"), str) else None
    spec = spec_from_meta(meta) if chosen is not None else None
    how = str(saved.get("how_chosen") or "")
    overrides = saved.get("limit_overrides")
    files = AcceptanceConfig(
        spec=chosen,
        limits=saved.get("limits_file") if isinstance(saved.get("limits_file"), str) else None,
        limit=tuple(str(item) for item in overrides) if isinstance(overrides, list) else (),
        baseline=saved.get("baseline_file") if isinstance(saved.get("baseline_file"), str) else None,
    )
    try:
        acceptance = Acceptance.load(files, spec, how, chosen)
    except UsageError as exc:
        click.echo(f"commbench: judged by the shipped limits alone: {exc}", err=True)
        acceptance = Acceptance.load(AcceptanceConfig(spec=chosen), spec, how, chosen)
    return make_judge(acceptance, RunStatus("incomplete", incomplete_reason(meta) or ""))


def choose_report_spec(spec_text: str | None, backend: str) -> tuple[SystemSpec, str, str | None]:
    """(the spec the report compares with, how it was chosen, the spec the verdict judges by). No --spec:
    detected from the GPUs (``inputs.spec_choice``); no GPU or an unknown one: ``no_spec``, no %spec. Only
    a backend whose figures are a GPU fabric's (its class's ``gpu_fabric``: nccl, nvshmem, the dispatcher
    adapters) is judged; on any other (gloo, shmem-emu, mock, sim) bandwidth is never judged, whatever --spec
    says: the verdict checks data, completion, the harness and the rank spread only."""
    import torch

    from commbench.backends import get_backend
    from commbench.hardware.probes import probe_gpus
    from commbench.inputs.spec_choice import choose_spec, facts_from_probe
    from commbench.inputs.specs import load_spec, no_spec

    facts = facts_from_probe(probe_gpus(), torch.cuda.device_count())
    choice = choose_spec(facts, spec_text)
    spec = load_spec(choice.name) if choice.name else no_spec(choice.how)
    if not get_backend(backend).gpu_fabric:
        what = "" if choice.name is None else f"; the report compares with {choice.name} as a what-if"
        return spec, f"{backend} run on CPU: bandwidth not judged ({choice.how}){what}", None
    return spec, choice.how, choice.name


def rank_names(layout: Layout) -> dict[int, str]:
    """rank -> "host h2, GPU 1 [0000:19:00], pid 7, NVLink domain 0" for the verdict's messages (a CPU rank:
    "host h2, CPU, pid 7, emulated NVLink domain 0")."""
    names = {}
    for rank, place in enumerate(layout.places):
        where = (
            f"GPU {place.device}" + (f" [{place.bus_id}]" if place.bus_id else "")
            if place.device >= 0
            else "CPU"
        )
        domain = int(layout.domain_of_rank[rank]) if rank < layout.world_size else -1
        # CPU ranks have no NVLink: their domain is the layout's emulated one (--ranks-per-domain).
        kind = "NVLink domain" if place.device >= 0 else "emulated NVLink domain"
        names[rank] = f"host {place.host}, {where}, pid {place.pid}, {kind} {domain}"
    return names


def arrival_spreads(rank_rows: Sequence[dict[str, Any]], limits: Limits) -> list[CaseSpread]:
    """The outlier rule over each measured case's per-rank p50 arrival (us): one per ``Case`` and repeat."""
    import pandas as pd

    from commbench.report.judge.outliers import outliers_by_case

    if not rank_rows:
        return []
    return outliers_by_case(pd.DataFrame(list(rank_rows)), ARRIVAL_COLUMN, limits.spread, metric="arrival")


def _rerun_jobs(
    jobs: Sequence[Job], rank_rows: Sequence[dict[str, Any]], cases: set[tuple[Any, ...]]
) -> list[Job]:
    """The jobs that measure ``cases`` (``Case.repeat_key``s) again: a balanced job cut to the flagged
    sizes, an MoE job whole."""
    from commbench.run.case import Case

    wanted: dict[int, list[int]] = {}
    for row in rank_rows:
        case = Case.from_row(row)
        if case.repeat_key in cases:
            sizes = wanted.setdefault(int(row["job_index"]), [])
            if case.phase == "alltoall" and case.size_bytes is not None and case.size_bytes not in sizes:
                sizes.append(case.size_bytes)
    reruns = []
    for index, sizes in wanted.items():
        job = jobs[index]
        reruns.append(replace(job, sizes=sizes) if job.kind == "balanced" else job)
    return reruns


def confirm_slow_ranks(
    comm: Any, jobs: Sequence[Job], opts: RunOptions, backend_class: type, layout: Layout,
    rank_rows: Sequence[dict[str, Any]], acceptance: Acceptance,
) -> list[SpreadOutcome]:  # fmt: skip
    """Collective: rank 0 judges the arrival spread of every case; every rank reruns the flagged cases
    ``confirm_reruns`` times; rank 0 returns one outcome per case (others: [])."""
    from commbench.run.harness import run_jobs

    plan: tuple[list[tuple[Any, ...]], list[Job], int] | None = None
    firsts: list[CaseSpread] = []
    limits = acceptance.limits if comm.rank == 0 else None  # only rank 0 judges
    if limits is not None:
        from commbench.report.judge.outliers import confirm, needs_rerun  # pandas: the judging rank only

        firsts = arrival_spreads(rank_rows, limits)
        flagged = list(dict.fromkeys(spread.key for spread in needs_rerun(firsts, limits.spread)))
        jobs_again = _rerun_jobs(jobs, rank_rows, set(flagged)) if flagged else []
        plan = (flagged, jobs_again, limits.spread.confirm_reruns if jobs_again else 0)
    flagged_cases, jobs_again, reruns = comm.all_gather_object(plan)[0]
    rerun_spreads: dict[tuple[Any, ...], list[CaseSpread]] = {case: [] for case in flagged_cases}
    rerun_opts = replace(opts, imbalance_cost=False, profile=False)  # only the flagged phases themselves
    for _ in range(reruns):
        _, again = run_jobs(comm, jobs_again, rerun_opts, backend_class, None, layout)
        if limits is not None:
            for spread in arrival_spreads(again, limits):
                if spread.key in rerun_spreads:
                    rerun_spreads[spread.key].append(spread)
    if limits is None:
        return []
    planted = {delay.src for delay in opts.inject_delay if delay.dst is None}
    return [
        confirm(
            first, rerun_spreads.get(first.key, []), limits.spread, cpu_run=limits.cpu_run, planted=planted
        )
        for first in firsts
    ]


def make_judge(
    acceptance: Acceptance,
    run: RunStatus,
    outcomes: Sequence[SpreadOutcome] = (),
    names: dict[int, str] | None = None,
    extra_elements: Sequence[Element] = (),
) -> Any:
    """The report's ``Judge``: (results frame, rank frame, meta) -> the Verdict of this run.
    ``extra_elements``: checks judged in the launch (pairwise link test, GPU health, soak); with a pairwise
    test, a "bisect" element says whether slow all-to-all cases come from a slow pair or not."""

    def judge(frame: pd.DataFrame, ranks: pd.DataFrame, meta: dict[str, Any]) -> Verdict:
        from commbench.report.judge.outliers import timing_status
        from commbench.report.judge.verdict import Element, build_verdict

        limits, spec, baseline = acceptance.limits, acceptance.spec, acceptance.baseline
        extra = []
        if baseline is not None and not frame.empty:
            from commbench.report.judge.compare import compare_to_baseline

            findings = compare_to_baseline(
                frame, baseline, acceptance.baseline_warn_pct, acceptance.baseline_fail_pct
            )
            for finding in findings:
                fields = finding.element()
                status, message = timing_status(
                    fields["status"], fields["message"], limits.cpu_run, planted=False
                )
                extra.append(
                    Element(
                        group="baseline", name=fields["name"], status=status, message=message,
                        measured=fields["value"], limit=fields["limit"], unit=fields["unit"] or "",
                        remedy=fields["remedy"] or "",
                    )
                )  # fmt: skip
        extra += list(extra_elements)
        from commbench.report.analysis.soak import soak_elements

        extra += soak_elements(frame, limits)
        verdict = build_verdict(frame, limits, spec, acceptance.spec_how, run, outcomes, names or {}, extra)
        from commbench.report.judge.pairs import bisect_element

        bisect = bisect_element(verdict.elements)
        if bisect is None:
            return verdict
        return build_verdict(
            frame, limits, spec, acceptance.spec_how, run, outcomes, names or {}, [*extra, bisect]
        )

    return judge

"""Communication time and comm/compute overlap from Kineto traces.

The synthetic traces in tests/data/kineto_overlap (numbers worked out by hand below), the interval sweep,
measured marks, bad files."""

from __future__ import annotations

import gzip
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.report.pages.render import markdown_page
from commbench.report.profiler import kineto_overlap
from commbench.report.profiler.kineto_overlap import (
    WINDOW_MEASURED,
    WINDOW_WHOLE,
    covered_time,
    load_trace,
    overlap_from_folder,
    overlap_from_traces,
    overlap_section,
    overlap_table,
    trace_files,
    union_segments,
)
from commbench.run.torch_profiler import MEASURED_PREFIX

DATA = Path(__file__).resolve().parents[2] / "data" / "kineto_overlap"


def _row(frame, **match):
    rows = frame
    for key, value in match.items():
        rows = rows[rows[key] == value]
    assert len(rows) == 1, match
    return rows.iloc[0]


def test_recorded_two_rank_traces():
    """rank0.json (GPU 0, microseconds):
    compute: [100,150] twice (identical, streams 7 and 8), [200,300] with [210,220] nested in it, a look-alike
      fused_ncclDevKernel_pack [440,470], a device-to-device copy [500,510], a fill [600,604]
      -> union 50 + 100 + 30 + 10 + 4 = 194
    communication: NCCL SendRecv [120,180], DeepEP intranode dispatch [250,350], commbench put [400,440] and
      wait [430,460] (overlapping each other), a peer copy [505,525] -> union 60 + 100 + 60 + 20 = 240
    overlap: [120,150] 30 + [250,300] 50 + [440,460] 20 + [505,510] 5 = 105; exposed 135; 105/240 = 43.75 %
    The gpu_user_annotation range [100,604], CPU ops, launches and flow events are not GPU work.

    rank1.json (no distributedInfo: the rank is in the file name; Kineto-sized timestamps):
    NCCL ncclKernel_AllReduce [0,100] exactly over a fill kernel [0,100]; DeepEP get_dispatch_layout (compute)
    [150,160]; DeepEP internode_ll combine [200,300] alone -> comm 200, compute 110, overlap 100, 50 %."""
    result = overlap_from_folder(DATA)
    assert list(result.ranks["rank"]) == [0, 1]

    rank0 = _row(result.ranks, rank=0)
    assert rank0["window"] == WINDOW_WHOLE and rank0["file"] == "rank0.json"
    assert (rank0["gpus"], rank0["gpu_events"], rank0["comm_events"]) == (1, 12, 5)
    assert rank0["comm_us"] == pytest.approx(240.0)
    assert rank0["compute_us"] == pytest.approx(194.0)
    assert rank0["overlap_us"] == pytest.approx(105.0)
    assert rank0["exposed_comm_us"] == pytest.approx(135.0)
    assert rank0["overlap_pct"] == pytest.approx(43.75)

    rank1 = _row(result.ranks, rank=1)
    assert (rank1["gpu_events"], rank1["comm_events"]) == (4, 2)
    assert (rank1["comm_us"], rank1["compute_us"], rank1["overlap_us"]) == pytest.approx(
        (200.0, 110.0, 100.0)
    )
    assert (rank1["exposed_comm_us"], rank1["overlap_pct"]) == pytest.approx((100.0, 50.0))

    # per library: (comm, overlapped, exposed, %)
    expected = {
        (0, "nccl"): (60, 30, 30, 50.0),
        (0, "deepep"): (100, 50, 50, 50.0),
        (0, "commbench"): (60, 20, 40, 100 / 3),
        (0, "memcpy"): (20, 5, 15, 25.0),
        (1, "nccl"): (100, 100, 0, 100.0),
        (1, "deepep"): (100, 0, 100, 0.0),
    }
    got = {
        (row.rank, row.library): (row.comm_us, row.overlap_us, row.exposed_comm_us, row.overlap_pct)
        for row in result.libraries.itertuples()
    }
    assert got.keys() == expected.keys()
    for key, values in expected.items():
        assert got[key] == pytest.approx(values), key
    assert _row(result.libraries, rank=0, library="commbench")["events"] == 2


def test_kernel_summary_says_how_each_name_was_classified():
    kernels = overlap_from_folder(DATA).kernels
    look_alike = kernels[kernels["name"].str.contains("fused_ncclDevKernel_pack")].iloc[0]
    assert (look_alike["library"], look_alike["kind"]) == ("other", "compute")
    layout = kernels[kernels["name"].str.contains("get_dispatch_layout")].iloc[0]
    assert (layout["library"], layout["kind"], layout["total_us"]) == ("deepep", "compute", 10.0)
    peer = _row(kernels, name="Memcpy PtoP (Device -> Device)")
    assert (peer["library"], peer["kind"]) == ("memcpy", "communication")
    assert list(kernels["total_us"]) == sorted(kernels["total_us"], reverse=True)
    assert int(kernels["events"].sum()) == 16


def test_table_shows_each_rank_and_its_libraries():
    table = overlap_table(overlap_from_folder(DATA)).text().splitlines()
    assert len(table) == 3
    assert "overlap(%)" in table[0]
    assert "43.8" in table[1] and "commbench 60.0, deepep 100.0, memcpy 20.0, nccl 60.0" in table[1]


def test_the_section_holds_the_note_and_the_rank_table() -> None:
    page = markdown_page([overlap_section(overlap_from_folder(DATA))])
    assert page.startswith("## Communication kernels and their overlap with compute (torch.profiler)\n")
    header = next(line for line in page.splitlines() if line.startswith("| rank"))
    assert "registry of names" in page and [cell.strip() for cell in header.split("|")[1:3]] == [
        "rank",
        "window",
    ]


def test_gzip_trace_reads_the_same(tmp_path):
    plain = overlap_from_traces([DATA / "rank1.json"]).ranks
    packed = tmp_path / "rank1.json.gz"
    packed.write_bytes(gzip.compress((DATA / "rank1.json").read_bytes()))
    assert overlap_from_traces([packed]).ranks.drop(columns="file").equals(plain.drop(columns="file"))


def _write(path: Path, events: list[dict], **extra) -> Path:
    path.write_text(json.dumps({"traceEvents": events, **extra}), encoding="utf-8")
    return path


def _kernel(name: str, ts: float, dur: float, stream: int = 7, correlation: int | None = None) -> dict:
    args = {"device": 0, "stream": stream}
    if correlation is not None:
        args["correlation"] = correlation
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


NCCL = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n"


@pytest.mark.parametrize(
    "events",
    [
        [],  # an empty trace
        [  # CPU work only, as torch.profiler writes on a machine without a GPU
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "c10d::alltoall_base_",
                "pid": 9,
                "tid": 9,
                "ts": 1,
                "dur": 5,
            },
            {"ph": "i", "name": "Record Window End", "pid": "", "tid": "", "ts": 9},
        ],
    ],
)
def test_no_gpu_events_means_zero_time_and_no_percentage(tmp_path, events):
    row = overlap_from_traces([_write(tmp_path / "rank3.json", events)]).ranks.iloc[0]
    assert row["rank"] == 3 and row["gpu_events"] == 0 and row["gpus"] == 0
    assert (row["comm_us"], row["compute_us"], row["overlap_us"], row["exposed_comm_us"]) == (0, 0, 0, 0)
    assert math.isnan(row["overlap_pct"])  # n/a, never 0 %


def test_nested_and_identical_communication_counts_once(tmp_path):
    events = [
        _kernel(NCCL, 0, 100, stream=20),
        _kernel(NCCL, 0, 100, stream=21),  # identical
        _kernel(NCCL, 10, 20, stream=22),  # nested
        _kernel(GEMM, 90, 20),  # overlaps the last 10 us
    ]
    row = overlap_from_traces([_write(tmp_path / "rank0.json", events)]).ranks.iloc[0]
    assert (row["comm_us"], row["compute_us"], row["overlap_us"]) == pytest.approx((100, 20, 10))
    assert row["overlap_pct"] == pytest.approx(10.0)


def test_measured_marks_keep_only_what_the_measured_calls_launched(tmp_path):
    """The mark spans [1000, 1100]. Counted: a kernel launched inside it that runs after it ends, and a kernel
    whose launch the trace lacks but that starts inside. Not counted: a kernel launched before the mark that
    runs inside it (warm-up), and a kernel without a launch that starts after (a check)."""
    launch = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9, "ts": ts, "dur": 2,
         "args": {"cbid": 211, "correlation": correlation}}
        for ts, correlation in ((1050, 1), (900, 2))
    ]  # fmt: skip
    events = [
        {"ph": "X", "cat": "user_annotation", "name": MEASURED_PREFIX + "dispatch", "pid": 9, "tid": 9,
         "ts": 1000, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "a range", "pid": 9, "tid": 9, "ts": 0, "dur": 9000},
        {"ph": "X", "cat": "gpu_user_annotation", "name": MEASURED_PREFIX + "dispatch", "pid": 0, "tid": 1,
         "ts": 1120, "dur": 80},
        *launch,
        _kernel(NCCL, 1120, 80, stream=20, correlation=1),  # launched inside, runs after the mark
        _kernel(GEMM, 1010, 20, correlation=2),  # launched before the mark
        _kernel(GEMM, 1060, 10, correlation=3),  # no launch in the trace, starts inside
        _kernel(GEMM, 1500, 10),  # no launch, starts after
    ]  # fmt: skip
    row = overlap_from_traces([_write(tmp_path / "rank0.json", events)]).ranks.iloc[0]
    assert row["window"] == WINDOW_MEASURED
    assert (row["gpu_events"], row["comm_events"]) == (2, 1)
    assert (row["comm_us"], row["compute_us"], row["overlap_us"]) == pytest.approx((80, 10, 0))


def test_interval_sweep_matches_a_brute_force_count():
    rng = np.random.default_rng(7)
    for _ in range(50):
        a_start, b_start = rng.integers(0, 200, 40), rng.integers(0, 200, 25)
        a_end, b_end = a_start + rng.integers(0, 30, 40), b_start + rng.integers(0, 30, 25)
        grid = np.arange(0, 240)  # unit cells [t, t + 1)
        in_a = ((a_start[:, None] <= grid) & (grid < a_end[:, None])).any(axis=0)
        in_b = ((b_start[:, None] <= grid) & (grid < b_end[:, None])).any(axis=0)
        got = covered_time(a_start, a_end, b_start, b_end)
        assert got == (in_a.sum(), in_b.sum(), (in_a & in_b).sum())
        segments = union_segments(a_start, a_end)
        assert (segments[:, 1] - segments[:, 0]).sum() == in_a.sum()
        assert np.all(segments[1:, 0] > segments[:-1, 1])  # disjoint, sorted


def test_interval_sweep_is_not_quadratic():
    rng = np.random.default_rng(1)
    starts = rng.uniform(0, 1e7, 400_000)
    began = time.perf_counter()
    comm, compute, both = covered_time(starts, starts + 5.0, starts + 2.5, starts + 7.5)
    assert time.perf_counter() - began < 5.0  # about 0.1 s; a pairwise method would take hours
    assert 0 < both <= min(comm, compute)


def test_two_files_of_one_rank_are_refused(tmp_path):
    first = _write(tmp_path / "a.json", [], distributedInfo={"rank": 2})
    second = _write(tmp_path / "b.json", [], distributedInfo={"rank": 2})
    with pytest.raises(UsageError, match="rank 2 again"):
        overlap_from_traces([first, second])


def test_trace_folder_lists_rank_files_in_rank_order(tmp_path):
    for name in ("rank10.json", "rank2.json.gz", "rank0.json", ".rank1.json.ab12.tmp", "notes.json"):
        (tmp_path / name).write_text("{}", encoding="utf-8")
    assert [path.name for path in trace_files(tmp_path)] == ["rank0.json", "rank2.json.gz", "rank10.json"]
    with pytest.raises(UsageError, match="not found"):
        trace_files(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no rank<R>.json"):
        trace_files(tmp_path / "empty")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'{"traceEvents": [', "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b'{"events": []}', "no traceEvents list"),
        (b"42", "no traceEvents list"),
        (
            b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "soon", "dur": 1}]}',
            "numeric 'ts'",
        ),
        (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1}]}', "numeric 'dur'"),
        (gzip.compress(b'{"traceEvents": []}', mtime=0)[:-12], "gzip"),
        (b"\x1f\x8bnot gzip at all", "broken gzip"),
    ],
)
def test_bad_files_are_one_line_usage_errors_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "rank0.json"
    path.write_bytes(content)
    with pytest.raises(UsageError) as caught:
        overlap_from_traces([path])
    message = str(caught.value)
    assert problem in message and "rank0.json" in message and "\n" not in message


def test_gzip_bomb_stops_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(kineto_overlap, "MAX_TRACE_BYTES", 1 << 20)  # the real limit, scaled down to 1 MiB
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(b" " * (3 << 20), compresslevel=9))
    assert path.stat().st_size < 16 << 10
    with pytest.raises(UsageError, match="more than 1 MiB once decompressed"):
        load_trace(path)
    path.write_bytes(gzip.compress(b'{"traceEvents": []}' + b" " * ((1 << 20) - 100)))
    assert load_trace(path) == {"traceEvents": []}  # just under the limit


def test_a_folder_is_not_a_trace(tmp_path):
    with pytest.raises(UsageError, match="is a folder"):
        load_trace(tmp_path)
    shutil.rmtree(tmp_path)
    with pytest.raises(UsageError, match="not found"):
        load_trace(tmp_path / "rank0.json")

"""report.console: stdout as nccl-tests' alltoall_perf prints it for the balanced rows, then the MoE table."""

from __future__ import annotations

import pytest

from commbench.inputs.specs import load_spec
from commbench.report import ReportWriter, average_bus_bandwidth, results_frame, results_table
from commbench.report.pages.console import (
    bus_id_cell,
    moe_table,
    nccl_float,
    nccl_version_code,
    rank_lines,
)
from tests.report.rows import balanced_row, skewed_rows

GB300 = load_spec("gb300-nvl72")

# nccl-tests 2.19.6 src/util.cu writeResultHeader (no per-iteration timing, no timestamps), as printf writes
# it (trailing blanks stripped).
NCCL_TESTS_HEADER = [
    "#" + " " * 62 + "out-of-place" + " " * 23 + "in-place",
    "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw"
    "   busbw  #wrong",
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)"
    "  (GB/s)",
]
# nccl-tests 2.19.6 src/util.cu writeBenchmarkLinePreamble and writeBenchmarkLineBody, as C printf formats
# (Python's % operator takes them as they are): the row preamble, a checked group and an unchecked one.
PREAMBLE = "%12li  %12li  %8s  %6s  %6s"
CHECKED = "  %7s  %6s  %6s  %6g"
UNCHECKED = "  %7s  %6s  %6s    N/A"
IN_PLACE_NOT_RUN = UNCHECKED % ("N/A", "N/A", "N/A")

META = {
    "commbench_version": "9.9.9",
    "args": {"min_bytes": 4096, "max_bytes": 8192, "step_factor": 2.0, "warmup": 5, "iters": 20},
    "topology": {
        "places": [
            {
                "host": "node-a",
                "pid": 4242,
                "device": 0,
                "bus_id": "00000000:19:00.0",
                "gpu_name": "NVIDIA H200",
            },
            {"host": "node-a", "pid": 4243, "device": 1, "bus_id": "0000:3B:00", "gpu_name": "NVIDIA H200"},
            {"host": "cpu-host", "pid": 77, "device": -1, "bus_id": "", "gpu_name": ""},
            {"host": "old-folder", "gpu_uuid": "GPU-1"},  # written before ranks said their pid and device
        ]
    },
}


def balanced(check: str = "checksum", **extra) -> list[dict]:
    """Two sizes of 4 ranks: mean 11 and 20 us, p50 10 and 12 us (nccl-tests prints the mean)."""
    return [
        balanced_row(4, 4096, 10.0, time_us_mean=11.0, check=check, **extra),
        balanced_row(4, 8192, 12.0, time_us_mean=20.0, check=check, **extra),
    ]


def lines_of(text: str) -> list[str]:
    return text.splitlines()


def test_balanced_rows_print_nccl_tests_layout() -> None:
    text = results_table(results_frame(balanced(), GB300), META)
    lines = lines_of(text)
    assert lines[1] == "# Collective test starting: commbench balanced alltoall"
    assert lines[2] == (
        "# nThread 1 nGpus 1 minBytes 4096 maxBytes 8192 step: 2(factor) warmup iters: 5 iters: 20 "
        "agg iters: 1 validation: 1 graph: 0 unalign: 0"
    )
    assert lines[0] == (
        "# nccl-tests version 2.19.6 (output format only: this is commbench 9.9.9, not nccl-tests) "
        "nccl-headers=0 nccl-library=0"
    )
    assert lines[3].startswith("# commbench: backend gloo; 4 ranks")
    # Rows of gloo without an in-place time: a folder of an earlier commbench (gloo runs it in place now).
    assert "# in-place: N/A for gloo: not in this report: written before commbench ran it" in lines
    start = lines.index(NCCL_TESTS_HEADER[0])
    assert lines[start - 1] == "#" and lines[start : start + 3] == NCCL_TESTS_HEADER
    # size 4096 over 4 ranks: 1024 uint8 elements to each peer; time = the mean (11 us), not p50 (10 us);
    # algbw = 4096 B / 11 us = 0.372 GB/s, busbw = x 3/4 = 0.279 GB/s.
    assert lines[start + 3] == (
        "        4096          1024     uint8    none      -1    11.00    0.37    0.28       0"
        + IN_PLACE_NOT_RUN
    )
    assert lines[start + 3] == PREAMBLE % (4096, 1024, "uint8", "none", "    -1") + CHECKED % (
        "  11.00", "  0.37", "  0.28", 0
    ) + IN_PLACE_NOT_RUN  # fmt: skip
    assert lines[start + 4] == (
        "        8192          2048     uint8    none      -1    20.00    0.41    0.31       0"
        + IN_PLACE_NOT_RUN
    )
    average = (4096 / 11e-6 + 8192 / 20e-6) / 2 / 1e9 * 3 / 4
    assert lines[start + 5] == "# Out of bounds values : 0 OK"
    assert lines[start + 6] == f"# Avg bus bandwidth    : {average:g}"
    assert lines[start + 7] == "# Total #wrong         : 0"
    assert lines[-2:] == ["#", "# Collective test concluded: commbench balanced alltoall"]
    assert "# pattern" not in text  # no MoE rows: no MoE table
    assert not [line for line in lines if line != line.rstrip()]


def test_header_says_timing_check_and_in_place_not_run() -> None:
    text = results_table(results_frame(balanced(timing="window", check="window-last"), GB300), META)
    assert "# timing: window (as nccl-tests: the timed iterations back to back in one window" in text
    assert "# time = the max across ranks of window / iterations" in text
    assert "# check: window-last (receive buffers poisoned once before the timed window" in text
    iteration = results_table(results_frame(balanced(), GB300), META)
    assert "# timing: iteration (a barrier before each timed iteration" in iteration
    assert "# time = the mean over the timed iterations of each iteration's max across ranks" in iteration


def test_the_in_place_group_holds_the_in_place_run_and_rows_end_where_nccl_tests_does() -> None:
    """In-place time 8 us for 4096 B on 4 ranks: algbw 0.51, busbw 0.38 GB/s, #wrong N/A (never checked,
    as nccl-tests' in-place alltoall): the row ends at column 117, as alltoall_perf's rows do."""
    rows = balanced(in_place_time_us_mean=8.0)
    rows[1]["in_place_time_us_mean"] = 16.0
    text = results_table(results_frame(rows, GB300), META)
    lines = lines_of(text)
    row = next(line for line in lines if line.startswith("        4096"))
    assert row == PREAMBLE % (4096, 1024, "uint8", "none", "    -1") + CHECKED % (
        "  11.00", "  0.37", "  0.28", 0
    ) + UNCHECKED % ("   8.00", "  0.51", "  0.38")  # fmt: skip
    assert len(row) == 117
    assert (
        "# in-place: the same exchange with one buffer as its input and output (nccl-tests' in-place" in text
    )
    assert not [line for line in lines if line.startswith("# in-place: N/A")]
    # nccl-tests' footer averages the in-place rows in: four busbw figures.
    figures = [4096 / 11e-6, 8192 / 20e-6, 4096 / 8e-6, 8192 / 16e-6]
    average = sum(figures) / 4 / 1e9 * 3 / 4
    assert f"# {'Avg bus bandwidth':<20} : {average:g}" in lines


def test_rank_lines_follow_nccl_tests_using_devices() -> None:
    assert rank_lines(META) == [
        "#  Rank  0 Group  0 Pid   4242 on     node-a device  0 [0000:19:00] NVIDIA H200",
        "#  Rank  1 Group  0 Pid   4243 on     node-a device  1 [0000:3b:00] NVIDIA H200",
        "#  Rank  2 Group  0 Pid     77 on   cpu-host device -1 [cpu] CPU",
        "#  Rank  3 Group  0 Pid      ? on old-folder device  ? [?] ?",
    ]
    text = lines_of(results_table(results_frame(balanced(), GB300), META))
    using = text.index("# Using devices")
    assert text[using - 1] == "#" and text[using + 1 : using + 5] == rank_lines(META)
    assert rank_lines({}) == ["#  (rank places not recorded in this report)"]


@pytest.mark.parametrize(
    ("bus_id", "shown"),
    [
        ("00000000:19:00.0", "0000:19:00"),
        ("0001:C1:00.0", "0001:c1:00"),
        ("19:00", "0000:19:00"),
        ("not-a-bus-id", "not-a-bus-id"),
        ("", None),
    ],
)
def test_bus_id_as_nccl_tests_prints_it(bus_id: str, shown: str | None) -> None:
    assert bus_id_cell(bus_id) == shown


@pytest.mark.parametrize(
    ("version", "code"),
    [("2.27.3", 22703), ("2.21.5", 22105), ("2.8.4", 2804), ("3.0", 30000), (None, None), ("cpu", None)],
)
def test_nccl_version_codes_are_nccls(version: str | None, code: int | None) -> None:
    """NCCL_VERSION(X, Y, Z): X * 10000 + Y * 100 + Z from 2.9 on, X * 1000 + Y * 100 + Z before."""
    assert nccl_version_code(version) == code


def test_the_version_line_names_the_nccl_torch_loaded() -> None:
    meta = {**META, "env": {"versions": {"nccl": "2.27.3"}}}
    first = results_table(results_frame(balanced(), GB300), meta).splitlines()[0]
    assert first.endswith(") nccl-headers=22703 nccl-library=22703")


@pytest.mark.parametrize(
    ("value", "width", "text"),
    [(11.0, 7, "  11.00"), (123456.0, 7, " 123456"), (12345678.0, 7, "1.2e+07"), (0.004, 6, "  0.00")],
)
def test_figures_keep_nccl_tests_widths(value: float, width: int, text: str) -> None:
    assert nccl_float(value, width) == text


def test_wrong_rows_fail_out_of_bounds_and_unverified_rows_say_n_a() -> None:
    rows = balanced()
    rows[1]["wrong"] = 2048
    text = results_table(results_frame(rows, GB300), META)
    assert "# Out of bounds values : 1 FAILED" in text
    assert "# Total #wrong         : 2048  (DATA MISMATCH)" in text
    row = next(line for line in lines_of(text) if line.startswith("        8192"))
    assert row.split()[8] == "2048"
    unverified = [
        {**row, "wrong": None, "check": "n/a", "backend": "mock", "backend_name": "mock"}
        for row in balanced()
    ]
    text = results_table(results_frame(unverified, GB300), META)
    assert "# in-place: N/A for mock: its backend has no in-place call" in text
    assert "# Out of bounds values : n/a (nothing verified)" in text
    assert "validation: 0" in text
    row = next(line for line in lines_of(text) if line.startswith("        4096"))
    assert row.split()[8] == "N/A"
    # Unchecked, as nccl-tests without validation prints it: "    N/A" where "  %6g" would be.
    assert row == PREAMBLE % (4096, 1024, "uint8", "none", "    -1") + UNCHECKED % (
        "  11.00", "  0.37", "  0.28"
    ) + IN_PLACE_NOT_RUN  # fmt: skip
    assert len(row) == 116


def test_average_is_over_balanced_rows_only_and_moe_table_follows() -> None:
    frame = results_frame([*balanced(), *skewed_rows(check="checksum")], GB300)
    text = results_table(frame, META)
    balanced_average = (4096 / 11e-6 + 8192 / 20e-6) / 2 / 1e9 * 3 / 4
    assert average_bus_bandwidth(frame) == pytest.approx(balanced_average)
    assert f"# Avg bus bandwidth    : {balanced_average:g}" in text
    lines = lines_of(text)
    concluded = lines.index("# Collective test concluded: commbench balanced alltoall")
    header = next(i for i, line in enumerate(lines) if line.startswith("# pattern"))
    assert concluded < header  # the MoE table comes below the nccl-tests table
    columns = lines[header].split()
    assert columns[:7] == ["#", "pattern", "skew", "phase", "size(B)", "mean(us)", "p50(us)"]
    assert "p99(us)" in columns and "timing" not in columns
    assert "max over ranks: mean(us), p50(us), p99(us); algbw, busbw and %spec from p50(us)" in text
    assert "repeat" not in columns  # one measurement per case: nothing to tell apart
    body = [line for line in lines[header + 1 :] if not line.startswith("#")]
    assert [line.split()[:3] for line in body] == [
        ["toy", "hot:1:0.5", "dispatch"],
        ["toy", "hot:1:0.5", "combine"],
    ]


def test_moe_only_run_prints_only_the_moe_table() -> None:
    text = results_table(results_frame(skewed_rows(check="checksum"), GB300))
    assert "Collective test" not in text and "Avg bus bandwidth" not in text and "out-of-place" not in text
    assert text.startswith("# MoE phases: backend gloo; ranks: 4; spec: gb300-nvl72 900.0 GB/s")
    assert "# timing: iteration (a barrier before each timed iteration)" in text
    assert (
        "# time = each iteration's max across ranks: min, p50, p99 and mean over the timed iterations" in text
    )
    assert "# Total #wrong         : 0" in text


def test_moe_table_shows_timing_where_rows_mix_modes() -> None:
    rows = [*skewed_rows(timing="window"), *skewed_rows(timing="iteration")]
    lines = lines_of(results_table(results_frame(rows, GB300)))
    header = next(line for line in lines if line.startswith("# pattern"))
    assert header.split()[-1] == "timing"
    body = [line for line in lines if not line.startswith("#")]
    assert [line.split()[-1] for line in body] == ["window", "window", "iteration", "iteration"]
    window = lines.index(
        "# timing: window (as nccl-tests: the timed iterations back to back in one window, no barrier "
        "between them)"
    )
    assert lines[window + 1] == "# time = the max across ranks of window / iterations"
    assert lines[window + 2] == "# timing: iteration (a barrier before each timed iteration)"


def test_a_sweep_prints_one_nccl_tests_block_per_setting() -> None:
    settings = [{"chunk_rows": 4, "signal": "chunk"}, {"chunk_rows": 8, "signal": "chunk"}]
    rows = [row for knobs in settings for row in balanced(knobs=knobs)]
    lines = lines_of(results_table(results_frame(rows, GB300), META))
    assert [line for line in lines if line.startswith("# sweep:")] == [
        "# sweep: knobs chunk_rows=4",
        "# sweep: knobs chunk_rows=8",
    ]
    assert lines.count(NCCL_TESTS_HEADER[1]) == 2 and len([x for x in lines if "Avg bus bandwidth" in x]) == 2
    assert lines.count("# Collective test concluded: commbench balanced alltoall") == 1


def test_finalized_frame_carries_meta_for_the_header(tmp_path) -> None:
    writer = ReportWriter(tmp_path / "out", META, GB300)
    writer.add(balanced())
    text = results_table(writer.finalize())  # no meta passed: the frame carries the writer's
    assert "minBytes 4096 maxBytes 8192 step: 2(factor)" in text and "Pid   4242" in text


def test_the_moe_table_names_the_repeat_of_each_row() -> None:
    """suite --repeat runs a case three times: its three rows are told apart by their repeat."""
    rows = [row for repeat in (0, 1, 2) for row in skewed_rows(100.0 + repeat, repeat=repeat)]
    text = moe_table(results_frame(rows, load_spec("hgx-h100")))
    lines = text.splitlines()
    [header] = [index for index, line in enumerate(lines) if line.startswith("# pattern")]
    columns = lines[header].split()
    assert columns[:6] == ["#", "pattern", "skew", "phase", "repeat", "size(B)"]
    repeats = [line.split()[3] for line in lines[header + 1 :] if line.startswith("  ")]
    assert sorted(repeats) == ["0", "0", "1", "1", "2", "2"]

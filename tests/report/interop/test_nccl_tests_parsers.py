"""The balanced table on stdout and results.json, read the way nccl-tests' users read nccl-tests' output.

Each reader below is this suite's own reimplementation of a public parser's logic (not its code):

- SuperBench: microsoft/superbenchmark (commit 700d6501),
  superbench/benchmarks/micro_benchmarks/cuda_nccl_bw_performance.py, ``CudaNcclBwBenchmark.
  _process_raw_result`` (lines 146-245): the lines between the last one naming "out-of-place" and the last
  "Out of bounds values"; the column header (the line with "time" and "busbw") without its "#", split on
  spaces; "size" by its index, time/algbw/busbw by their index from the END of the header (the first
  occurrence for out-of-place, the last one for ``--in_place``); every line whose first field starts with a
  digit is a row; ``float()`` of the cells, any exception = an invalid result; no busbw read = invalid.
- nccl-tests' own row layout: NVIDIA/nccl-tests v2.19.6 (commit a0b82b2) src/util.cu,
  writeBenchmarkLinePreamble ("%12li  %12li  %8s  %6s  %6s") and writeBenchmarkLineBody ("  %7s  %6s  %6s
  %6g", "    N/A" for an unchecked #wrong; figures by getFloatStr), and the row regex scripts use on it
  (two groups of time, algbw, busbw and a #wrong that is a count or N/A); its version line (writeDeviceReport:
  "# nccl-tests version %s nccl-headers=%d nccl-library=%d"; 2.20 adds its build in parentheses).
- nccl-tests' JSON (-J): src/util.cu's writer, field by field with its types, and what
  tools/analyze_perf_json.py (same commit) reads: version, results[].size, config.iterations and
  aggregated_iterations, config.devices' hostnames, the out_of_place / in_place objects.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from commbench.inputs.specs import load_spec
from commbench.report import results_frame, results_table
from tests.launches import BALANCED_SIZES, Launch
from tests.report.rows import balanced_row

WORLD = 4  # tests.launches.BALANCED runs 4 gloo ranks


# ----------------------------------------------------------------------------------------------------------
# SuperBench's reading of the table


def superbench_results(raw_output: str, in_place: bool) -> dict[str, float]:
    """{"alltoall_<size>_busbw" | _algbw | _time: value} as SuperBench's nccl-bw benchmark records them;
    ValueError where it would log "The result format is invalid" (any exception, or no row read)."""
    lines = raw_output.splitlines()
    out_of_place_at = max((i for i, line in enumerate(lines) if "out-of-place" in line), default=-1)
    out_of_bounds_at = max((i for i, line in enumerate(lines) if "Out of bounds values" in line), default=-1)
    if out_of_place_at < 0 or out_of_bounds_at < 0:
        raise ValueError("no out-of-place header or no Out of bounds line")
    body = lines[out_of_place_at + 1 : out_of_bounds_at]
    header = next(line for line in body if "time" in line and "busbw" in line)
    names = re.split(r" +", header[1:].strip(" "))

    def from_end(name: str) -> int:
        if in_place:  # the last occurrence, counted from the end
            return -1 - list(reversed(names)).index(name)
        return names.index(name) - len(names)

    size_at = names.index("size")
    time_at, algbw_at, busbw_at = from_end("time"), from_end("algbw"), from_end("busbw")
    found: dict[str, float] = {}
    for line in body:
        cells = re.split(r" +", line.strip(" "))
        if not cells or not re.match(r"\d+", cells[0]):
            continue
        size = int(cells[size_at])
        if size:
            found[f"alltoall_{size}_busbw"] = float(cells[busbw_at])
            found[f"alltoall_{size}_algbw"] = float(cells[algbw_at])
            found[f"alltoall_{size}_time"] = float(cells[time_at])
    if not any(key.endswith("_busbw") for key in found):
        raise ValueError("no busbw read")
    return found


# ----------------------------------------------------------------------------------------------------------
# nccl-tests' printf layout


def get_float_str(value: float, width: int) -> str:
    """nccl-tests' getFloatStr: "%*.2f", else "%*.1f", else "%*.0f" where it fits ``width``, else "%*.1e"
    (width >= 7) or "%*.0e", cut to ``width``."""
    for form in ("%*.2f", "%*.1f", "%*.0f"):
        text = form % (width, value)
        if len(text) <= width:
            return text
    return ((width >= 7 and "%*.1e" or "%*.0e") % (width, value))[:width]


PREAMBLE = "%12li  %12li  %8s  %6s  %6s"
CHECKED = "  %7s  %6s  %6s  %6g"
UNCHECKED = "  %7s  %6s  %6s    N/A"

NUMBER = r"(?:\d+(?:\.\d+)?(?:e[+-]\d+)?)"
GROUP = rf"\s+({NUMBER})\s+({NUMBER})\s+({NUMBER})\s+(\d+|N/A)"
ROW = re.compile(rf"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+){GROUP}{GROUP}\s*$")
# The version line of nccl-tests 2.19 ("... 2.19.6 nccl-headers=...") and 2.20 ("... 2.20.0 (b4d5bee) ...").
VERSION = re.compile(
    r"^# nccl-tests version v?(\d+\.\d+\.\d+)(?: \(([^()]+)\))? nccl-headers=(\d+) nccl-library=(\d+)$"
)


def nccl_tests_row(result: dict[str, Any]) -> str:
    """The row nccl-tests prints for a results.json result (its out_of_place and in_place figures)."""
    out, into = result["out_of_place"], result["in_place"]
    size, count, kind, redop, root = (result[key] for key in ("size", "count", "type", "redop", "root"))
    row = PREAMBLE % (size, count, kind, redop, root)
    row += CHECKED % (get_float_str(out["time"], 7), get_float_str(out["alg_bw"], 6),
                      get_float_str(out["bus_bw"], 6), out["nwrong"])  # fmt: skip
    return row + UNCHECKED % (get_float_str(into["time"], 7), get_float_str(into["alg_bw"], 6),
                              get_float_str(into["bus_bw"], 6))  # fmt: skip


def results_json(run: Launch) -> dict[str, Any]:
    return json.loads((run.out / "results.json").read_text())


def balanced_results(run: Launch) -> list[dict[str, Any]]:
    return [r for r in results_json(run)["results"] if r.get("phase") == "alltoall"]


# ----------------------------------------------------------------------------------------------------------
# The table of a real gloo run (tests.launches.BALANCED)


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_superbench_reads_every_size_of_the_table(balanced_run: Launch, in_place: bool) -> None:
    """SuperBench reads a busbw, algbw and time per size, out-of-place and --in_place, each the figure of
    results.json as the table prints it (gloo runs the in-place all-to-all: it has numbers)."""
    found = superbench_results(balanced_run.stdout, in_place)
    group = "in_place" if in_place else "out_of_place"
    for result in balanced_results(balanced_run):
        figures = result[group]
        size = result["size"]
        assert found[f"alltoall_{size}_busbw"] == float(get_float_str(figures["bus_bw"], 6))
        assert found[f"alltoall_{size}_algbw"] == float(get_float_str(figures["alg_bw"], 6))
        assert found[f"alltoall_{size}_time"] == float(get_float_str(figures["time"], 7))
    assert sorted({int(key.split("_")[1]) for key in found}) == BALANCED_SIZES


def test_rows_are_nccl_tests_rows_to_the_character(balanced_run: Launch) -> None:
    """The row regex finds one row per size; each is the row nccl-tests' printf formats make of its
    results.json figures, and ends at column 117, where alltoall_perf's rows end."""
    lines = balanced_run.stdout.splitlines()
    rows = [line for line in lines if ROW.match(line)]
    assert [int(ROW.match(row).group(1)) for row in rows] == BALANCED_SIZES
    results = balanced_results(balanced_run)
    assert rows == [nccl_tests_row(result) for result in results]
    assert {len(row) for row in rows} == {117}
    for row in rows:
        match = ROW.match(row)
        assert match.group(9) == "0" and match.group(13) == "N/A"  # checked; in-place never checked
        assert (match.group(3), match.group(4), match.group(5)) == ("uint8", "none", "-1")
        assert int(match.group(2)) == int(match.group(1)) // WORLD  # count: elements to each peer


def test_the_first_line_is_a_nccl_tests_version_line(balanced_run: Launch) -> None:
    first = balanced_run.stdout.splitlines()[0]
    match = VERSION.match(first)
    assert match, first
    version, build, headers, library = match.groups()
    assert version == "2.19.6" and "commbench" in build and "not nccl-tests" in build
    assert headers == library == "0"  # the CPU torch of this suite has no NCCL
    footer = [line for line in balanced_run.stdout.splitlines() if line.startswith("# Avg bus bandwidth")]
    average = results_json(balanced_run)["average_bus_bandwidth"]["bandwidth"]
    assert footer == [f"# {'Avg bus bandwidth':<20} : {average:g}"]  # printf "%g", as grep-and-awk reads it


def test_a_backend_without_an_in_place_call_keeps_the_layout_and_says_n_a() -> None:
    """mock (no in-place call, no data moved): every in-place cell N/A, so SuperBench reads out-of-place
    and refuses --in_place (ValueError: it records nothing) instead of reading a figure that was not
    measured; the header says why."""
    rows = [
        balanced_row(WORLD, size, 10.0, wrong=None, check="n/a", backend="mock", backend_name="mock")
        for size in (4096, 8192)
    ]
    text = results_table(results_frame(rows, load_spec("gb300-nvl72")), {})
    assert "# in-place: N/A for mock: its backend has no in-place call" in text
    found = superbench_results(text, in_place=False)
    assert found["alltoall_4096_busbw"] == float(get_float_str(4096 * 3 / 4 / 10e-6 / 1e9, 6))
    with pytest.raises(ValueError):
        superbench_results(text, in_place=True)
    row = next(line for line in text.splitlines() if line.startswith("        4096"))
    assert row.endswith(UNCHECKED % ("N/A", "N/A", "N/A")) and not ROW.match(row)


# ----------------------------------------------------------------------------------------------------------
# results.json against nccl-tests' JSON writer


def _is_double(value: Any) -> bool:
    """What nccl-tests' jsonDouble writes: a number ("%lf"), or the text "nan"."""
    return (isinstance(value, float) or value == "nan") and not isinstance(value, bool)


def test_results_json_has_nccl_tests_fields_and_types(balanced_run: Launch) -> None:
    data = results_json(balanced_run)
    assert list(data)[:10] == [
        "version", "start_time", "args", "env", "nccl_version", "config", "results", "out_of_bounds",
        "average_bus_bandwidth", "errors",
    ]  # fmt: skip
    assert data["version"] == 3 and isinstance(data["version"], int)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", data["start_time"])
    assert data["args"][1:3] == ["run", "--pattern"] and all(isinstance(a, str) for a in data["args"])
    assert isinstance(data["env"], list) and all(isinstance(e, str) and "=" in e for e in data["env"])
    assert data["nccl_version"] is None  # no NCCL in a CPU torch (nccl-tests always has one)
    config = data["config"]
    for key in ("nthreads", "ngpus", "minimum_bytes", "maximum_bytes", "step_factor", "warmup_iters",
                "iterations", "aggregated_iterations", "validation", "graph", "per_iter_skip"):  # fmt: skip
        assert type(config[key]) is int, key
    assert (config["minimum_bytes"], config["maximum_bytes"], config["step_factor"]) == (1024, 16384, 4)
    for key in ("blocking_collectives", "per_iter_timing", "parallel_init"):
        assert config[key] in ("true", "false"), key  # jsonBool writes text
    for rank, device in enumerate(config["devices"]):
        assert device["rank"] == rank and type(device["group"]) is int and type(device["pid"]) is int
        assert isinstance(device["hostname"], str) and device["device"] == -1
        assert isinstance(device["device_hex"], str) and isinstance(device["device_info"], str)
    results = balanced_results(balanced_run)
    assert [r["size"] for r in results] == BALANCED_SIZES
    for result in results:
        assert type(result["size"]) is int and type(result["count"]) is int
        assert (result["type"], result["redop"], result["root"]) == ("uint8", "none", "    -1")
        assert result["actual_iterations"] == 5 and result["experiment_name"] == ""
        for group in ("out_of_place", "in_place"):
            figures = result[group]
            assert set(figures) == {"time", "alg_bw", "bus_bw", "nwrong"}
            assert all(_is_double(figures[key]) for key in ("time", "alg_bw", "bus_bw")), figures
        assert result["out_of_place"]["nwrong"] == 0.0 and type(result["out_of_place"]["nwrong"]) is float
        assert result["in_place"]["nwrong"] is None  # not checked, as nccl-tests' in-place alltoall
        assert result["in_place"]["time"] > 0
    assert data["out_of_bounds"] == {"count": 0, "okay": "true"}
    assert _is_double(data["average_bus_bandwidth"]["bandwidth"])
    assert data["average_bus_bandwidth"]["okay"] == "unchecked"
    assert data["errors"] == []


def test_analyze_perf_json_reads_results_json(balanced_run: Launch) -> None:
    """What nccl-tests' tools/analyze_perf_json.py reads of a JSON without per-iteration lists (-I 0): the
    overview (version, results, iterations, aggregated iterations), the placement objects (none per
    iteration: its tables skip them), and node groups from the devices' hostnames."""
    data = results_json(balanced_run)
    overview = (data.get("version"), len(data.get("results", [])), data["config"].get("iterations"))
    assert overview == (3, len(BALANCED_SIZES), 5) and data["config"].get("aggregated_iterations", 1) == 1
    for placement in ("out_of_place_per_iter", "in_place_per_iter"):
        assert all(not result.get(placement, {}) for result in data["results"])
    devices = data["config"]["devices"]
    hosts = {device["hostname"] for device in devices}
    assert len(devices) == WORLD and len(hosts) == 1  # one node: the 4 gloo ranks of this host

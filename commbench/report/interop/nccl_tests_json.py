"""nccl-tests' ``-J`` JSON fields, with nccl-tests' types, for results.json (what its parsers read).

Read at NVIDIA/nccl-tests v2.19.6 (commit a0b82b2), ``src/util.cu``: jsonOutputInit writes ``version`` (int,
JSON_FILE_VERSION 3), ``start_time`` (text, "%Y-%m-%d %H:%M:%S"), ``args`` (the command line, a list of
texts), ``env`` (the environment, a list of "NAME=value" texts) and ``nccl_version`` (int, NCCL's version
code); writeDeviceReport the ``config`` object (ints, its flags as the texts "true"/"false", ``devices``);
each result (writeBenchmarkLinePreamble, writeBenchmarkLineBody, writeBenchmarkLineTerminator) ``size`` and
``count`` (ints), ``type`` and ``redop`` (texts), ``root`` (a text: printf "%6i", so "    -1"),
``out_of_place`` and ``in_place`` ({time, alg_bw, bus_bw: doubles, nwrong: a double or null where not
checked}; null for a group that did not run, as writeBenchMarkLineNullBody writes), ``actual_iterations``
(int) and ``experiment_name`` (text); writeResultFooter ``out_of_bounds`` {count: int, okay: "true"/"false"}
and ``average_bus_bandwidth`` {bandwidth: double, okay: "unchecked"}; writeErrors ``errors`` (a list of
texts). A double that is NaN is the text "nan" there (jsonDouble), and so here.

Where commbench differs, and why: ``start_time`` is the run's start in UTC (nccl-tests writes local time);
``env`` holds the communication variables commbench records (NCCL_*, NVSHMEM_*, TORCH_NCCL_*,
CUDA_VISIBLE_DEVICES), not the whole environment; ``nccl_version`` is null where torch has no NCCL (a CPU
build); ``errors`` holds why a stopped run stopped; no ``end_time`` (commbench does not record when a run
ended); out_of_bounds' count and okay are null where no row was checked (nccl-tests says 0 and "true"
without validation); a device field commbench did not record is null. MoE phases are results too (no count,
type, redop or root: they are not nccl-tests' sweep), named by ``experiment_name``.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from commbench.plain import is_missing
from commbench.report.frame import average_bus_bandwidth
from commbench.report.pages.console import (
    REDOP,
    ROOT,
    TYPE_NAME,
    json_bool,
    nccl_version_code,
    out_of_bounds_count,
    per_peer_count,
    ran_in_place,
    sweep_config,
)

JSON_FILE_VERSION = 3  # nccl-tests' src/util.cu JSON_FILE_VERSION
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # its TIME_STRING_FORMAT


def json_double(value: Any) -> float | str:
    """A figure as nccl-tests' jsonDouble writes it: a float, or the text "nan" for NaN (and for none)."""
    if is_missing(value):
        return "nan"
    number = float(value)
    return "nan" if math.isnan(number) else number


def start_time(env: Mapping[str, Any]) -> str | None:
    """The run's start (meta.json's ``env.time_utc``, ISO 8601) as nccl-tests writes a time, in UTC; None
    when the folder does not say."""
    text = env.get("time_utc")
    if not isinstance(text, str) or not text:
        return None
    try:
        moment = _dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is not None:
        moment = moment.astimezone(_dt.timezone.utc)
    return moment.strftime(TIME_FORMAT)


def header_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The fields nccl-tests writes first (jsonOutputInit): version, start_time, args, env, nccl_version."""
    env = meta.get("env") or {}
    argv = env.get("argv")
    variables = env.get("env_vars") or {}
    return {
        "version": JSON_FILE_VERSION,
        "start_time": start_time(env),
        "args": [str(arg) for arg in argv] if isinstance(argv, list) else [],
        "env": [f"{name}={value}" for name, value in variables.items()],
        "nccl_version": nccl_version_code((env.get("versions") or {}).get("nccl")),
    }


def group(time_us: Any, algbw: Any, busbw: Any, wrong: Any) -> dict[str, Any]:
    """An out_of_place or in_place object: time (us), alg_bw, bus_bw (GB/s), nwrong (a double; null where
    nothing was checked)."""
    return {
        "time": json_double(time_us),
        "alg_bw": json_double(algbw),
        "bus_bw": json_double(busbw),
        "nwrong": None if is_missing(wrong) else float(wrong),
    }


def result_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    """One result's nccl-tests fields: size, (balanced rows) count, type, redop, root, out_of_place with
    nccl-tests' time (the mean) and the bandwidths from it, in_place (null where it did not run: MoE phases,
    backends without an in-place all-to-all; its nwrong null: never checked), actual_iterations,
    experiment_name ("" for the balanced sweep, as nccl-tests; "<pattern> <phase>" for an MoE phase)."""
    balanced = row.get("phase") == "alltoall" and not is_missing(row.get("size_bytes"))
    fields: dict[str, Any] = {"size": None if is_missing(row.get("size_bytes")) else int(row["size_bytes"])}
    if balanced:
        fields |= {"count": per_peer_count(row), "type": TYPE_NAME, "redop": REDOP, "root": f"{ROOT:6d}"}
    fields["out_of_place"] = group(
        row.get("time_us_mean"), row.get("algbw_mean_GBps"), row.get("busbw_mean_GBps"), row.get("wrong")
    )
    fields["in_place"] = None
    if balanced and ran_in_place(row):
        fields["in_place"] = group(
            row["in_place_time_us_mean"],
            row.get("in_place_algbw_mean_GBps"),
            row.get("in_place_busbw_mean_GBps"),
            None,
        )
    iters = row.get("iters")
    fields["actual_iterations"] = None if is_missing(iters) else int(iters)
    fields["experiment_name"] = "" if balanced else f"{row.get('pattern', '')} {row.get('phase', '')}".strip()
    return fields


def footer_fields(balanced: pd.DataFrame, errors: list[str]) -> dict[str, Any]:
    """The fields nccl-tests writes after the results: out_of_bounds and average_bus_bandwidth (over the
    balanced rows alone, in-place runs averaged in as nccl-tests does), then errors."""
    failed = out_of_bounds_count(balanced)
    return {
        "out_of_bounds": {"count": failed, "okay": None if failed is None else json_bool(failed == 0)},
        "average_bus_bandwidth": {
            "bandwidth": json_double(average_bus_bandwidth(balanced)),
            "okay": "unchecked",  # as nccl-tests without NCCL_TESTS_MIN_BW
        },
        "errors": [str(error) for error in errors],
    }


def config_field(balanced: pd.DataFrame, meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """nccl-tests' ``config`` of the balanced sweep (``console.sweep_config``); None without one."""
    return sweep_config(balanced, meta) if not balanced.empty else None

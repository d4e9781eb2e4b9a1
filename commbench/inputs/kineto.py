"""Kineto (torch.profiler) traces read safely: each rank's all-to-all calls, assembled into [src][dst] bytes.

A trace is Chrome trace JSON (``traceEvents``), one file per rank, ``.json`` or ``.json.gz``; ``read_kineto``
takes one file or a folder of them. Each call is counted once per rank, from one of two records:

* ``record_param_comms`` (NCCL, XCCL): the CPU op torch records around a collective, with args "Collective
  name", "dtype", "In/Out msg nelems", "In/Out split size", "Group size", "Process Group Name", "Process Group
  Ranks" and "Rank" (in the group). libkineto copies them onto the GPU kernel event: only the CPU op is read.
* ``c10d::alltoall_base_`` (gloo records no ``record_param_comms``): with ``record_shapes=True`` its
  "Concrete Inputs" hold the output and input split sizes, "Input Dims"/"Input type" the tensors; rank and
  world come from ``distributedInfo``. The op does not name its group: only whole-world calls are read so.
  A file with any ``record_param_comms`` all-to-all is read from those alone (its c10d ops are those calls).

Split sizes count rows (dim 0), as ``all_to_all_single`` takes them: a rank's elements per row are its
message's elements / the sum of its splits (1 for a 1-D tensor); "[]" is an even split (elements / group
size each). torch's profiler keeps at most 30 entries of a list (a longer one ends in "..." or is left out),
so the uneven splits of a group of more than 30 ranks cannot be rebuilt and are refused.

``assemble`` matches one process group's calls by position in every rank's file: row ``src`` of a call's
matrix is what ``src`` sends (its in-split x element size), and each rank's out-split must equal what its
peers send it. Anything malformed is a one-line UsageError naming the file and the problem.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from commbench.errors import UsageError
from commbench.inputs.userfiles import check_json_values, clip, decode_user_text, read_maybe_gzip, show_path

# One rank's trace, decompressed. A training step's trace with shapes is typically 10-300 MiB; events other
# than the two ops read here are dropped while parsing, so what stays in memory is the text itself.
MAX_TRACE_JSON_BYTES = 512 << 20
MAX_TRACE_FILES = 1024  # files in a folder (one per rank)
MAX_CALLS = 100_000  # all-to-all calls of one rank
MAX_GROUP_SIZE = 1024  # ranks of the process group replayed
MAX_MATRIX_ELEMENTS = 1 << 26  # [src][dst] entries over every call (512 MiB of int64)
PROFILER_LIST_LIMIT = 30  # torch's profiler cuts lists (split sizes, group ranks) to this many entries
_MAX_COUNT = 1 << 48  # elements of one message, and of one split
_MAX_LIST_CHARS = 1 << 20

COMMS_OP = "record_param_comms"
GLOO_OP = "c10d::alltoall_base_"
_CPU_CATEGORIES = ("cpu_op", "Operator", None)  # "Operator": older torch versions
_ALL_TO_ALL = frozenset({"alltoall", "alltoallv", "alltoallbase", "alltoallsingle"})
_LIST = re.compile(r"\[\s*(?:\d+\s*(?:,\s*\d+\s*)*)?\]")

# "torch dtype,bytes,record_param_comms' name (c10::toString of the ScalarType),the C++ type c10 ops record"
_DTYPE_TABLE = (
    "uint8,1,Byte,unsigned char; int8,1,Char,signed char; int16,2,Short,short int; int32,4,Int,int; "
    "int64,8,Long,long int; float16,2,Half,c10::Half; float32,4,Float,float; float64,8,Double,double; "
    "complex32,4,ComplexHalf,c10::complex<c10::Half>; complex64,8,ComplexFloat,c10::complex<float>; "
    "complex128,16,ComplexDouble,c10::complex<double>; bool,1,Bool,bool; bfloat16,2,BFloat16,c10::BFloat16; "
    "uint16,2,UInt16,short unsigned int; uint32,4,UInt32,unsigned int; uint64,8,UInt64,long unsigned int; "
    "float8_e5m2,1,Float8_e5m2,c10::Float8_e5m2; float8_e4m3fn,1,Float8_e4m3fn,c10::Float8_e4m3fn; "
    "float8_e5m2fnuz,1,Float8_e5m2fnuz,c10::Float8_e5m2fnuz; float8_e4m3fnuz,1,Float8_e4m3fnuz,"
    "c10::Float8_e4m3fnuz; float8_e8m0fnu,1,Float8_e8m0fnu,c10::Float8_e8m0fnu"
)
DTYPES: dict[str, tuple[str, int]] = {
    spelling: (name, int(size))
    for name, size, *spellings in (entry.strip().split(",") for entry in _DTYPE_TABLE.split(";"))
    for spelling in spellings
}


@dataclass(frozen=True)
class RankCall:
    """One all-to-all call as one rank's trace records it; splits in elements per peer (int64 [size])."""

    index: int  # position among this rank's all-to-all calls on its process group: 0, 1, ...
    collective: str  # as recorded: "all_to_allv" (split sizes given) or "all_to_all" (even)
    group: str  # process group name ("0" is the default group)
    group_ranks: tuple[int, ...] | None  # the group's global ranks, when recorded in full
    rank: int  # this rank's place in its group
    group_size: int
    dtype: str  # torch's name: "bfloat16", "float32", ...
    element_bytes: int
    in_split: np.ndarray  # elements this rank sends each peer
    out_split: np.ndarray  # elements it receives from each peer


@dataclass(frozen=True)
class RankTrace:
    """One file's all-to-all calls (every process group), in the order they started."""

    path: str
    form: str  # COMMS_OP or GLOO_OP: which record the calls were read from
    calls: tuple[RankCall, ...]


@dataclass(frozen=True)
class TraceCall:
    """One call of a process group, every rank's record assembled: ``matrix`` int64 [src][dst] bytes."""

    index: int
    collective: str
    dtype: str
    element_bytes: int
    matrix: np.ndarray  # read-only

    @property
    def name(self) -> str:
        """The call as result rows name it, e.g. "call 3 all_to_allv"."""
        return f"call {self.index} {self.collective}"


@dataclass(frozen=True)
class KinetoTrace:
    """The all-to-all calls of one process group, from one file per rank (``files[rank]``)."""

    source: str  # the file or folder given
    group: str
    group_ranks: tuple[int, ...] | None
    form: str
    files: tuple[str, ...]
    calls: tuple[TraceCall, ...]

    @property
    def group_size(self) -> int:
        return len(self.files)


class _Bad(Exception):
    """A problem of one event or value; the reader adds the file and the call."""


def trace_files(path: str | os.PathLike[str]) -> list[str]:
    """``path`` itself, or a folder's ``*.json`` / ``*.json.gz`` files (not recursing), sorted."""
    text = os.fspath(path)
    where = f"Kineto trace {show_path(text)}"
    if not os.path.isdir(text):
        if not os.path.exists(text):
            raise UsageError(f"{where} not found; give a trace file or a folder of one file per rank")
        return [text]
    try:
        with os.scandir(text) as entries:
            names = [entry.path for entry in entries if entry.name.lower().endswith((".json", ".json.gz"))]
        names = sorted(name for name in names if os.path.isfile(name))
    except OSError as exc:
        raise UsageError(f"{where} cannot be listed ({clip(exc.strerror or str(exc))})") from None
    if not names or len(names) > MAX_TRACE_FILES:
        found = f"{len(names)} trace files, more than {MAX_TRACE_FILES}" if names else "no .json(.gz) file"
        raise UsageError(f"{where} holds {found}; give a folder of one trace per rank of one group")
    return names


def _keep_calls(obj: dict[str, Any]) -> Any:
    """json object hook: an event other than the two ops read is dropped as soon as it is parsed."""
    return None if "ph" in obj and obj.get("name") not in (COMMS_OP, GLOO_OP) else obj


def read_trace_json(path: str, max_bytes: int = MAX_TRACE_JSON_BYTES) -> dict[str, Any]:
    """A trace file's top-level object (``.gz`` inflated), read bounded, other events dropped; never
    unpickled. UsageError naming the file otherwise."""
    data, where = read_maybe_gzip(path, "Kineto trace", max_bytes)
    check_json_values(data, where)
    text = decode_user_text(data, where)
    del data
    try:
        parsed = json.loads(text, object_hook=_keep_calls)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except (ValueError, RecursionError) as exc:  # a 5000-digit number, nesting deeper than Python's stack
        raise UsageError(f"{where}: not readable JSON ({clip(str(exc) or type(exc).__name__)})") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("traceEvents"), list):
        raise UsageError(f"{where}: not a Kineto trace (a JSON object with a traceEvents list)")
    return parsed


def _count(value: Any, what: str, least: int = 0) -> int:
    """A whole number recorded as a JSON number or decimal text, in [least, 2^48]."""
    if (
        isinstance(value, str)
        and value.strip().isascii()
        and value.strip().isdigit()
        and len(value.strip()) <= 20
    ):
        value = int(value.strip())
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{what} is {clip(repr(value))}, not a whole number")
    if not least <= value <= _MAX_COUNT:
        raise _Bad(f"{what} {value} is out of range ({least}..2^48)")
    return value


def _int_list(value: Any, what: str) -> list[int]:
    """A recorded list of counts: text such as "[1, 2]" (or a JSON list); refused when the profiler cut it."""
    if isinstance(value, list):
        return [_count(item, f"an entry of {what}") for item in value]
    text = value.strip() if isinstance(value, str) else ""
    if "..." in text:
        raise _Bad(
            f"{what} {clip(text)} was cut to {PROFILER_LIST_LIMIT} entries by the profiler: the splits of a "
            f"group of more than {PROFILER_LIST_LIMIT} ranks cannot be rebuilt from a trace"
        )
    if len(text) > _MAX_LIST_CHARS or not _LIST.fullmatch(text):
        raise _Bad(f'{what} {clip(repr(value))} is not a list of whole numbers such as "[1, 2]"')
    return [_count(item, f"an entry of {what}") for item in text[1:-1].split(",") if item.strip()]


def _elements(split: list[int], nelems: int, size: int, what: str) -> np.ndarray:
    """int64 [size] elements per peer from a split list in rows (or "[]": even) and the message's elements."""
    if not split:
        if nelems % size:
            raise _Bad(f"{what} msg nelems {nelems} with even splits does not divide over {size} ranks")
        return np.full(size, nelems // size, dtype=np.int64)
    if len(split) != size:
        raise _Bad(f"{what} split size has {len(split)} entries for a group of {size} ranks")
    rows = sum(split)
    if (rows == 0 and nelems) or (rows and nelems % rows):
        raise _Bad(
            f"{what} msg nelems {nelems} is not a whole number of rows of its split sizes (sum {rows})"
        )
    return np.array(split, dtype=np.int64) * (nelems // rows if rows else 0)


def _dtype(spelling: Any) -> tuple[str, int]:
    if not isinstance(spelling, str) or spelling.strip() not in DTYPES:
        raise _Bad(f"dtype {clip(repr(spelling))} is not a torch dtype commbench knows")
    return DTYPES[spelling.strip()]


def _comms_call(args: dict[str, Any], index: int) -> RankCall | None:
    """The all-to-all of a record_param_comms op's args; None for any other collective."""
    name = args.get("Collective name")
    if not isinstance(name, str) or "".join(filter(str.isalpha, name.lower())) not in _ALL_TO_ALL:
        return None
    size = _count(args.get("Group size"), "Group size", least=1)
    rank = _count(args.get("Rank"), "Rank")
    if size > MAX_GROUP_SIZE or rank >= size:
        raise _Bad(f"Rank {rank} of Group size {size}: out of range (at most {MAX_GROUP_SIZE} ranks)")
    dtype, element = _dtype(args.get("dtype"))
    listed = args.get("Process Group Ranks")
    group_ranks = None
    if isinstance(listed, str) and "..." not in listed:
        group_ranks = tuple(_int_list(listed, "Process Group Ranks"))
    in_n = _count(args.get("In msg nelems"), "In msg nelems")
    out_n = _count(args.get("Out msg nelems"), "Out msg nelems")
    in_split = _elements(_int_list(args.get("In split size", "[]"), "In split size"), in_n, size, "In")
    out_split = _elements(_int_list(args.get("Out split size", "[]"), "Out split size"), out_n, size, "Out")
    group = str(args.get("Process Group Name", "0"))
    ranks = group_ranks if group_ranks is not None and len(group_ranks) == size else None
    return RankCall(index, name, group, ranks, rank, size, dtype, element, in_split, out_split)


def _gloo_call(args: dict[str, Any], rank: int, world: int, index: int) -> RankCall:
    """The all-to-all of a c10d::alltoall_base_ op: (output, input, group, output splits, input splits,
    ...) in Concrete Inputs, the two tensors' shapes in Input Dims."""
    inputs, dims, types = args.get("Concrete Inputs"), args.get("Input Dims"), args.get("Input type")
    if not (isinstance(inputs, list) and isinstance(dims, list) and isinstance(types, list)):
        raise _Bad(
            "no Concrete Inputs / Input Dims: record the trace with torch.profiler(record_shapes=True)"
        )
    if min(len(inputs), len(dims), len(types)) < 5:
        raise _Bad("Concrete Inputs hold fewer than the op's 5 arguments; is it torch's c10d op?")
    if inputs[3] == "" or inputs[4] == "":
        raise _Bad(
            f"the split sizes were not recorded (the profiler leaves out lists of more than "
            f"{PROFILER_LIST_LIMIT} entries, or record_shapes was off)"
        )
    dtype, element = _dtype(types[1])
    splits = []
    for what, position, short in (("input", 1, "In"), ("output", 0, "Out")):
        shape = dims[position]
        if not isinstance(shape, list) or not shape:
            raise _Bad(f"the {what}'s Input Dims {clip(repr(shape))} are not a tensor shape")
        shape = [_count(item, f"the {what}'s Input Dims") for item in shape]
        rows = _int_list(inputs[3 + position], f"the {what} split sizes")  # output splits first
        if rows and sum(rows) != shape[0]:
            raise _Bad(f"the {what} split sizes sum to {sum(rows)} rows, but the {what} has {shape[0]}")
        if rows and len(rows) != world:
            raise _Bad(
                f"an all-to-all of {len(rows)} ranks in a world of {world}: only whole-world all-to-alls are "
                "read from c10d ops (record_param_comms traces name their group)"
            )
        splits.append((rows, _elements(rows, math.prod(shape), world, short)))
    (in_rows, in_split), (out_rows, out_split) = splits
    name = "all_to_allv" if in_rows or out_rows else "all_to_all"  # as record_param_comms names them
    return RankCall(index, name, "0", tuple(range(world)), rank, world, dtype, element, in_split, out_split)


def _world(parsed: dict[str, Any]) -> tuple[int, int]:
    """(rank, world size) from the trace's distributedInfo."""
    info = parsed.get("distributedInfo")
    if not isinstance(info, dict):
        raise _Bad("no distributedInfo (rank and world size): record the trace inside torch.distributed")
    world = _count(info.get("world_size"), "distributedInfo world_size", least=1)
    rank = _count(info.get("rank"), "distributedInfo rank")
    if rank >= world or world > MAX_GROUP_SIZE:
        raise _Bad(f"distributedInfo rank {rank} of {world}: out of range (at most {MAX_GROUP_SIZE} ranks)")
    return rank, world


def read_rank_trace(path: str) -> RankTrace:
    """One rank's all-to-all calls (see the module docstring), in the order they started."""
    parsed = read_trace_json(path)
    events = [
        event
        for event in parsed["traceEvents"]
        if isinstance(event, dict)
        and event.get("cat") in _CPU_CATEGORIES
        and isinstance(event.get("args"), dict)
    ]
    # A stable sort by start time: events without one go last, events at the same time keep the file's order.
    events.sort(key=lambda e: e["ts"] if type(e.get("ts")) in (int, float) else math.inf)
    calls: list[RankCall] = []
    issued: dict[str, int] = {}  # calls so far per process group
    form = COMMS_OP
    try:
        for event in (event for event in events if event.get("name") == COMMS_OP):
            call = _comms_call(
                event["args"], issued.get(str(event["args"].get("Process Group Name", "0")), 0)
            )
            if call is not None:
                calls.append(call)
                issued[call.group] = call.index + 1
        if not calls:  # no NCCL record: the c10d ops (gloo)
            form = GLOO_OP
            gloo = [event for event in events if event.get("name") == GLOO_OP]
            rank, world = _world(parsed) if gloo else (0, 1)
            for event in gloo:
                calls.append(_gloo_call(event["args"], rank, world, len(calls)))
        if len(calls) > MAX_CALLS:
            raise _Bad(f"more than {MAX_CALLS} all-to-all calls; profile fewer steps")
    except _Bad as exc:
        raise UsageError(f"Kineto trace {show_path(path)}: {form} call {len(calls)}: {exc}") from None
    return RankTrace(path, form, tuple(calls))


_Members = dict[int, tuple[RankTrace, list[RankCall]]]  # rank in the group -> (its file, its calls)


def _members(traces: Sequence[RankTrace]) -> dict[str, _Members]:
    """{process group: {rank in the group: (its file, its calls on the group)}}; one file per rank."""
    groups: dict[str, _Members] = {}
    for trace in traces:
        mine: dict[str, list[RankCall]] = {}
        for call in trace.calls:
            mine.setdefault(call.group, []).append(call)
        for name, calls in mine.items():
            ranks = sorted({call.rank for call in calls})
            members = groups.setdefault(name, {})
            if len(ranks) > 1 or ranks[0] in members:
                both = (members[ranks[0]][0].path, trace.path) if len(ranks) == 1 else (trace.path,)
                raise UsageError(
                    f"Kineto trace(s) {', '.join(show_path(p, 80) for p in both)}: rank {ranks} of process "
                    f"group {clip(repr(name))} more than once; give one file per rank"
                )
            members[ranks[0]] = (trace, calls)
    return groups


def assemble(traces: Sequence[RankTrace], group: str | None = None, source: str = "") -> KinetoTrace:
    """The [src][dst] byte matrices of one process group's all-to-all calls from every rank's trace (the
    only group with all-to-alls, or ``group``). UsageError for a missing rank, calls that do not line up,
    or an out-split that differs from what the peer sends (naming the call, the rank and the peer)."""
    where = show_path(source) if source else "the traces"
    groups = _members(traces)
    found = ", ".join(
        f"{clip(repr(name))} ({len(members)} file(s), {max(len(c) for _, c in members.values())} calls)"
        for name, members in sorted(groups.items())[:6]
    )
    if not groups:
        raise UsageError(
            f"{where}: no all-to-all call found (record_param_comms of NCCL, or c10d::alltoall_base_ "
            "recorded with record_shapes=True); was the profiler running around the MoE layers?"
        )
    if group not in (None, *groups) or (group is None and len(groups) > 1):
        fix = "commbench replays one: give the files of one group's ranks"
        problem = f"not of {clip(repr(group))}" if group is not None else fix
        raise UsageError(f"{where} holds all-to-alls of process group(s) {found}; {problem}")
    name = group if group is not None else next(iter(groups))
    members = groups[name]
    label = f"process group {clip(repr(name))}"
    sizes = sorted({call.group_size for _, calls in members.values() for call in calls})
    missing = [rank for rank in range(sizes[0]) if rank not in members]
    if len(sizes) > 1 or missing:
        problem = f"group sizes {sizes[:4]}" if len(sizes) > 1 else f"no trace of rank(s) {missing[:8]}"
        raise UsageError(
            f"{where}: {label} of {sizes[0]} ranks: {problem}; give every rank's file of one run"
        )
    size = sizes[0]
    counts = {rank: len(members[rank][1]) for rank in range(size)}
    low, high = min(counts, key=counts.__getitem__), max(counts, key=counts.__getitem__)
    if counts[low] != counts[high]:
        raise UsageError(
            f"{where}: rank {low} recorded {counts[low]} all-to-all calls on {label}, rank {high} "
            f"{counts[high]}; profile the same steps on every rank"
        )
    if counts[0] * size * size > MAX_MATRIX_ELEMENTS:
        raise UsageError(
            f"{where}: {counts[0]} calls of {size} ranks are too many to replay; profile fewer steps"
        )
    files = tuple(members[rank][0].path for rank in range(size))
    calls = tuple(
        _assemble_call(f"{where}: {label}", files, [members[r][1][k] for r in range(size)])
        for k in range(counts[0])
    )
    return KinetoTrace(source or where, name, members[0][1][0].group_ranks, members[0][0].form, files, calls)


def _assemble_call(where: str, files: tuple[str, ...], row: list[RankCall]) -> TraceCall:
    """One call's matrix from every rank's record of it (``row[rank]``), checked both ways."""
    first = row[0]
    what = f"{where}, call {first.index} ({first.collective})"
    odd = next((call for call in row if call.element_bytes != first.element_bytes), None)
    if odd is not None:
        raise UsageError(f"{what}: rank {odd.rank} records dtype {odd.dtype}, rank 0 {first.dtype}; one run?")
    sends = np.stack([call.in_split for call in row]) * first.element_bytes  # [src][dst]
    receives = np.stack([call.out_split for call in row]) * first.element_bytes  # [dst][src]
    wrong = np.argwhere(sends != receives.T)
    if wrong.size:
        src, dst = (int(v) for v in wrong[0])
        raise UsageError(
            f"{what}: rank {dst} expects {receives[dst, src]} B from rank {src}, which sends it "
            f"{sends[src, dst]} B ({show_path(files[dst], 60)}, {show_path(files[src], 60)}); are the files "
            "from one run and the same steps?"
        )
    sends.setflags(write=False)
    return TraceCall(first.index, first.collective, first.dtype, first.element_bytes, sends)


def read_kineto(path: str | os.PathLike[str], group: str | None = None) -> KinetoTrace:
    """Every all-to-all call of one process group in a Kineto trace (a file, or a folder of one file per
    rank), as [src][dst] byte matrices; files read one at a time, bounded. UsageError when malformed."""
    source = os.path.expanduser(os.fspath(path))
    traces = [read_rank_trace(file) for file in trace_files(source)]
    return assemble(traces, group, source=str(Path(source)))

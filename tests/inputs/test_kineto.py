"""Kineto traces: split sizes become [src][dst] bytes, every malformed file is a one-line error."""

from __future__ import annotations

import copy
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from commbench.errors import UsageError
from commbench.inputs.kineto import (
    COMMS_OP,
    DTYPES,
    GLOO_OP,
    assemble,
    read_kineto,
    read_rank_trace,
    read_trace_json,
)

DATA = Path(__file__).resolve().parents[1] / "data"
NCCL = DATA / "kineto"  # record_param_comms, written in torch's NCCL format
GLOO = DATA / "kineto-gloo"  # captured by torch.profiler on 4 gloo ranks
ELEMENT = {"Long": 8, "BFloat16": 2}


def load(folder: Path, rank: int) -> dict:
    return json.loads((folder / f"rank{rank}.json").read_text())


def save(folder: Path, rank: int, trace: dict) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(trace))


def copy_of(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / source.name
    shutil.copytree(source, target)
    return target


def comms_events(trace: dict) -> list[dict]:
    """The all-to-all record_param_comms CPU ops of a trace, in file order."""
    return [
        e
        for e in trace["traceEvents"]
        if e.get("name") == COMMS_OP
        and e.get("cat") == "cpu_op"
        and "all_to_all" in e["args"]["Collective name"]
    ]


def test_matrices_equal_the_split_sizes_of_every_rank() -> None:
    trace = read_kineto(NCCL)
    assert (trace.group, trace.group_size, trace.group_ranks, trace.form) == ("0", 4, (0, 1, 2, 3), COMMS_OP)
    kinds = ["all_to_all", "all_to_allv", "all_to_allv"] * 2  # per layer: token counts, dispatch, combine
    assert [call.name for call in trace.calls] == [f"call {i} {kind}" for i, kind in enumerate(kinds)]
    for rank in range(4):
        # Rows are what each rank says it sends: its In split size (rows of dim 0) x elements per row x bytes.
        for call, event in zip(trace.calls, comms_events(load(NCCL, rank)), strict=True):
            args = event["args"]
            split = json.loads(args["In split size"])
            element = ELEMENT[args["dtype"]]
            if split:
                per_row = args["In msg nelems"] // sum(split)
                expected = [size * per_row * element for size in split]
            else:  # "[]": an even split of the message
                expected = [args["In msg nelems"] // 4 * element] * 4
            assert call.matrix[rank].tolist() == expected
            assert call.element_bytes == element
    # One concrete call: layer 0's dispatch of bf16 rows of 16 elements (32 B).
    assert trace.calls[1].matrix.tolist() == [
        [160, 96, 0, 224],
        [64, 192, 128, 32],
        [96, 96, 96, 96],
        [0, 288, 64, 160],
    ]
    assert trace.calls[2].matrix.tolist() == trace.calls[1].matrix.T.tolist()  # combine sends the rows back
    assert not trace.calls[1].matrix.flags.writeable


def test_even_splits_expand_the_message_over_the_group() -> None:
    trace = read_kineto(NCCL)
    for call in (trace.calls[0], trace.calls[3]):  # int64 token counts, "[]" splits, 4 elements per rank
        assert call.collective == "all_to_all" and call.dtype == "int64"
        assert (call.matrix == 8).all()


def test_each_call_counted_once_from_the_cpu_op() -> None:
    raw = load(NCCL, 0)
    kernels = [e for e in raw["traceEvents"] if e.get("cat") == "kernel" and "Collective name" in e["args"]]
    c10d = [e for e in raw["traceEvents"] if e.get("name") == GLOO_OP]
    assert len(kernels) == len(c10d) == 6  # the same calls are in the file three times over
    calls = read_rank_trace(str(NCCL / "rank0.json")).calls
    assert len(calls) == 6 and [c.index for c in calls] == list(range(6))
    assert all(call.rank == 0 and call.group_size == 4 for call in calls)


def test_the_gloo_capture_gives_the_same_matrices() -> None:
    nccl, gloo = read_kineto(NCCL), read_kineto(GLOO)
    assert gloo.form == GLOO_OP and gloo.group_size == 4
    assert [c.name for c in gloo.calls] == [c.name for c in nccl.calls]
    for ours, theirs in zip(gloo.calls, nccl.calls, strict=True):
        np.testing.assert_array_equal(ours.matrix, theirs.matrix)
        assert ours.dtype == theirs.dtype


def test_one_file_and_gz_files(tmp_path: Path) -> None:
    single = read_rank_trace(str(GLOO / "rank2.json"))
    assert single.calls[1].in_split.tolist() == [3 * 16, 3 * 16, 3 * 16, 3 * 16]  # rank 2 sends 3 rows each
    assert single.calls[1].out_split.tolist() == [0 * 16, 4 * 16, 3 * 16, 2 * 16]
    folder = tmp_path / "gz"
    folder.mkdir()
    for rank in range(4):
        (folder / f"rank{rank}.pt.trace.json.gz").write_bytes(
            gzip.compress((NCCL / f"rank{rank}.json").read_bytes())
        )
    (folder / "notes.txt").write_text("not a trace")  # ignored: not .json(.gz)
    zipped, plain = read_kineto(folder), read_kineto(NCCL)
    for ours, theirs in zip(zipped.calls, plain.calls, strict=True):
        np.testing.assert_array_equal(ours.matrix, theirs.matrix)
    assert zipped.files[0].endswith("rank0.pt.trace.json.gz")


def test_size_bounds(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="larger than 1000 bytes"):
        read_trace_json(str(NCCL / "rank0.json"), max_bytes=1000)
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * (4 << 20)))  # 4 KiB on disk, 4 MiB inflated
    assert bomb.stat().st_size < 64 << 10
    with pytest.raises(UsageError, match="more than 1 MiB once decompressed"):
        read_trace_json(str(bomb), max_bytes=1 << 20)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress((NCCL / "rank0.json").read_bytes())[:200])
    with pytest.raises(UsageError, match="cut short"):
        read_trace_json(str(cut))


def check_refused(path: Path, *fragments: str) -> str:
    with pytest.raises(UsageError) as caught:
        read_kineto(path)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_mismatched_out_split_names_the_call_rank_and_peer(tmp_path: Path) -> None:
    folder = copy_of(NCCL, tmp_path)
    trace = load(folder, 2)
    args = comms_events(trace)[4]["args"]  # call 4: rank 2 receives [2, 5, 9, 0] rows
    assert args["Out split size"] == "[2, 5, 9, 0]"
    args["Out split size"], args["Out msg nelems"] = "[2, 5, 8, 1]", 16 * 16
    save(folder, 2, trace)
    check_refused(folder, "call 4 (all_to_allv)", "rank 2 expects 256 B from rank 2, which sends it 288 B")


def test_missing_and_duplicate_ranks_and_uneven_call_counts(tmp_path: Path) -> None:
    folder = copy_of(NCCL, tmp_path)
    (folder / "rank3.json").unlink()
    check_refused(folder, "process group '0' of 4 ranks", "no trace of rank(s) [3]")
    shutil.copy(folder / "rank1.json", folder / "rank3.json")
    check_refused(folder, "rank [1] of process group '0' more than once")
    trace = load(NCCL, 3)
    last = comms_events(trace)[-1]
    trace["traceEvents"].remove(last)
    save(folder, 3, trace)
    check_refused(folder, "rank 3 recorded 5 all-to-all calls", "rank 0 6")


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        (
            {"In split size": "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, ...]"},
            ("cut to 30 entries", "more than 30 ranks"),
        ),
        ({"In split size": "[1, x]"}, ("In split size", "not a list of whole numbers")),
        ({"In split size": "[1, 2, 3]"}, ("3 entries for a group of 4 ranks",)),
        ({"In msg nelems": 100}, ("In msg nelems 100 is not a whole number of rows",)),
        ({"dtype": "Quux"}, ("dtype 'Quux' is not a torch dtype",)),
        ({"Rank": 9}, ("Rank 9 of Group size 4",)),
        ({"Group size": "four"}, ("Group size is 'four', not a whole number",)),
        ({"In msg nelems": -3}, ("In msg nelems -3 is out of range",)),
    ],
)
def test_malformed_args_are_one_line_errors_naming_the_file(
    tmp_path: Path, change: dict, fragments: tuple
) -> None:
    folder = copy_of(NCCL, tmp_path)
    trace = load(folder, 1)
    comms_events(trace)[1]["args"].update(change)
    save(folder, 1, trace)
    check_refused(folder, "rank1.json", "record_param_comms call 1", *fragments)


def test_malformed_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    check_refused(bad, "bad.json", "not valid JSON")
    bad.write_text('{"events": []}')
    check_refused(bad, "not a Kineto trace")
    bad.write_bytes(b'{"traceEvents": [], "x": "\xff"}')
    check_refused(bad, "not UTF-8")
    bad.write_text('{"traceEvents": []}')
    check_refused(bad, "no all-to-all call found")
    check_refused(tmp_path / "missing", "not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    check_refused(empty, "holds no .json(.gz) file")
    (tmp_path / "x.json.gz").write_bytes(b"not gzip")  # gzip is told by its magic bytes, not the name
    with pytest.raises(UsageError, match="not valid JSON"):
        read_trace_json(str(tmp_path / "x.json.gz"))
    (tmp_path / "y.json.gz").write_bytes(b"\x1f\x8bnot gzip")
    with pytest.raises(UsageError, match="broken gzip data"):
        read_trace_json(str(tmp_path / "y.json.gz"))


def test_gloo_form_needs_recorded_splits_and_distributed_info(tmp_path: Path) -> None:
    folder = copy_of(GLOO, tmp_path)
    trace = load(folder, 0)
    no_shapes = copy.deepcopy(trace)
    for event in no_shapes["traceEvents"]:
        if event.get("name") == GLOO_OP:
            event["args"]["Concrete Inputs"][4] = ""  # what the profiler writes for a list of 31+ entries
    save(folder, 0, no_shapes)
    check_refused(folder, "c10d::alltoall_base_ call 0", "split sizes were not recorded")
    del trace["distributedInfo"]
    save(folder, 0, trace)
    check_refused(folder, "no distributedInfo")
    trace = load(GLOO, 0)
    ops = [e for e in trace["traceEvents"] if e.get("name") == GLOO_OP]
    ops[1]["args"]["Concrete Inputs"][4] = "[5, 3, 7]"  # a 3-rank split in a world of 4
    ops[1]["args"]["Input Dims"][1] = [15, 16]
    save(folder, 0, trace)
    check_refused(folder, "only whole-world all-to-alls")


def test_groups_are_told_apart(tmp_path: Path) -> None:
    folder = copy_of(NCCL, tmp_path)
    for rank in range(4):
        trace = load(folder, rank)
        for event in comms_events(trace)[3:]:  # the second layer on another process group
            event["args"]["Process Group Name"] = "ep"
        save(folder, rank, trace)
    check_refused(folder, "process group(s) '0' (4 file(s), 3 calls), 'ep' (4 file(s), 3 calls)")
    traces = [read_rank_trace(str(folder / f"rank{rank}.json")) for rank in range(4)]
    ep = assemble(traces, group="ep")
    assert [c.name for c in ep.calls] == ["call 0 all_to_all", "call 1 all_to_allv", "call 2 all_to_allv"]
    np.testing.assert_array_equal(ep.calls[1].matrix, read_kineto(NCCL).calls[4].matrix)
    with pytest.raises(UsageError, match="not of 'tp'"):
        assemble(traces, group="tp")


def test_dtype_table_matches_torch_element_sizes() -> None:
    assert DTYPES["BFloat16"] == DTYPES["c10::BFloat16"] == ("bfloat16", 2)
    assert DTYPES["long int"] == DTYPES["Long"] == ("int64", 8)
    for name, size in set(DTYPES.values()):
        assert getattr(torch, name).itemsize == size, name


def test_a_trace_of_millions_of_empty_objects_is_refused_before_parsing(tmp_path, monkeypatch):
    """Bytes do not bound objects: a small .gz of "{}," inflates to a list whose objects would take GBs."""
    import gzip

    from commbench.inputs import userfiles

    monkeypatch.setattr(userfiles, "MAX_JSON_VALUES", 1000)  # the real limit, scaled down
    monkeypatch.setattr(userfiles.check_json_values, "__defaults__", (1000,))
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b'{"traceEvents": [' + b"{}," * 5000 + b"{}]}"))
    with pytest.raises(UsageError, match="more than 1,000 JSON values"):
        read_trace_json(str(bomb))

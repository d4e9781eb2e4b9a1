"""Writes the Kineto test traces of tests/data: kineto/ (NCCL form) and kineto-gloo/ (captured), 4 ranks each.

Both hold the same training-step traffic of two MoE layers on 4 ranks, three all-to-alls per layer: the
token counts (an even all_to_all of int64, one per peer), the dispatch (an all_to_allv of bf16 rows of
HIDDEN elements, COUNTS[layer][src][dst] rows) and the combine (the same rows sent back).

* ``kineto/rank<R>.json``: what torch.profiler writes for these calls on NCCL, written here field by field,
  since a CPU-only torch cannot record ``record_param_comms`` (only ProcessGroupNCCL/XCCL record it): each
  call's ``c10d::alltoall_base_`` CPU op, the ``record_param_comms`` op inside it with the args of torch's
  ``saveNcclMeta`` (torch/csrc/profiler/util.cpp), the NCCL kernel those args are copied onto (libkineto),
  an all_reduce in between (not an all-to-all), and the file's ``distributedInfo``.
* ``kineto-gloo/rank<R>.json``: captured by torch.profiler(record_shapes=True) around the same calls on 4
  gloo processes (``--gloo``; needs a free local port 29611).

Run from the repository root: ``python tests/data/make_kineto_traces.py [--gloo]``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORLD = 4
HIDDEN = 16
COUNTS = (  # rows rank src sends rank dst in each layer's dispatch
    ((5, 3, 0, 7), (2, 6, 4, 1), (3, 3, 3, 3), (0, 9, 2, 5)),
    ((1, 8, 2, 4), (6, 0, 5, 3), (2, 2, 9, 1), (4, 3, 0, 7)),
)


def calls_of(rank: int) -> list[dict]:
    """Every all-to-all of ``rank`` in issue order: collective, dtype, in/out rows per peer, row elements."""
    calls = []
    for counts in COUNTS:
        sends = [counts[rank][dst] for dst in range(WORLD)]
        receives = [counts[src][rank] for src in range(WORLD)]
        calls.append({"name": "all_to_all", "dtype": "Long", "in": [], "out": [], "row": 1, "n": WORLD})
        calls.append(
            {"name": "all_to_allv", "dtype": "BFloat16", "in": sends, "out": receives, "row": HIDDEN}
        )
        calls.append(
            {"name": "all_to_allv", "dtype": "BFloat16", "in": receives, "out": sends, "row": HIDDEN}
        )
    return calls


def _listed(values: list[int]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def nccl_trace(rank: int) -> dict:
    pid, stream = 4000 + rank, 7
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "ts": 0, "pid": pid, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_name", "ts": 0, "pid": rank, "tid": 0, "args": {"name": f"GPU {rank}"}},
    ]
    ts, external, seq = 1_000_000.0 + 3.5 * rank, 100, 0
    cpp_types = {"Long": "long int", "BFloat16": "c10::BFloat16"}
    for index, call in enumerate(calls_of(rank)):
        if index == 3:  # a gradient all_reduce between the layers: not an all-to-all
            seq += 1
            meta = {"Collective name": "allreduce", "dtype": "Float", "In msg nelems": 4096}
            meta |= {"Out msg nelems": 4096, "In split size": "[]", "Out split size": "[]"}
            meta |= {"Group size": WORLD, "Process Group Name": "0", "Rank": rank, "Seq": seq}
            events.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": pid, "tid": pid,
                           "ts": ts, "dur": 9.0, "args": {"External id": external, **meta}})  # fmt: skip
            ts, external = ts + 40.0, external + 1
        rows_in = sum(call["in"]) if call["in"] else call.get("n", 0)
        rows_out = sum(call["out"]) if call["out"] else call.get("n", 0)
        in_shape = [rows_in, call["row"]] if call["row"] > 1 else [rows_in]
        out_shape = [rows_out, call["row"]] if call["row"] > 1 else [rows_out]
        seq += 1
        meta = {
            "Collective name": call["name"],
            "dtype": call["dtype"],
            "In msg nelems": rows_in * call["row"],
            "Out msg nelems": rows_out * call["row"],
            "In split size": _listed(call["in"]),
            "Out split size": _listed(call["out"]),
            "Global rank start": 0,
            "Global rank stride": 1,
            "Group size": WORLD,
            "Process Group Name": "0",
            "Process Group Description": "default_pg",
            "Process Group Ranks": _listed(list(range(WORLD))),
            "Rank": rank,
            "Seq": seq,
            "Is asynchronized op": 0,
        }
        typed = cpp_types[call["dtype"]]
        concrete = ["", "", "", _listed(call["out"]), _listed(call["in"]), "False", "-1"]
        events.append({
            "ph": "X", "cat": "cpu_op", "name": "c10d::alltoall_base_", "pid": pid, "tid": pid, "ts": ts,
            "dur": 60.0,
            "args": {"External id": external, "Record function id": 0, "Concrete Inputs": concrete,
                     "Input type": [typed, typed, "", "ScalarList", "ScalarList", "Scalar", "Scalar"],
                     "Input Dims": [out_shape, in_shape, [], [], [], [], []]},
        })  # fmt: skip
        events.append({
            "ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": pid, "tid": pid, "ts": ts + 2.0,
            "dur": 50.0, "args": {"External id": external + 1, "Record function id": 0, **meta},
        })  # fmt: skip
        events.append({
            "ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
            "pid": rank, "tid": stream, "ts": ts + 30.0, "dur": 25.0,
            "args": {"External id": external + 1, "device": rank, "stream": stream,
                     "correlation": 9000 + index, "grid": [4, 1, 1], "block": [640, 1, 1], **meta},
        })  # fmt: skip
        ts, external = ts + 120.0, external + 2
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": rank, "name": "NVIDIA H200", "totalGlobalMem": 150121545728}],
        "distributedInfo": {
            "backend": "nccl",
            "rank": rank,
            "world_size": WORLD,
            "pg_count": 1,
            "pg_config": [
                {
                    "pg_name": "0",
                    "pg_desc": "default_pg",
                    "backend_config": "cuda:nccl",
                    "pg_size": WORLD,
                    "ranks": list(range(WORLD)),
                }
            ],  # fmt: skip
            "nccl_version": "2.27.5",
        },
        "record_shapes": 1,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": 1700000000000000000,
        "traceEvents": events,
        "traceName": f"rank{rank}.json",
    }


def write_nccl() -> None:
    folder = HERE / "kineto"
    folder.mkdir(exist_ok=True)
    for rank in range(WORLD):
        (folder / f"rank{rank}.json").write_text(json.dumps(nccl_trace(rank), indent=1) + "\n")


def _gloo_rank(rank: int, folder: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    tensors = []
    for call in calls_of(rank):
        dtype = torch.int64 if call["dtype"] == "Long" else torch.bfloat16
        shape_in = (sum(call["in"]), HIDDEN) if call["in"] else (WORLD,)
        shape_out = (sum(call["out"]), HIDDEN) if call["out"] else (WORLD,)
        tensors.append((torch.ones(shape_in, dtype=dtype), torch.empty(shape_out, dtype=dtype), call))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as capture:
        for index, (send, receive, call) in enumerate(tensors):
            if index == 3:
                dist.all_reduce(torch.ones(4096))
            dist.all_to_all_single(receive, send, call["out"] or None, call["in"] or None)
    capture.export_chrome_trace(os.path.join(folder, f"rank{rank}.json"))
    dist.destroy_process_group()


def write_gloo() -> None:
    import torch.multiprocessing as mp

    folder = HERE / "kineto-gloo"
    folder.mkdir(exist_ok=True)
    mp.spawn(_gloo_rank, args=(str(folder),), nprocs=WORLD)


if __name__ == "__main__":
    write_nccl()
    if "--gloo" in sys.argv[1:]:
        write_gloo()

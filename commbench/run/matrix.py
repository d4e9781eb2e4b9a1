"""Given [src][dst] byte matrices run as all-to-all-v phases: every rank's plan, the Pattern, the phase.

A ``MatrixCall`` (``run.jobs``, e.g. one all-to-all of a Kineto trace) moves ``matrix[src][dst]`` bytes from
every rank to every rank in one all-to-all-v. It is sent in rows of ``MatrixCall.row_bytes`` (the gcd of its
entries, so each entry is whole rows): ``matrix // row_bytes`` rows from each source to each destination,
laid out destination by destination as a balanced all-to-all lays out its rows (send mode "balanced": nothing
to pack, receive counts known without an exchange). So the backend's dispatch path, the receive-buffer
poisoning and the byte-for-byte verification are those of the balanced sweep. Each row is encoded from its
(source rank, row number) like any dispatch row (``traffic.payload``); rows under 8 bytes carry no header,
and every one of their bytes is checked all the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from commbench.run.interface import Backend
from commbench.run.jobs import MatrixCall
from commbench.run.phases import Phase
from commbench.traffic.pattern import Pattern
from commbench.traffic.payload import RowCheck, encode_rows, expected_rows
from commbench.traffic.plan import RankPlan


def matrix_plans(matrix: np.ndarray, row_bytes: int) -> list[RankPlan]:
    """Every rank's plan (``plans[src]``) of ``matrix // row_bytes`` rows of ``row_bytes`` bytes, row k of a
    rank being its k-th row in destination order."""
    rows = np.asarray(matrix, dtype=np.int64) // int(row_bytes)
    world = rows.shape[0]
    plans = []
    for src in range(world):  # one vectorized plan per rank (every rank verifies against every source)
        sent = torch.from_numpy(rows[src].copy())
        count = int(sent.sum())
        plans.append(
            RankPlan(
                rank=src,
                world_size=world,
                send_mode="balanced",  # rows already in destination order: the backend sends them as they are
                num_tokens=count,
                send_token_index=torch.arange(count, dtype=torch.int64),
                send_key=torch.repeat_interleave(torch.arange(world), sent, output_size=count),
                send_counts=sent.reshape(world, 1),
                combine_weight=torch.zeros(count, dtype=torch.float32),
                dispatch_row_bytes=int(row_bytes),
                combine_row_bytes=0,
                static_recv_counts=torch.from_numpy(rows[:, src].copy()).reshape(world, 1),
            )
        )
    return plans


def matrix_pattern(name: str, call: MatrixCall) -> Pattern:
    """One call's Pattern: its bytes as dispatch bytes, its rows as tokens (and selections), no combine."""
    matrix = np.array(call.matrix, dtype=np.int64)
    row_bytes = call.row_bytes
    rows = matrix // row_bytes
    return Pattern(
        name=name,
        world_size=int(matrix.shape[0]),
        send_mode="matrix",
        dispatch_tokens=rows,
        dispatch_selections=rows.copy(),
        dispatch_bytes=matrix,
        combine_bytes=np.zeros_like(matrix),
        expert_load=np.zeros(0, dtype=np.int64),
        stats={
            "call": call.name,
            "row_bytes": row_bytes,
            "total_bytes": int(matrix.sum()),
            "max_send_bytes": int(matrix.sum(axis=1).max()),
            "max_recv_bytes": int(matrix.sum(axis=0).max()),
        },
        skew_text=call.name,
    )


class _ExpectedRows:
    """What this rank must receive (a ``RowCheck``), built on first use: unchecked runs skip its memory."""

    def __init__(self, plans: Sequence[RankPlan], rank: int, device: Any) -> None:
        self._plans, self._rank, self._device = plans, rank, device
        self._check: RowCheck | None = None

    def _get(self) -> RowCheck:
        if self._check is None:
            self._check = RowCheck(expected_rows(self._plans, self._rank, self._device))
        return self._check

    def full(self, output: torch.Tensor) -> int:
        return self._get().full(output)

    def checksum(self, output: torch.Tensor) -> int:
        return self._get().checksum(output)


def matrix_phase(comm: Any, backend: Backend, call: MatrixCall) -> Phase:
    """One call as a phase the harness times and checks: the backend set up for every rank's plan (untimed),
    each iteration one dispatch of this rank's rows; the phase is named after the call."""
    plans = matrix_plans(call.matrix, call.row_bytes)
    plan = plans[comm.rank].to(comm.device)
    rows = encode_rows(comm.rank, torch.arange(plan.num_tokens, device=comm.device), plan.dispatch_row_bytes)
    backend.setup_peers(plans)
    backend.setup(plan)
    return Phase(
        call.name,
        call.name,
        lambda: backend.dispatch(rows, plan, plan.static_recv_counts),
        _ExpectedRows(plans, comm.rank, comm.device),
        "bytes",
    )

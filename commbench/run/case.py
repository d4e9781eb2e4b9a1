"""What a case is: one ``Case`` type read from a result row (or a rank, profile or arrival row) and a frame.

A case is the measurement that a figure is compared by: across the repeats of one run (``suite --repeat``,
soak rounds), across runs (baselines, ``commbench compare``), across modules (the tables, the outlier rule,
the profile, the budget, the acceptance reruns, ``--resume``). Its identity (``IDENTITY``, the row columns of
the same names):

- ``pattern`` (the job's name: the model's name, "balanced", "kineto") and ``phase`` ("dispatch",
  "combine", "alltoall", a matrix call's name);
- ``model_digest``: a digest of the model's traffic-shaping fields (``model_digest``), so that two --model
  files with the same ``name:`` but another hidden size or top-k are two cases (None for a job without a
  model, and in folders written before rows carried it);
- ``skew``, ``tokens_per_rank``, ``send_mode`` (MoE jobs; None otherwise);
- ``size_bytes`` only for a row without routing (balanced sizes, matrix calls): an MoE phase's size (a
  "dispatch" or "combine" row, or one with tokens per rank) follows from its routing, and a rank row of an
  MoE phase has none;
- ``backend`` (its label), ``world_size``, ``knobs`` (the knob setting as "k=v k=v" text: a dict in memory
  and text in the files are the same case), ``check`` and ``timing`` (they change what the timed loop does).

Not identity: the routing seed (a run with another seed measures the same case on another draw of the same
distribution), warm-up and iteration counts, the layout. ``repeat`` says which measurement of its case a row
is (0, 1, ...): ``Case.key`` leaves it out (the same case in every repeat and run), ``Case.repeat_key``
includes it (one measurement). Cells are normalized once here (``cell``): None for an empty cell or NaN,
whole numbers as int, flags and other values as text; so a row read back from CSV and the same row in memory
give equal cases. No pandas at import time: the CLI's help stays light.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from commbench.plain import is_missing, knobs_text

if TYPE_CHECKING:
    import pandas as pd

    from commbench.inputs.models import ModelConfig

# The identity fields of a case, in key order; each is also the row column it is read from.
IDENTITY = (
    "pattern",
    "phase",
    "model_digest",
    "skew",
    "tokens_per_rank",
    "send_mode",
    "size_bytes",
    "backend",
    "world_size",
    "knobs",
    "check",
    "timing",
)
MOE_PHASES = ("dispatch", "combine")  # routed phases: their size is not identity
REPEAT_COLUMN = "repeat"  # which measurement of its case a row is (0, 1, ...; suite --repeat, soak rounds)
# Every row column a Case reads: what rank, profile and arrival rows repeat of their result row.
CASE_FIELDS = (*IDENTITY, REPEAT_COLUMN)
# Model fields that do not change the traffic (provenance text, the expert FFN width of the budget).
_NOT_TRAFFIC = ("name", "source", "moe_intermediate")
_DIGEST_HEX = 12


def model_digest(model: ModelConfig) -> str:
    """A short digest of the model fields that shape the traffic (hidden size, experts, top-k, groups,
    dtypes, ...; not its name or source), the rows' ``model_digest`` column."""
    shaping = {key: value for key, value in sorted(asdict(model).items()) if key not in _NOT_TRAFFIC}
    text = json.dumps(shaping, sort_keys=True, default=str)
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:_DIGEST_HEX]


def cell(value: Any) -> str | int | float | None:
    """A case cell as a case (and JSON) holds it: None for an empty cell or NaN, whole numbers as int, other
    numbers as float, a flag and anything else as text."""
    if is_missing(value) or (isinstance(value, str) and value == ""):
        return None
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (int, float)):
        number = float(value)
        return int(number) if number.is_integer() else number
    return str(value)


def size_text(size: int) -> str:
    """Bytes in binary units as users write them: 16 MiB, 1.5 GiB, 512 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


@dataclass(frozen=True)
class Case:
    """One case (module docstring): its identity fields and the repeat index of one measurement."""

    pattern: str | None = None
    phase: str | None = None
    model_digest: str | None = None
    skew: str | None = None
    tokens_per_rank: int | None = None
    send_mode: str | None = None
    size_bytes: int | None = None
    backend: str | None = None
    world_size: int | None = None
    knobs: str | None = None
    check: str | None = None
    timing: str | None = None
    repeat: int = 0

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Case:
        """The case of a result, rank, profile or arrival row (memory or CSV); a column the row lacks is
        None (``repeat`` 0)."""
        values = {name: cell(row.get(name)) for name in IDENTITY}
        values["knobs"] = cell(knobs_text(row.get("knobs")))
        if values["tokens_per_rank"] is not None or values["phase"] in MOE_PHASES:
            values["size_bytes"] = None  # routed: the size follows from the routing
        for name in ("pattern", "phase", "model_digest", "skew", "send_mode", "backend", "check", "timing"):
            if values[name] is not None:
                values[name] = str(values[name])
        repeat = cell(row.get(REPEAT_COLUMN))
        return cls(**values, repeat=int(repeat) if isinstance(repeat, (int, float)) else 0)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Case:
        """A case as ``as_dict`` wrote it (a baseline file, a comparison): unknown keys ignored."""
        return cls.from_row({name: values.get(name) for name in CASE_FIELDS if name in values})

    def as_dict(self, repeat: bool = False) -> dict[str, Any]:
        """The identity fields (and ``repeat`` when asked) as a JSON-ready dict."""
        out = {name: getattr(self, name) for name in IDENTITY}
        return {**out, REPEAT_COLUMN: self.repeat} if repeat else out

    @property
    def key(self) -> tuple[Any, ...]:
        """The same case in every repeat and every run: the identity fields."""
        return tuple(getattr(self, name) for name in IDENTITY)

    @property
    def repeat_key(self) -> tuple[Any, ...]:
        """One measurement of the case: ``key`` and the repeat index."""
        return (*self.key, self.repeat)

    @property
    def layer(self) -> Case:
        """The MoE layer this case is a phase of (dispatch and combine together): the case without phase."""
        return replace(self, phase=None)

    @property
    def routed(self) -> bool:
        """Whether the case is an MoE phase (routed tokens), not a balanced size or a matrix call."""
        return self.tokens_per_rank is not None or self.phase in MOE_PHASES

    @property
    def label(self) -> str:
        """The case for people: "balanced 16 MiB", "deepseek-v3 dispatch skew zipf:1.2 512 tok/rank",
        then a non-default send mode, "[knob setting]" and "repeat N" (N > 0) where they apply."""
        pattern = self.pattern or ""
        parts = [pattern]
        if self.phase and self.phase != "alltoall":  # "balanced 16 MiB": the phase says nothing more
            parts.append(self.phase)
        if self.size_bytes is not None:
            parts.append(size_text(int(self.size_bytes)))
        if self.skew and self.skew != "uniform" and self.skew not in pattern:
            parts.append(f"skew {self.skew}")
        if self.tokens_per_rank is not None:
            parts.append(f"{self.tokens_per_rank} tok/rank")
        if self.send_mode not in (None, "token"):
            parts.append(f"send {self.send_mode}")
        if self.knobs:
            parts.append(f"[{self.knobs}]")
        if self.repeat:
            parts.append(f"repeat {self.repeat}")
        return " ".join(part for part in parts if part) or "all"

    def without_model_digest(self) -> Case:
        """The case as a folder or baseline written before rows carried a model digest names it."""
        return replace(self, model_digest=None)


def case_index(
    frame: pd.DataFrame, repeat: bool = False, layer: bool = False
) -> tuple[np.ndarray, list[Case]]:
    """(per row the position of its case in the list, the cases in first-seen order) of any frame with
    case columns: one ``Case.from_row`` per distinct combination of raw cells, the rows mapped by a groupby
    (vectorized). ``repeat``: one case per repeat; ``layer``: dispatch and combine of a layer as one."""
    if frame.empty:
        return np.zeros(0, dtype=np.int64), []
    present = [name for name in CASE_FIELDS if name in frame.columns]
    raw = frame[present].copy()
    if "knobs" in raw.columns:  # a dict (in memory) is not hashable: its text is the same case
        raw["knobs"] = raw["knobs"].map(knobs_text)
    if "size_bytes" in raw.columns:  # routed: size is not identity (as in Case.from_row)
        routed = np.zeros(len(raw), dtype=bool)
        if "phase" in raw.columns:
            routed |= raw["phase"].isin(MOE_PHASES).to_numpy()
        if "tokens_per_rank" in raw.columns:
            routed |= raw["tokens_per_rank"].notna().to_numpy()
        if routed.any():
            raw.loc[routed, "size_bytes"] = None
    if not present:
        return np.zeros(len(frame), dtype=np.int64), [Case()]
    # sort=False numbers the groups in the order they first appear.
    group_of_row = raw.groupby(present, dropna=False, sort=False).ngroup().to_numpy()
    _, first_rows = np.unique(group_of_row, return_index=True)
    firsts = raw.iloc[first_rows]
    cases: list[Case] = []
    position: dict[tuple[Any, ...], int] = {}
    group_to_case = np.empty(len(firsts), dtype=np.int64)
    for group, record in enumerate(firsts.to_dict("records")):
        case = Case.from_row(record)
        case = case.layer if layer else case
        key = case.repeat_key if repeat else case.key
        if not repeat:
            case = replace(case, repeat=0)
        if key not in position:
            position[key] = len(cases)
            cases.append(case)
        group_to_case[group] = position[key]
    return group_to_case[group_of_row], cases


def group_by_case(
    frame: pd.DataFrame, repeat: bool = False, layer: bool = False
) -> list[tuple[Case, pd.DataFrame]]:
    """The rows of ``frame`` by case, in first-seen order: (case, its rows); ``repeat`` and ``layer`` as in
    ``case_index``. Every table, rule and analysis that needs "the rows of one case" groups through here."""
    codes, cases = case_index(frame, repeat=repeat, layer=layer)
    if not cases:
        return []
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(cases) + 1))
    return [(case, frame.iloc[order[bounds[i] : bounds[i + 1]]]) for i, case in enumerate(cases)]


def with_case_column(frame: pd.DataFrame, column: str = "case", repeat: bool = True) -> pd.DataFrame:
    """``frame`` plus a column of each row's ``Case`` (one per repeat unless ``repeat`` is False)."""
    codes, cases = case_index(frame, repeat=repeat)
    return frame.assign(**{column: [cases[code] for code in codes]})

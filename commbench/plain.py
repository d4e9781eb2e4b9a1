"""Plain values: numpy/pandas cells as JSON-safe values, the test for "no value here", the knobs codec.

Rows and frames carry numpy scalars, NaN for "not measured" and, from pandas, None or NaN for an empty
cell; JSON has none of numpy's types and no NaN. ``plain`` turns any of them into what ``json.dumps`` writes
as valid JSON. A knob setting is a dict in memory and "k=v k=v" text in files and messages: ``knobs_text``
writes it, ``parse_knobs`` reads it back and ``knob_setting`` takes either (the one knobs codec).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np


def is_missing(value: Any) -> bool:
    """True for None and NaN (Python or numpy floats): an empty cell, a figure not measured."""
    if value is None:
        return True
    return isinstance(value, (float, np.floating)) and math.isnan(value)


def plain(value: Any) -> Any:
    """A JSON-safe copy: dicts (keys as text) and sequences recursively, numpy arrays as lists, numpy
    scalars as Python numbers, NaN and infinities as None, any other object as its text."""
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


# A knob starts at whitespace followed by "name=", so a value may itself hold spaces.
_KNOB_SPLIT = re.compile(r"\s+(?=[A-Za-z_][\w.-]*=)")


def knobs_text(knobs: Mapping[str, Any] | str | None) -> str:
    """A knob setting as one text cell: {"chunk_rows": 4, "signal": "chunk"} -> "chunk_rows=4 signal=chunk"
    (files and messages); text stays as it is, no setting is ""."""
    if isinstance(knobs, Mapping):
        return " ".join(f"{key}={value}" for key, value in knobs.items())
    return "" if is_missing(knobs) else str(knobs)


def parse_knobs(text: Any) -> dict[str, str]:
    """A file's ``knobs`` cell as a dict: "chunk_rows=4 signal=chunk" -> {"chunk_rows": "4", "signal":
    "chunk"} (the inverse of ``knobs_text``)."""
    if is_missing(text) or not str(text).strip():
        return {}
    pairs = (part.partition("=") for part in _KNOB_SPLIT.split(str(text).strip()))
    return {key: value for key, _, value in pairs}


def knob_setting(knobs: Mapping[str, Any] | str | None) -> dict[str, str]:
    """One row's knobs, from memory (a dict) or from a file (text), as {knob: value as text}."""
    if isinstance(knobs, Mapping):
        return {str(key): str(value) for key, value in knobs.items()}
    return parse_knobs(knobs)

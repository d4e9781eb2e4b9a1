"""Backend knob settings in the report: a dict in memory, "k=v k=v" text in the files, and a sweep's setting.

The harness gives every row its knob setting as a dict (``row["knobs"]``); the files hold it as one text
cell ("chunk_rows=4 signal=chunk"), and so does every results frame (``frame.results_frame`` turns the
dict into that text, ``plain.knobs_text``). ``knob_setting`` reads either form. The tables and plots show a
"knobs" column (``KNOB_SETTING_COLUMN``) with the knobs whose values differ between rows, and none when
every row ran with the same setting.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pandas as pd

from commbench.plain import is_missing

KNOB_SETTING_COLUMN = "knob_setting"
# A knob starts at whitespace followed by "name=", so a value may itself hold spaces.
_KNOB_SPLIT = re.compile(r"\s+(?=[A-Za-z_][\w.-]*=)")


def parse_knobs(text: Any) -> dict[str, str]:
    """A file's ``knobs`` cell as a dict: "chunk_rows=4 signal=chunk" -> {"chunk_rows": "4", "signal":
    "chunk"}."""
    if is_missing(text) or not str(text).strip():
        return {}
    pairs = (part.partition("=") for part in _KNOB_SPLIT.split(str(text).strip()))
    return {key: value for key, _, value in pairs}


def knob_setting(knobs: Mapping[str, Any] | str | None) -> dict[str, str]:
    """One row's knobs, from memory (a dict) or from a file (text), as {knob: value as text}."""
    if isinstance(knobs, Mapping):
        return {str(key): str(value) for key, value in knobs.items()}
    return parse_knobs(knobs)


def varying_knobs(frame: pd.DataFrame) -> pd.Series | None:
    """Per row, "key=value ..." of the knobs whose values differ between the rows (a sweep's setting);
    None when the rows have no ``knobs`` column or all share one setting."""
    if frame.empty or "knobs" not in frame.columns:
        return None
    settings = [knob_setting(knobs) for knobs in frame["knobs"]]
    keys = dict.fromkeys(key for setting in settings for key in setting)
    varying = [key for key in keys if len({setting.get(key) for setting in settings}) > 1]
    if not varying:
        return None
    cells = [" ".join(f"{key}={setting[key]}" for key in varying if key in setting) for setting in settings]
    return pd.Series(cells, index=frame.index, dtype=object)


def with_knob_setting(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` plus the display column ``knob_setting`` (``varying_knobs``) when knobs vary."""
    setting = varying_knobs(frame)
    if setting is None:
        return frame
    return frame.assign(**{KNOB_SETTING_COLUMN: setting})

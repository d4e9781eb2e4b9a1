"""Acceptance limits: the floors, ceilings and outlier-rule parameters a run's verdict is judged by.

Each shipped spec has a limits file, ``commbench/inputs/acceptance/<spec>.yaml`` (package data), every value
with a comment saying where its number comes from. ``cpu.yaml`` holds the limits of a run without a GPU
spec (no bandwidth limits at all: only data, completion and rank spread are judged); ``generic-gpu.yaml``
those of a user's own spec file, which has no acceptance file of its own.

A file is nested YAML; a limit's KEY is its path joined by dots, e.g. ``balanced.large.busbw_fail_fraction``
(see ``KEYS``). A user's ``--limits FILE`` may hold any subset of the keys: it replaces those keys of the
shipped limits and keeps the rest. ``--limit KEY=VALUE`` (repeatable) replaces one key after that:

- KEY: one of ``KEYS`` exactly (lower case, dot separated); VALUE: a number for fractions, microseconds and
  counts, a byte count with an optional binary suffix for ``*_bytes`` keys (``256M``, ``2GiB``; K = 1024,
  as nccl-tests ``-b``/``-e``), one of the listed words for ``spread.confirm_rule``.
- Each key at most once on the command line; spaces around ``=`` are ignored.

Anything else (bad YAML, an unknown key, a value of the wrong type or out of range, a FAIL floor above its
WARN floor) is a one-line UsageError (exit 2) naming the key and the fix.

Balanced all-to-all rows are judged by size range (``size`` = bytes each rank sends, as nccl-tests):
``small`` (size <= small.max_bytes): time p50 <= time_{warn,fail}_us + per_peer_us x (ranks - 1) + the
link bytes at the spec's line rate (a latency ceiling: the bytes term only keeps slow-link specs fair);
``medium`` (up to large.min_bytes), ``large`` (up to huge.min_bytes) and ``huge``: busbw >=
busbw_{warn,fail}_fraction x the spec's NVLink bandwidth per direction. MoE dispatch / combine rows of
size >= moe.min_bytes: busbw >= moe.<phase>.busbw_{warn,fail}_fraction x spec.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Any

from commbench.errors import UsageError
from commbench.inputs.specs import list_specs
from commbench.inputs.userfiles import clip, kind_of, load_yaml, read_user_text, shorten, show_path

LIMITS_FOLDER = "acceptance"
CPU_LIMITS = "cpu"  # the limits of a run without a GPU spec
GENERIC_LIMITS = "generic-gpu"  # the limits of a user's spec file (no shipped acceptance file)
BALANCED_RANGES = ("small", "medium", "large", "huge")
MOE_PHASES = ("dispatch", "combine")
CONFIRM_RULES = ("all", "majority")
MAX_LIMIT_BYTES = 1 << 50  # as --max-bytes: far beyond a real run, keeps products inside int64
EXAMPLE = "balanced.large.busbw_fail_fraction=0.6"


@dataclass(frozen=True)
class _Key:
    """One limit: its type, accepted range and what a message says it is."""

    kind: type  # int, float or str
    low: float = 0.0
    high: float = math.inf
    low_open: bool = False  # True: the value must be above ``low``
    bandwidth: bool = False  # a bandwidth/time limit: absent from a CPU run's limits
    choices: tuple[str, ...] = ()
    what: str = ""


def _fraction() -> _Key:
    return _Key(float, 0.0, 1.0, low_open=True, bandwidth=True, what="a fraction of the spec in (0, 1]")


def _bytes() -> _Key:
    return _Key(int, 0, MAX_LIMIT_BYTES, bandwidth=True, what="a byte count (e.g. 256M, 2GiB) up to 1P")


def _micros(high: float, low_open: bool = True) -> _Key:
    bound = "above 0" if low_open else "at least 0"
    return _Key(float, 0.0, high, low_open=low_open, bandwidth=True, what=f"microseconds, {bound}")


KEYS: dict[str, _Key] = {
    "balanced.small.max_bytes": _bytes(),
    "balanced.small.time_warn_us": _micros(1e7),
    "balanced.small.time_fail_us": _micros(1e7),
    "balanced.small.per_peer_us": _micros(1e4, low_open=False),
    "balanced.medium.busbw_warn_fraction": _fraction(),
    "balanced.medium.busbw_fail_fraction": _fraction(),
    "balanced.large.min_bytes": _bytes(),
    "balanced.large.busbw_warn_fraction": _fraction(),
    "balanced.large.busbw_fail_fraction": _fraction(),
    "balanced.huge.min_bytes": _bytes(),
    "balanced.huge.busbw_warn_fraction": _fraction(),
    "balanced.huge.busbw_fail_fraction": _fraction(),
    "moe.min_bytes": _bytes(),
    "moe.dispatch.busbw_warn_fraction": _fraction(),
    "moe.dispatch.busbw_fail_fraction": _fraction(),
    "moe.combine.busbw_warn_fraction": _fraction(),
    "moe.combine.busbw_fail_fraction": _fraction(),
    "spread.k_mads": _Key(float, 1.0, 100.0, what="a number of scaled MADs in [1, 100]"),
    "spread.min_excess_pct": _Key(float, 0.0, 1e6, what="a percentage in [0, 1000000]"),
    "spread.min_excess_us": _Key(float, 0.0, 1e7, what="microseconds, at least 0"),
    # Below 3 ranks the median absolute deviation says nothing (two ranks are each other's outlier).
    "spread.min_ranks": _Key(int, 3, 1 << 24, what="a rank count of at least 3"),
    "spread.confirm_reruns": _Key(int, 0, 10, what="a number of reruns in [0, 10]"),
    "spread.confirm_rule": _Key(str, choices=CONFIRM_RULES, what="one of: all, majority"),
    # A confirmed flag FAILs only when its gap is this many times the noise measured in the same launch.
    "spread.noise_k": _Key(float, 1.0, 100.0, what="a multiple of the launch's own noise in [1, 100]"),
    # Fixed: an acceptance test accepts no wrong byte and no timeout. The keys exist so that every limit the
    # verdict applies is written in the file.
    # The pairwise link test (run.pairwise, report.pairs): message sizes, the class-median rule, class floors.
    "pairwise.bandwidth_bytes": _Key(int, 1, 1 << 34, what="a byte count (e.g. 256M) from 1 B to 16 GiB"),
    "pairwise.latency_bytes": _Key(int, 1, 1 << 20, what="a byte count (e.g. 8) from 1 B to 1 MiB"),
    "pairwise.k_mads": _Key(float, 1.0, 100.0, what="a number of scaled MADs in [1, 100]"),
    "pairwise.bandwidth_drop_pct": _Key(float, 0.0, 100.0, low_open=True, what="a percentage in (0, 100)"),
    "pairwise.latency_excess_pct": _Key(float, 0.0, 1e6, what="a percentage in [0, 1000000]"),
    "pairwise.min_excess_us": _Key(float, 0.0, 1e7, what="microseconds, at least 0"),
    "pairwise.min_pairs": _Key(int, 3, 1 << 24, what="a pair count of at least 3"),
    "pairwise.nvlink.busbw_warn_fraction": _fraction(),
    "pairwise.nvlink.busbw_fail_fraction": _fraction(),
    "pairwise.scaleout.busbw_warn_fraction": _fraction(),
    "pairwise.scaleout.busbw_fail_fraction": _fraction(),
    # --soak: bandwidth drift between the first and the last soak round (each case), in percent.
    "soak.drift_warn_pct": _Key(float, 0.0, 100.0, low_open=True, what="a percentage in (0, 100]"),
    "soak.drift_fail_pct": _Key(float, 0.0, 100.0, low_open=True, what="a percentage in (0, 100]"),
    # Health counters (NVLink CRC/replay/recovery, ECC, Xid) before vs after: the increase allowed.
    "health.max_counter_increase": _Key(int, 0, 1 << 40, what="a count of at least 0"),
    "correctness.max_wrong": _Key(int, 0, 0, what="0 (commbench accepts no wrong data)"),
    "completion.max_timeouts": _Key(int, 0, 0, what="0 (a timeout or a dead rank always fails)"),
}
_BYTES_PATTERN = re.compile(r"^\s*(\d{1,20})\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)
_BYTES_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_KEY_PATTERN = re.compile(r"^[a-z_]+(\.[a-z_]+)*$")


@dataclass(frozen=True)
class Floor:
    """A bandwidth floor: WARN below ``warn_fraction`` x spec, FAIL below ``fail_fraction`` x spec."""

    warn_fraction: float
    fail_fraction: float


@dataclass(frozen=True)
class SpreadRule:
    """The outlier rule across ranks (report.judge.outliers): a rank is flagged when its value is more
    than ``k_mads`` scaled MADs (1.4826 x MAD) AND ``min_excess_pct`` % AND ``min_excess_us`` above the
    median of the ranks; cases with fewer than ``min_ranks`` ranks are not judged. A flag is confirmed by
    ``confirm_reruns`` reruns of the case under ``confirm_rule`` (all, or a strict majority, of them), and
    FAILs only when its smallest gap over those measurements is more than ``noise_k`` times the noise the
    same launch measured (``report.judge.outliers.launch_noise``; for pairs ``report.judge.pairs``)."""

    k_mads: float = 5.0
    min_excess_pct: float = 25.0
    min_excess_us: float = 10.0
    min_ranks: int = 3
    confirm_reruns: int = 2
    confirm_rule: str = "all"
    noise_k: float = 3.0


@dataclass(frozen=True)
class PairRule:
    """The pairwise link test's rule (report.judge.pairs): a pair is flagged against the robust median
    of its link class and test when its bandwidth is more than ``k_mads`` scaled MADs AND
    ``bandwidth_drop_pct`` % below it, or its latency more than ``k_mads`` scaled MADs AND
    ``latency_excess_pct`` % AND ``min_excess_us`` above it; classes with fewer than ``min_pairs`` pairs
    are not judged against a median; every flag needs a time per message ``min_excess_us`` above the median
    too. Floors per class are fractions of the spec (None: a CPU run)."""

    bandwidth_bytes: int
    latency_bytes: int
    k_mads: float
    bandwidth_drop_pct: float
    latency_excess_pct: float
    min_excess_us: float
    min_pairs: int
    nvlink_floor: Floor | None = None
    scaleout_floor: Floor | None = None


@dataclass(frozen=True)
class Limits:
    """Checked limits: ``values`` maps every KEY that applies to its value (a CPU run's limits hold no
    bandwidth key); ``source`` says where they came from; ``cpu_run``: no GPU spec, no bandwidth limits."""

    values: Mapping[str, Any]
    source: str
    cpu_run: bool = False
    spec_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    def __reduce__(self) -> tuple[Any, ...]:
        # Handed to every rank once parsed (the launch's Acceptance): a read-only view does not pickle.
        return (type(self), (dict(self.values), self.source, self.cpu_run, self.spec_name))

    def value(self, key: str) -> Any:
        """The value of ``key``; None where it does not apply (bandwidth keys of a CPU run)."""
        return self.values.get(key)

    @property
    def spread(self) -> SpreadRule:
        return SpreadRule(**{name: self.values[f"spread.{name}"] for name in SpreadRule.__dataclass_fields__})

    @property
    def pairwise(self) -> PairRule:
        values = self.values
        fields = ("bandwidth_bytes", "latency_bytes", "k_mads", "bandwidth_drop_pct", "latency_excess_pct")
        floors = {}
        for link in ("nvlink", "scaleout"):
            warn = values.get(f"pairwise.{link}.busbw_warn_fraction")
            fail = values.get(f"pairwise.{link}.busbw_fail_fraction")
            floors[f"{link}_floor"] = Floor(warn, fail) if warn is not None and fail is not None else None
        return PairRule(
            **{name: values[f"pairwise.{name}"] for name in fields},
            min_excess_us=values["pairwise.min_excess_us"],
            min_pairs=values["pairwise.min_pairs"],
            **floors,
        )

    def balanced_range(self, size_bytes: int) -> str:
        """The size range of a balanced row: small, medium, large or huge (see the module docstring)."""
        if size_bytes <= self.values["balanced.small.max_bytes"]:
            return "small"
        if size_bytes < self.values["balanced.large.min_bytes"]:
            return "medium"
        return "large" if size_bytes < self.values["balanced.huge.min_bytes"] else "huge"

    def balanced_floor(self, size_range: str) -> Floor:
        prefix = f"balanced.{size_range}."
        return Floor(self.values[prefix + "busbw_warn_fraction"], self.values[prefix + "busbw_fail_fraction"])

    def moe_floor(self, phase: str) -> Floor:
        prefix = f"moe.{phase}."
        return Floor(self.values[prefix + "busbw_warn_fraction"], self.values[prefix + "busbw_fail_fraction"])

    def small_ceilings_us(self, world_size: int, link_bytes: float, spec_GBps: float) -> tuple[float, float]:
        """(WARN, FAIL) time ceilings in us of a small balanced row: the latency allowance + per peer, plus
        the bottleneck rank's link bytes at the spec's line rate (GB/s = 1e3 bytes per us)."""
        peers = max(int(world_size) - 1, 0)
        wire_us = float(link_bytes) / (float(spec_GBps) * 1e3) if spec_GBps > 0 else 0.0
        extra = self.values["balanced.small.per_peer_us"] * peers + wire_us
        return (
            self.values["balanced.small.time_warn_us"] + extra,
            self.values["balanced.small.time_fail_us"] + extra,
        )

    def to_dict(self) -> dict[str, Any]:
        """What verdict.json records: the source and every value, by KEY."""
        return {"source": self.source, "cpu_run": self.cpu_run, "values": dict(self.values)}


def shipped_limits_name(spec_name: str | None) -> str:
    """The acceptance file for a spec: its own for a shipped spec, ``generic-gpu`` for a user's spec file,
    ``cpu`` without a GPU spec."""
    if spec_name is None:
        return CPU_LIMITS
    return spec_name if spec_name in list_specs() else GENERIC_LIMITS


def shipped_limits_text(name: str) -> str:
    """The text of a shipped acceptance file (``cpu``, ``generic-gpu`` or a spec name)."""
    folder = resources.files("commbench.inputs").joinpath(LIMITS_FOLDER)
    return folder.joinpath(f"{name}.yaml").read_text(encoding="utf-8")


def load_limits(
    spec_name: str | None, limits_file: str | None = None, overrides: Sequence[str] = ()
) -> Limits:
    """The limits a run is judged by: the shipped file of ``spec_name`` (None: a CPU run), then the keys of
    ``limits_file`` (``--limits``), then ``overrides`` (``--limit KEY=VALUE``). UsageError on bad input."""
    name = shipped_limits_name(spec_name)
    origin = f"commbench/inputs/{LIMITS_FOLDER}/{name}.yaml"
    values = parse_limits(shipped_limits_text(name), origin)
    used_for = "" if name == spec_name else f" for {spec_name or 'a CPU run'}"
    sources = [f"{origin} (shipped{used_for})"]
    if limits_file is not None:
        where = f"limits file {show_path(limits_file)}"
        values.update(parse_limits(read_user_text(limits_file, "limits file"), where))
        sources.append(show_path(limits_file))
    seen: set[str] = set()
    for text in overrides:
        key, value = parse_override(text)
        if key in seen:
            raise UsageError(f"--limit {key} is given twice; keep one")
        seen.add(key)
        values[key] = value
        sources.append(f"--limit {clip(text, 80)}")
    cpu_run = spec_name is None
    required = [key for key, spec in KEYS.items() if not (cpu_run and spec.bandwidth)]
    missing = [key for key in required if key not in values]
    if missing:
        raise UsageError(
            f"limits ({', '.join(sources)}) lack {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''}; add them (see {origin})"
        )
    if cpu_run:  # a CPU run has no bandwidth to judge: bandwidth keys given by the user do not apply
        values = {key: value for key, value in values.items() if not KEYS[key].bandwidth}
    _check_consistent(values, " + ".join(sources))
    return Limits(values, source=" + ".join(sources), cpu_run=cpu_run, spec_name=spec_name)


def parse_limits(text: str, origin: str) -> dict[str, Any]:
    """The KEY -> value pairs of a limits file's YAML text, each checked (a subset of ``KEYS``); every
    problem is a one-line UsageError starting with ``origin``."""
    data = load_yaml(text, origin)
    if data is None:
        raise UsageError(f"{origin}: is empty; write limits as in commbench/inputs/{LIMITS_FOLDER}/")
    if not isinstance(data, dict):
        raise UsageError(
            f"{origin}: expected a mapping of limit groups (balanced, moe, ...), got {kind_of(data)}"
        )
    values: dict[str, Any] = {}
    _flatten(data, "", origin, values)
    return {key: _checked(key, raw, origin) for key, raw in values.items()}


def _flatten(data: dict[Any, Any], prefix: str, origin: str, out: dict[str, Any]) -> None:
    for key, value in data.items():
        if not isinstance(key, str):
            raise UsageError(f"{origin}: key {shorten(key)} is not a name; keys are words such as 'balanced'")
        path = prefix + key
        if isinstance(value, dict):
            if not any(known.startswith(path + ".") for known in KEYS):
                raise UsageError(f"{origin}: unknown group {clip(path)!r}; {_suggest(path)}")
            _flatten(value, path + ".", origin, out)
        elif path not in KEYS:
            if any(known.startswith(path + ".") for known in KEYS):
                raise UsageError(f"{origin}: {path} must be a group of limits, got {kind_of(value)}")
            raise UsageError(f"{origin}: unknown key {clip(path)!r}; {_suggest(path)}")
        else:
            out[path] = value


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, list(KEYS), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    groups = ", ".join(sorted({known.split(".")[0] for known in KEYS}))
    return f"known groups: {groups} (see commbench/inputs/{LIMITS_FOLDER}/)"


def parse_override(text: str) -> tuple[str, Any]:
    """``--limit KEY=VALUE`` as (KEY, checked value); UsageError naming the key and the fix."""
    if "=" not in text:
        raise UsageError(f"--limit {clip(text)!r}: expected KEY=VALUE, e.g. --limit {EXAMPLE}")
    key, _, value = (part.strip() for part in text.partition("="))
    if not _KEY_PATTERN.match(key):
        raise UsageError(f"--limit {clip(text)!r}: {clip(key)!r} is not a limit name; e.g. --limit {EXAMPLE}")
    if key not in KEYS:
        raise UsageError(f"--limit {key}: unknown key; {_suggest(key)}")
    if not value:
        raise UsageError(f"--limit {key}: no value after '='; e.g. --limit {key}={_example_value(key)}")
    spec = KEYS[key]
    raw: Any = value
    if spec.kind is float:
        try:
            raw = float(value)
        except ValueError:
            raise UsageError(
                f"--limit {key}: {clip(value)!r} is not a number; it is {spec.what}, "
                f"e.g. {_example_value(key)}"
            ) from None
    elif spec.kind is int and not key.endswith("_bytes"):
        if not re.fullmatch(r"[+-]?\d{1,20}", value):
            raise UsageError(f"--limit {key}: {clip(value)!r} is not a whole number; it is {spec.what}")
        raw = int(value)
    return key, _checked(key, raw, "--limit")


def _example_value(key: str) -> str:
    spec = KEYS[key]
    if spec.choices:
        return spec.choices[0]
    if key.endswith("_bytes"):
        return "256M"
    return "0.6" if key.endswith("_fraction") else str(int(spec.low) if spec.low else 1)


def _checked(key: str, raw: Any, origin: str) -> Any:
    """``raw`` as the type of ``key``, in range; UsageError naming ``origin``, the key and what it takes."""
    spec = KEYS[key]
    problem = f"{origin}: {key} must be {spec.what}, got {shorten(raw)}"
    if spec.kind is str:
        if not isinstance(raw, str) or raw.strip() not in spec.choices:
            raise UsageError(problem)
        return raw.strip()
    if key.endswith("_bytes") and isinstance(raw, str):
        match = _BYTES_PATTERN.match(raw)
        if not match:
            raise UsageError(problem)
        raw = int(match.group(1)) * _BYTES_SCALE[match.group(2).lower()]
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise UsageError(problem)
    if isinstance(raw, float) and not math.isfinite(raw):
        raise UsageError(problem)
    if spec.kind is int:
        if isinstance(raw, float) and not raw.is_integer():
            raise UsageError(problem)
        if abs(raw) > 1 << 62:
            raise UsageError(problem)
        raw = int(raw)
    else:
        raw = float(raw)
    too_low = raw <= spec.low if spec.low_open else raw < spec.low
    if too_low or raw > spec.high:
        raise UsageError(problem)
    return raw


def _check_consistent(values: Mapping[str, Any], source: str) -> None:
    """Limits that contradict each other (a FAIL floor above its WARN floor, overlapping size ranges)."""
    floors = [f"balanced.{name}" for name in BALANCED_RANGES[1:]] + [f"moe.{phase}" for phase in MOE_PHASES]
    floors += ["pairwise.nvlink", "pairwise.scaleout"]
    for prefix in floors:
        warn, fail = values.get(f"{prefix}.busbw_warn_fraction"), values.get(f"{prefix}.busbw_fail_fraction")
        if warn is not None and fail is not None and fail > warn:
            raise UsageError(
                f"limits ({source}): {prefix}.busbw_fail_fraction {fail:g} is above "
                f"{prefix}.busbw_warn_fraction {warn:g}; the FAIL floor must be at or below the WARN floor"
            )
    warn_us, fail_us = values.get("balanced.small.time_warn_us"), values.get("balanced.small.time_fail_us")
    if warn_us is not None and fail_us is not None and fail_us < warn_us:
        raise UsageError(
            f"limits ({source}): balanced.small.time_fail_us {fail_us:g} is below "
            f"balanced.small.time_warn_us {warn_us:g}; the FAIL ceiling must be at or above the WARN ceiling"
        )
    drift_warn, drift_fail = values.get("soak.drift_warn_pct"), values.get("soak.drift_fail_pct")
    if drift_warn is not None and drift_fail is not None and drift_fail < drift_warn:
        raise UsageError(
            f"limits ({source}): soak.drift_fail_pct {drift_fail:g} is below soak.drift_warn_pct "
            f"{drift_warn:g}; the FAIL drift must be at or above the WARN drift"
        )
    small, large, huge = (
        values.get(f"balanced.{name}") for name in ("small.max_bytes", "large.min_bytes", "huge.min_bytes")
    )
    if None not in (small, large, huge) and not small < large <= huge:
        raise UsageError(
            f"limits ({source}): size ranges overlap (balanced.small.max_bytes {small} < "
            f"balanced.large.min_bytes {large} <= balanced.huge.min_bytes {huge} must hold); fix the sizes"
        )

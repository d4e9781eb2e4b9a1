"""The one backend-option parser: ``--backend-option KEY=V1,V2`` text into typed, validated values.

Every backend declares its options as data (a tuple of ``BackendOption``: name, type, default, range or
choices, help; ``DeclaredOptions``), checked by ``checked_options``. The command line goes through
``parse_option_sweep`` once: its text becomes typed values (fixed, or lists of swept values) and from then on
options travel as dicts of typed values, never as text to be parsed again. Every error is one line
(UsageError, exit code 2) naming the backend, the key and the bad value.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from commbench.backends.shmem.protocol import COUNTS, GRANULARITIES, SIGNAL_OPS
from commbench.errors import UsageError
from commbench.inputs.userfiles import clip, describe_keys, shorten

OPTION_TYPES = (int, float, bool, str)
# Chunks larger than any buffer are one chunk per segment: the bounds only keep row indices and byte
# offsets inside the int32 / int64 the kernels and signal words use.
MAX_CHUNK_ROWS = (1 << 31) - 1
MAX_CHUNK_BYTES = 1 << 40
# Bounds of the modelled backends' knobs: far beyond real hardware (a phase of 1000 s, 1 PB/s per link,
# 16M ranks), they only refuse typos and keep the model's arithmetic finite.
MAX_LATENCY_US = 1e9
MAX_LINK_GBPS = 1e6
MAX_RANKS = 1 << 24
# GPU kernels: programs (a GPU has ~150 SMs; more only queue) and warps per program (Triton takes powers of
# two, at most 1024 threads).
MAX_BLOCKS = 65535
WARPS = (1, 2, 4, 8, 16, 32)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class BackendOption:
    """One option a backend accepts. ``default`` None means "not set": the backend derives the value.

    A number option (int or float) must declare its range, ``minimum`` and ``maximum``: a value outside it, or
    NaN or infinity, or a fraction for an int, is refused when parsed, in the parent, before any launch."""

    name: str
    type: type  # int, float, bool or str
    default: Any = None
    help: str = ""
    choices: tuple[Any, ...] = ()  # str options (case-insensitive) or int options: the accepted values
    minimum: float | None = None  # int and float options: the lowest accepted value ...
    exclusive_minimum: bool = False  # ... or the bound values must stay above
    maximum: float | None = None  # int and float options: the highest accepted value

    def __post_init__(self) -> None:
        if self.type not in OPTION_TYPES:
            raise TypeError(f"option {self.name}: type must be one of int, float, bool, str")
        numeric = self.type in (int, float)
        if numeric and (self.minimum is None or self.maximum is None):
            raise TypeError(f"option {self.name}: a number option declares its minimum and maximum")
        if not numeric and (self.minimum is not None or self.maximum is not None):
            raise TypeError(f"option {self.name}: only number options have a minimum or maximum")
        if self.choices and self.type not in (int, str):
            raise TypeError(f"option {self.name}: only str and int options list choices")

    def value(self, backend: str, given: Any) -> Any:
        """``given`` (a value of the option's type, or the command line's text) as a checked value."""
        typed = given if _has_type(given, self.type) else self._from_text(backend, str(given).strip())
        if self.type is float:
            typed = float(typed)
        if self.choices:
            typed = typed.lower() if self.type is str else typed
            if typed not in self.choices:
                shown = shorten(given if self.type is str else typed)
                raise UsageError(
                    f"backend {backend} option {self.name}={shown} is unknown; use one of: "
                    f"{', '.join(map(str, self.choices))}"
                )
        low, high = self.minimum, self.maximum
        if low is not None and (typed <= low if self.exclusive_minimum else typed < low):
            bound = f"> {self._show(low)}" if self.exclusive_minimum else f">= {self._show(low)}"
            raise UsageError(f"backend {backend} option {self.name}={shorten(typed)} must be {bound}")
        if high is not None and typed > high:
            raise UsageError(
                f"backend {backend} option {self.name}={shorten(typed)} must be <= {self._show(high)}"
            )
        return typed

    def _show(self, bound: float) -> str:
        """A bound as the option's type writes it: 2147483647 for an int, 1e+09 for a float."""
        return str(int(bound)) if self.type is int else f"{bound:g}"

    def _from_text(self, backend: str, text: str) -> Any:
        prefix = f"backend {backend} option {self.name}={shorten(text)}"
        if self.type is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise UsageError(f"{prefix} must be true or false")
        if self.type is int:
            try:
                return int(text)
            except ValueError:
                example = int(self.minimum) + 1 if self.minimum is not None else 1
                raise UsageError(f"{prefix} is not an integer; e.g. {self.name}={example}") from None
        if self.type is float:
            try:
                number = float(text)
            except ValueError:
                number = math.nan
            if not math.isfinite(number):
                raise UsageError(f"{prefix} is not a number; e.g. {self.name}=0.5")
            return number
        if not text:
            raise UsageError(f"{prefix} is empty")
        return text


def _has_type(value: Any, kind: type) -> bool:
    """True when ``value`` needs no parsing: its type is ``kind`` (an int also serves a float option)."""
    if isinstance(value, bool) or kind is bool:
        return isinstance(value, bool) and kind is bool
    if kind is float:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, kind)


def _declared(
    backend: str, declared: Sequence[BackendOption], keys: Sequence[str]
) -> dict[str, BackendOption]:
    """The declarations by name; UsageError naming any key the backend does not declare."""
    by_name = {option.name: option for option in declared}
    unknown = [key for key in keys if key not in by_name]
    if unknown and not by_name:
        raise UsageError(f"backend {backend} takes no options, got {describe_keys(unknown)}; remove them")
    if unknown:
        raise UsageError(
            f"backend {backend} has no option(s) {describe_keys(unknown)}; known: {', '.join(by_name)}"
        )
    return by_name


def checked_options(
    backend: str, declared: Sequence[BackendOption], options: Mapping[str, Any]
) -> dict[str, Any]:
    """Every declared option's value: ``options`` (typed values or text; None = not given) over the
    defaults, checked; UsageError on an unknown key or a bad value."""
    by_name = _declared(backend, declared, list(options))
    given = {key: by_name[key].value(backend, value) for key, value in options.items() if value is not None}
    return {option.name: given.get(option.name, option.default) for option in declared}


class DeclaredOptions:
    """Mixed into a backend class: its ``OPTIONS`` as data, checked by ``check_options`` (which the CLI calls
    for every setting before launching, so a bad knob is one line and exit code 2)."""

    name: ClassVar[str]
    OPTIONS: ClassVar[tuple[BackendOption, ...]] = ()

    @classmethod
    def check_options(cls, options: Mapping[str, Any], world_size: int | None = None) -> dict[str, Any]:
        """Every declared option's value (``options`` over the defaults); UsageError on a bad key or value.

        With ``world_size`` (the launch's, in the parent) a backend also checks what its options mean for
        that many ranks, everything its constructor would refuse (sim: the spec, the model knobs, the
        layout), so no rank is left to find it."""
        return checked_options(cls.name, cls.OPTIONS, options)


class PutSignalOptions(DeclaredOptions):
    """``DeclaredOptions`` of a one-sided backend with the put/signal knobs (``put_signal_options``): their
    combinations checked too (``checked_put_signal``)."""

    @classmethod
    def check_options(cls, options: Mapping[str, Any], world_size: int | None = None) -> dict[str, Any]:
        return dict(checked_put_signal(cls.name, super().check_options(options)))


@dataclass(frozen=True)
class OptionSweep:
    """``--backend-option`` values: keys with one value are ``fixed``, keys with several are ``swept``
    (the cartesian product, first key outermost, in the order given)."""

    fixed: dict[str, Any]
    swept: dict[str, list[Any]]

    def settings(self) -> list[dict[str, Any]]:
        """Every combination of the swept values ([{}] when nothing is swept)."""
        keys = list(self.swept)
        return [dict(zip(keys, values, strict=True)) for values in itertools.product(*self.swept.values())]

    def describe(self) -> str:
        """The swept values in one line, e.g. "chunk_rows=4,16 x signal=chunk,segment"."""
        return " x ".join(f"{key}={','.join(map(str, values))}" for key, values in self.swept.items())


def split_option_pairs(pairs: Sequence[str]) -> dict[str, list[str]]:
    """KEY=VALUE or KEY=V1,V2,... pairs (each key once, no empty value) as key -> value texts, in order."""
    texts: dict[str, list[str]] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(
                f"--backend-option {shorten(pair)} is not KEY=VALUE; e.g. --backend-option num_blocks=24 "
                "(or num_blocks=16,32,64 to sweep)"
            )
        if key in texts:
            raise UsageError(
                f"--backend-option {clip(key)} is given twice; list its values once, e.g. "
                f"{clip(key)}=V1,V2 to sweep"
            )
        texts[key] = [part.strip() for part in text.split(",")]
        if not all(texts[key]):
            raise UsageError(
                f"--backend-option {shorten(pair)} has an empty value; give {clip(key)}=VALUE or "
                f"{clip(key)}=V1,V2,... without empty entries"
            )
    return texts


def parse_option_sweep(backend: str, declared: Sequence[BackendOption], pairs: Sequence[str]) -> OptionSweep:
    """The command line's ``--backend-option`` pairs as typed values of ``backend``'s declared options; a
    value listed twice runs once. UsageError (one line) on bad syntax, an unknown key or a bad value."""
    texts = split_option_pairs(pairs)
    by_name = _declared(backend, declared, list(texts))
    fixed: dict[str, Any] = {}
    swept: dict[str, list[Any]] = {}
    for key, values in texts.items():
        typed = list(dict.fromkeys(by_name[key].value(backend, text) for text in values))
        if len(typed) == 1:
            fixed[key] = typed[0]
        else:
            swept[key] = typed
    return OptionSweep(fixed, swept)


def put_signal_options(default_chunk_bytes: int) -> tuple[BackendOption, ...]:
    """The knobs of the one-sided put/signal protocol, shared by shmem-emu and nvshmem."""
    return (
        BackendOption(
            "chunk_rows",
            int,
            None,
            "rows per put-with-signal; default: chunk_bytes / row size",
            minimum=1,
            maximum=MAX_CHUNK_ROWS,
        ),
        BackendOption(
            "chunk_bytes",
            int,
            default_chunk_bytes,
            "bytes per put-with-signal",
            minimum=1,
            maximum=MAX_CHUNK_BYTES,
        ),
        BackendOption("signal", str, "chunk", "one signal per chunk or per segment", choices=GRANULARITIES),
        BackendOption("signal_op", str, "add", "signal words are added to or set", choices=tuple(SIGNAL_OPS)),
        BackendOption(
            "counts",
            str,
            "host",
            "host: counts all-gathered, layout on the host; device: counts put to the peers, layout on the "
            "device (no host sync; ADD signals)",
            choices=COUNTS,
        ),
    )


def checked_put_signal(backend: str, settings: Mapping[str, Any]) -> Mapping[str, Any]:
    """``settings`` of the put/signal knobs, or UsageError for a combination the protocol has not: counts
    on the device keep one running total per source on the device, which only ADD signals give."""
    if settings.get("counts") == "device" and settings.get("signal_op") == "set":
        raise UsageError(
            f"backend {backend} option counts=device keeps the signal totals on the device, which needs "
            "signal_op=add; drop signal_op=set or use counts=host"
        )
    return settings

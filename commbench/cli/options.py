"""The command line's option types, and the click options generated from the run configuration.

Every option of run, suite, profile and pattern is a field of ``commbench.run.config`` (its help, flag,
type and commands declared there once); ``config_options(command)`` turns the fields a command takes into
click options, in declaration order, and ``config_from(command, params)`` builds the checked ``RunConfig``.
Help texts state units and defaults. Nothing here imports torch, numpy or pandas (``commbench --help``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import click

from commbench.run.config import InjectedDelay, RunConfig
from commbench.run.declare import MAX_BYTES, OptionSpec, option_spec

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class ByteSize(click.ParamType):
    """A byte count with an optional binary suffix, as nccl-tests -b/-e: 4096, 64K, 16M, 1G (K = 1024)."""

    name = "BYTES"
    # ASCII digits only: \d would take "²" and "①", which int() then refuses.
    _pattern = re.compile(r"^\s*(\d+)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE | re.ASCII)
    _scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}

    def __init__(self, minimum: int = 0) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            count = value
        else:
            match = self._pattern.match(str(value))
            if not match:
                self.fail(
                    f"{str(value)[:40]!r} is not a byte count; use e.g. 4096, 64K, 16M or 1G (K = 1024)",
                    param,
                    ctx,
                )
            digits = match.group(1).lstrip("0") or "0"
            # More digits than 2^50 has: too large, without converting a 100,000-digit number first.
            count = MAX_BYTES + 1 if len(digits) > 16 else int(digits) * self._scale[match.group(2).lower()]
        if count > MAX_BYTES:
            # Far beyond any machine (the memory estimate refuses much less); keeps every later product of a
            # size within int64 and float64's exact integers.
            self.fail(f"{str(value)[:40]!r} is above the largest size taken, 1P (2^50 bytes)", param, ctx)
        if count < self.minimum:
            self.fail(f"{str(value)[:40]!r} is below the smallest size taken, {self.minimum} B", param, ctx)
        return count


class FiniteFloat(click.FloatRange):
    """A finite number in a range. click's FLOAT takes "nan" and "inf", and NaN passes every range check, so
    every float option uses this type (tests/cli/test_bad_input.py checks that none uses another)."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{str(value)[:40]!r} is not a finite number", param, ctx)
        return float(super().convert(number, param, ctx))


def finite_float(
    min: float | None = None,  # noqa: A002 - click's own names
    max: float | None = None,  # noqa: A002
    min_open: bool = False,
    max_open: bool = False,
) -> FiniteFloat:
    """A FiniteFloat type: finite, and within [min, max] (open ends as given)."""
    return FiniteFloat(min=min, max=max, min_open=min_open, max_open=max_open)


BYTES = ByteSize()


class InjectDelay(click.ParamType):
    """RANK:MICROSECONDS or SRC-DST:MICROSECONDS -> ``InjectedDelay``: the hidden --inject-delay test hook."""

    name = "RANK:US|SRC-DST:US"
    _rank = re.compile(r"^\s*(\d{1,8})\s*:\s*(\d{1,8}(?:\.\d*)?)\s*$", re.ASCII)
    _pair = re.compile(r"^\s*(\d{1,8})\s*-\s*(\d{1,8})\s*:\s*(\d{1,8}(?:\.\d*)?)\s*$", re.ASCII)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> InjectedDelay:
        if isinstance(value, InjectedDelay):
            return value
        if match := self._rank.match(str(value)):
            if float(match.group(2)) > 0:
                return InjectedDelay(int(match.group(1)), None, float(match.group(2)) / 1e6)
        elif (match := self._pair.match(str(value))) and float(match.group(3)) > 0:
            return InjectedDelay(int(match.group(1)), int(match.group(2)), float(match.group(3)) / 1e6)
        self.fail(
            f"{str(value)[:40]!r} is not RANK:MICROSECONDS or SRC-DST:MICROSECONDS; use e.g. 2:5000 or "
            "1-2:5000",
            param,
            ctx,
        )


class Duration(click.ParamType):
    """A duration as operators write it: 90s, 30m, 2h, 1h30m, or plain seconds -> seconds (float)."""

    name = "DURATION"
    _part = re.compile(r"(\d{1,7}(?:\.\d+)?)\s*([smhd]?)", re.IGNORECASE | re.ASCII)
    _scale = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
    MAX_S = 7 * 86400.0

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        text = str(value).strip()
        parts = self._part.findall(text)
        seconds = sum(float(number) * self._scale[unit.lower()] for number, unit in parts)
        if not parts or self._part.sub("", text).strip() or not 0 < seconds <= self.MAX_S:
            self.fail(
                f"{text[:40]!r} is not a duration of up to 7 days; use e.g. 30m, 2h or 1h30m", param, ctx
            )
        return seconds


def _model_help() -> str:
    try:
        from commbench.inputs.models import list_models

        names = ", ".join(list_models())
    except Exception:  # help must work even if presets cannot be listed
        names = "see commbench/inputs/presets/"
    return f"Model preset name ({names}) or path to a YAML file with the same keys."


def _spec_help(base: str) -> str:
    try:
        from commbench.inputs.specs import list_specs

        names = ", ".join(list_specs())
    except Exception:  # help must work even if the catalogue cannot be listed
        names = "see commbench/inputs/catalogue/"
    return base.replace("a catalogue name", f"a catalogue name ({names})")


def _backend_choices() -> list[str]:
    from commbench.backends import BACKENDS

    return ["auto", *BACKENDS]


def _click_type(spec: OptionSpec) -> Any:
    """The click type of a config field's ``kind``."""
    if spec.kind == "int":
        return click.IntRange(min=spec.low, max=spec.high, min_open=spec.open_low, max_open=spec.open_high)
    if spec.kind == "float":
        return finite_float(spec.low, spec.high, spec.open_low, spec.open_high)
    if spec.kind == "bytes":
        return BYTES if spec.low is None else ByteSize(minimum=int(spec.low))
    if spec.kind == "duration":
        return Duration()
    if spec.kind == "choice":
        return click.Choice(list(spec.choices))
    if spec.kind == "backend":
        return click.Choice(_backend_choices())
    if spec.kind == "delay":
        return InjectDelay()
    if spec.kind == "file":
        return click.Path(dir_okay=False)
    if spec.kind == "dir":
        return click.Path(file_okay=False)
    return None  # str, model, spec


def _click_option(item: dataclasses.Field[Any], spec: OptionSpec) -> Decorator:
    flag = spec.flag or "--" + item.name.replace("_", "-")
    help_text = {"model": _model_help(), "spec": _spec_help(spec.help)}.get(spec.kind, spec.help)
    default = item.default if item.default is not dataclasses.MISSING else None
    if spec.kind == "flag":
        return click.option(
            flag, item.name, is_flag=True, default=bool(default), help=help_text, hidden=spec.hidden
        )
    if spec.kind == "switch":
        name = flag[2:]
        shown = spec.show_default and default is not None
        return click.option(
            f"{flag}/--no-{name}",
            item.name,
            default=default,
            show_default=shown,
            help=help_text,
            hidden=spec.hidden,
        )
    if spec.kind == "bytes" and isinstance(default, int):
        shown_default: Any = _size_text(default)
    else:
        shown_default = default
    return click.option(
        flag,
        item.name,
        type=_click_type(spec),
        default=None if spec.multiple else shown_default,
        multiple=spec.multiple,
        show_default=spec.show_default and default not in (None, ()),
        hidden=spec.hidden,
        metavar=spec.metavar,
        help=help_text,
    )


def _size_text(count: int) -> str:
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift}{suffix}"
    return str(count)


def config_fields(command: str) -> list[tuple[dataclasses.Field[Any], OptionSpec]]:
    """The config fields ``command`` takes as options, in declaration order."""
    found = []
    for section in dataclasses.fields(RunConfig):
        if section.name == "command":
            continue
        for item in dataclasses.fields(section.default_factory()):  # type: ignore[misc]
            spec = option_spec(item)
            if spec is not None and command in spec.commands:
                found.append((item, spec))
    return found


def config_options(command: str) -> Decorator:
    """Every config option of ``command`` as click options (help lists them in declaration order)."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for item, spec in reversed(config_fields(command)):
            func = _click_option(item, spec)(func)
        return func

    return decorate


def config_values(command: str, params: dict[str, Any]) -> dict[str, Any]:
    """Takes (pops) the config options of ``command`` out of its click parameters: field name -> value,
    multiple options as tuples."""
    values = {}
    for item, spec in config_fields(command):
        if item.name in params:
            value = params.pop(item.name)
            values[item.name] = tuple(value) if spec.multiple else value
    return values


def config_from(command: str, params: dict[str, Any]) -> RunConfig:
    """The checked run configuration of a launched command (run, profile, suite) from its parameters."""
    return RunConfig.from_options(command, config_values(command, params))

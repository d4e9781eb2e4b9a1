"""The run configuration as a report folder keeps it: meta.json's ``config`` written from the tree, and read
back by field name (this version's tree, or an earlier version's ``args``) for the report and ``--resume``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from commbench.run.config import RunConfig, option_spec


def config_to_meta(config: RunConfig) -> dict[str, Any]:
    """meta.json's ``config``: the tree as plain JSON values, its field names as keys."""
    return _plain(dataclasses.asdict(config))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def config_leaves(meta: dict[str, Any]) -> dict[str, Any]:
    """The options a report folder was run with, by field name: meta.json's ``config`` (this version), or
    its ``args`` (earlier versions, their keys mapped to today's field names); {} when it has neither."""
    config = meta.get("config")
    if isinstance(config, dict):
        return {
            key: value
            for section in config.values()
            if isinstance(section, dict)
            for key, value in section.items()
        }
    args = meta.get("args")
    if not isinstance(args, dict):
        return {}
    renamed = {"spec_text": "spec", "tokens_per_rank": "tokens", "limit_overrides": "limit", "soak": "soak_s"}
    return {renamed.get(str(key), str(key)): value for key, value in args.items()}


def command_options(meta: dict[str, Any]) -> dict[str, Any]:
    """The options of the command a report folder was run with, by field name: only those that command
    takes (a suite's folder does not list run's --pattern or --tokens default); every saved argument of a
    folder of an earlier version."""
    leaves = config_leaves(meta)
    command = meta.get("subcommand")
    if not isinstance(meta.get("config"), dict) or not isinstance(command, str):
        return leaves
    taken = {
        item.name
        for section in dataclasses.fields(RunConfig)
        if section.name != "command"
        for item in dataclasses.fields(section.default_factory())  # type: ignore[misc]
        if (spec := option_spec(item)) is not None and command in spec.commands
    }
    return {key: value for key, value in leaves.items() if key in taken}


def meta_values(meta: dict[str, Any]) -> dict[str, Any]:
    """What a report folder was run with, by name: its options (``config_leaves``) and what the command
    made of them (meta.json's ``plan``: sizes, repeats, the resolved backend, a trace's source)."""
    plan = meta.get("plan")
    return {**config_leaves(meta), **(plan if isinstance(plan, dict) else {})}

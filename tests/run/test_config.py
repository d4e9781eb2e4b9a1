"""The run configuration: every option declared once as a field, the command line generated from the fields,
the tree checked once, meta.json's config as the tree itself, and --resume comparing trees."""

import dataclasses
import json

import click
import pytest

from commbench.cli.main import cli
from commbench.cli.options import config_fields
from commbench.errors import UsageError
from commbench.run.config import RESUME_FREE, InjectedDelay, RunConfig
from commbench.run.config_meta import config_leaves, config_to_meta, meta_values
from commbench.run.declare import option_spec

COMMANDS = ("run", "profile", "suite")


def _leaves() -> list[dataclasses.Field]:
    return [
        item
        for section in dataclasses.fields(RunConfig)
        if section.name != "command"
        for item in dataclasses.fields(section.default_factory())
    ]


def test_leaf_names_are_unique_across_the_tree():
    names = [item.name for item in _leaves()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("command", [*COMMANDS, "pattern", "simulate"])
def test_each_commands_options_are_exactly_the_fields_that_name_it(command):
    params = {param.name for param in cli.commands[command].params if isinstance(param, click.Option)}
    declared = {item.name for item, _ in config_fields(command)}
    assert declared <= params
    if command in COMMANDS:  # run, profile and suite take nothing but config fields
        assert params == declared


def test_an_option_shared_by_run_and_suite_is_one_field_with_one_help():
    shared = {item.name for item, _ in config_fields("run")} & {
        item.name for item, _ in config_fields("suite")
    }
    assert {"check", "timing", "warmup", "iters", "spec", "limits", "baseline", "allow_cpu"} <= shared
    for command in ("run", "suite"):
        [option] = [p for p in cli.commands[command].params if p.name == "check"]
        [field] = [item for item in _leaves() if item.name == "check"]
        assert option.help == option_spec(field).help


def test_defaults_that_depend_on_the_command_are_resolved_once():
    run = RunConfig.from_options("run", {"world_size": 2})
    suite = RunConfig.from_options("suite", {"world_size": 2, "quick": True})
    assert (run.timing.warmup, run.timing.iters, run.harness.imbalance_cost) == (5, 20, False)
    assert (suite.timing.warmup, suite.timing.iters, suite.harness.imbalance_cost) == (2, 5, True)
    profile = RunConfig.from_options("profile", {"world_size": 2})
    assert profile.harness.profile and profile.timing.timing == "iteration"


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"check": "every", "timing": "window"}, "--check every needs --timing iteration"),
        ({"profile": True, "timing": "window"}, "drop --timing window"),
        ({"trace": True, "timing": "window"}, "drop --timing window"),
        ({"spec": " "}, "--spec '' names no spec"),
        ({"resume": "x", "out": "y"}, "leave out --out"),
        ({"ranks_per_domain": 3}, "--ranks-per-domain 3 does not divide the 4 ranks"),
        ({"inject_delay": (InjectedDelay(1, None, 0.001), InjectedDelay(1, None, 0.002))}, "names 1 twice"),
        ({"inject_delay": (InjectedDelay(4, None, 0.001),)}, "names rank 4, but ranks are 0..3"),
        ({"inject_delay": (InjectedDelay(1, 1, 0.001),)}, "needs two different ranks"),
    ],
)
def test_rules_that_span_fields_are_checked_once(values, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        RunConfig.from_options("run", {"world_size": 4, **values})


def test_meta_holds_the_tree_under_the_field_names_and_reads_back():
    config = RunConfig.from_options("suite", {"world_size": 4, "quick": True, "limit": ("a.b=1",)})
    meta = {"config": json.loads(json.dumps(config_to_meta(config))), "plan": {"sizes": [1024]}}
    leaves = config_leaves(meta)
    assert leaves["quick"] is True and leaves["limit"] == ["a.b=1"] and leaves["world_size"] == 4
    assert meta["config"]["harness"]["check"] == "checksum" and meta_values(meta)["sizes"] == [1024]


def test_an_earlier_meta_layout_still_reads_under_todays_names():
    old = {"args": {"check": "every", "spec": None, "tokens_per_rank": 512, "limits": None}}
    assert config_leaves(old) == {"check": "every", "spec": None, "tokens": 512, "limits": None}


def test_resume_compares_every_option_but_those_that_do_not_change_a_case():
    assert {"timeout_s", "limits", "limit", "baseline", "inject_delay", "out", "resume"} == set(RESUME_FREE)
    a = config_leaves({"config": config_to_meta(RunConfig.from_options("run", {"world_size": 2}))})
    b = config_leaves(
        {"config": config_to_meta(RunConfig.from_options("run", {"world_size": 2, "timeout_s": 60.0}))}
    )
    assert {key for key in a if a[key] != b[key]} == {"timeout_s"}


def test_a_folder_lists_only_the_options_its_command_takes():
    from commbench.run.config_meta import command_options

    config = RunConfig.from_options("suite", {"world_size": 4, "quick": True})
    options = command_options({"subcommand": "suite", "config": config_to_meta(config)})
    assert options["quick"] is True and "tokens" not in options and "pattern" not in options
    old = {"subcommand": "run", "args": {"tokens_per_rank": 64}}
    assert command_options(old) == {"tokens": 64}  # an earlier folder: every saved argument

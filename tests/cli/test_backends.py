"""``commbench backends``: every built-in backend and adapter listed with whether it runs here and why not."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from commbench.backends import BUILTIN_BACKENDS
from commbench.cli import cli
from commbench.cli.backends import HEADERS


def test_the_table_lists_every_builtin_with_its_availability_and_knobs():
    result = CliRunner().invoke(cli, ["backends"])
    assert result.exit_code == 0, result.output
    header, *lines = result.output.splitlines()
    assert header.split()[:2] == list(HEADERS[:2])
    by_name = {line.split()[0]: line for line in lines}
    assert set(BUILTIN_BACKENDS) <= set(by_name)
    assert "built-in adapter (DeepEP)" in by_name["deep-ep"] and "num_sms" in by_name["deep-ep"]
    assert " yes " in by_name["gloo"] and " no " in by_name["mock"]  # moves data: gloo yes, mock no
    if torch.cuda.device_count() < 1:
        assert "this host has no CUDA device" in by_name["nvshmem"]


def test_json_says_why_each_adapter_is_unavailable_and_which_api_it_follows():
    result = CliRunner().invoke(cli, ["backends", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["entry_point_group"] == "commbench.backends" and document["discovery_error"] is None
    entries = {entry["name"]: entry for entry in document["backends"]}
    gloo = entries["gloo"]
    assert gloo["available"] and gloo["reason"] is None and gloo["builtin"] and gloo["moves_data"]
    for name, library in (
        ("deep-ep", "DeepEP 2.1.0"),
        ("pplx", "pplx-kernels 0.0.1"),
        ("nccl-ep", "nccl4py 0.3.1"),
    ):
        entry = entries[name]
        assert entry["library_api"].startswith(library)
        if not entry["available"]:
            assert entry["reason"].startswith(f"--backend {name} needs")
    knobs = {knob["name"]: knob for knob in entries["deep-ep"]["knobs"]}
    assert (
        knobs["mode"]["choices"] == ["normal", "low_latency", "hybrid", "elastic"]
        and knobs["num_sms"]["maximum"] == 1024
    )

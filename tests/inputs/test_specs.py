import math
from dataclasses import asdict

import pytest

from commbench.errors import UsageError
from commbench.inputs.specs import (
    DEFAULT_SPEC_NAME,
    SystemSpec,
    list_specs,
    load_spec,
    parse_spec,
    spec_from_dict,
)

GOOD = """
name: test-system
gpus_per_domain: 8
gpus_per_host: 4
nvlink_GBps_per_direction: 450
nic_Gbps_per_direction: 400
"""


def test_catalogue_ships_the_systems_of_the_issue():
    assert {"gb300-nvl72", "gb200-nvl72", "hgx-h100", "hgx-h200", "hgx-b200"} <= set(list_specs())
    assert load_spec().name == DEFAULT_SPEC_NAME == "gb300-nvl72"


def test_gb300_figures_and_directions():
    spec = load_spec("gb300-nvl72")
    assert spec.gpus_per_domain == 72 and spec.ranks_per_host == 4
    assert spec.nvlink_GBps_per_direction == 900
    assert spec.nvlink_GBps_bidirectional == 1800  # 18 links x 100 GB/s
    assert spec.nvlink_links_per_gpu == 18
    assert spec.nic_GBps_per_direction == 100  # 800 Gb/s one way
    assert spec.aggregate_GBps_per_direction(72) == 65000  # 130 TB/s bidirectional, halved
    assert spec.aggregate_GBps_per_direction(36) == 32500  # scaled to the ranks used


@pytest.mark.parametrize(
    ("name", "per_domain", "nvlink", "nic_GBps"),
    [
        ("gb200-nvl72", 72, 900, 50),
        ("hgx-h100", 8, 450, 50),
        ("hgx-h200", 8, 450, 50),
        ("hgx-b200", 8, 900, 50),
        ("hgx-h800", 8, 200, 50),
    ],
)
def test_other_specs(name, per_domain, nvlink, nic_GBps):
    spec = load_spec(name)
    assert (spec.gpus_per_domain, spec.nvlink_GBps_per_direction, spec.nic_GBps_per_direction) == (
        per_domain,
        nvlink,
        nic_GBps,
    )
    # The aggregate is the per-GPU bidirectional figure times the GPUs (NVL72's 130 TB/s rounds 129.6 up).
    per_gpu_total = spec.domain_aggregate_GBps_bidirectional / spec.gpus_per_domain
    assert per_gpu_total == pytest.approx(2 * spec.nvlink_GBps_per_direction, rel=0.01)


def test_every_shipped_value_has_a_source_comment():
    from importlib import resources

    for name in list_specs():
        text = resources.files("commbench.inputs").joinpath("catalogue").joinpath(f"{name}.yaml").read_text()
        assert "Source" in text, name


def test_spec_file_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(GOOD)
    spec = load_spec(str(path))
    assert spec.name == "test-system" and spec.source == str(path)
    assert spec.aggregate_GBps_per_direction(8) == 8 * 450  # default aggregate: GPUs x per-GPU


def test_defaults_for_optional_keys():
    spec = parse_spec(GOOD)
    assert spec.rail_optimized and spec.oversubscription == 1.0 and spec.pod_gpus == 0
    assert spec.nvlink_efficiency is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD.replace("nic_Gbps_per_direction: 400\n", ""), "missing key(s) nic_Gbps_per_direction"),
        (GOOD.replace("450", "0"), "nvlink_GBps_per_direction must be positive"),
        (GOOD.replace("450", "-5"), "must be positive"),
        (GOOD + "nvlink_GBps_bidirectional: 900\n", "unknown key(s) nvlink_GBps_bidirectional"),
        ("name: [unclosed\n", "bad YAML"),
        ("- just\n- a list\n", "expected a mapping"),
        (GOOD.replace("450", "fast"), "must be a number"),
        (GOOD.replace("gpus_per_host: 4", "gpus_per_host: 2.5"), "whole number"),
        (GOOD.replace("gpus_per_host: 4", "gpus_per_host: 3"), "not a multiple of gpus_per_host"),
        (GOOD + "oversubscription: 0.5\n", "oversubscription 0.5 < 1"),
        (GOOD + "nvlink_efficiency: 1.5\n", "nvlink_efficiency 1.5 > 1"),
        (GOOD + "rail_optimized: maybe\n", "must be true or false"),
        (GOOD.replace("450", ".nan"), "must be positive"),
        (GOOD + "net_max_recvs: 0\n", "net_max_recvs must be positive"),
    ],
)
def test_bad_spec_files_give_one_line_errors(text, expected):
    with pytest.raises(UsageError) as info:
        parse_spec(text, source="bad.yaml")
    message = str(info.value)
    assert expected in message
    assert "bad.yaml" in message and "\n" not in message


def test_unknown_name_and_missing_file():
    with pytest.raises(UsageError, match="unknown spec 'nvl1000'"):
        load_spec("nvl1000")
    with pytest.raises(UsageError, match="does not exist"):
        load_spec("/nonexistent/spec.yaml")


def test_spec_from_dict_reads_back_a_saved_spec():
    for name in list_specs():
        spec = load_spec(name)
        saved = {**asdict(spec), "description_line": spec.describe(), "added_by_a_newer_version": 1}
        assert spec_from_dict(saved, "meta.json") == spec
    with pytest.raises(UsageError, match="spec in meta.json: nvlink_GBps_per_direction must be a number"):
        spec_from_dict({**asdict(load_spec()), "nvlink_GBps_per_direction": "fast"}, "meta.json")
    with pytest.raises(UsageError, match="missing key"):
        spec_from_dict({"name": "x"}, "meta.json")


def test_load_spec_passes_a_spec_through():
    spec = SystemSpec(name="x", gpus_per_domain=2, nvlink_GBps_per_direction=1.0, nic_Gbps_per_direction=8.0)
    assert load_spec(spec) is spec
    assert math.isclose(spec.nic_GBps_per_direction, 1.0)


# Dense (no 2:4 sparsity) tensor-core peaks per GPU, TFLOP/s: half the datasheets' "with sparsity" figures.
DENSE_PEAKS = {
    "gb300-nvl72": (2500, 5000),
    "gb200-nvl72": (2500, 5000),
    "hgx-b200": (2250, 4500),
    "hgx-h100": (989.5, 1979),
    "hgx-h200": (989.5, 1979),
    "hgx-h800": (989.5, 1979),
}


@pytest.mark.parametrize("name", sorted(DENSE_PEAKS))
def test_every_catalogue_spec_has_its_dense_peaks_with_a_source(name):
    from importlib import resources

    spec = load_spec(name)
    assert (spec.dense_tflops_bf16, spec.dense_tflops_fp8) == DENSE_PEAKS[name]
    assert spec.dense_tflops_fp8 == 2 * spec.dense_tflops_bf16
    lines = resources.files("commbench.inputs").joinpath("catalogue", f"{name}.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("dense_tflops_bf16:"))
    comment = " ".join(line for line in lines[max(0, at - 4) : at] if line.startswith("#"))
    assert "Source: NVIDIA" in comment and "sparsity" in comment and "dense" in comment


def test_dense_peaks_are_optional_and_checked():
    spec = parse_spec(GOOD)
    assert spec.dense_tflops_bf16 is None and spec.dense_tflops_fp8 is None
    assert parse_spec(GOOD + "dense_tflops_bf16: 1000\n").dense_tflops_bf16 == 1000.0
    for bad, words in (("0", "must be positive"), ("-3", "must be positive"), ("fast", "must be a number")):
        with pytest.raises(UsageError, match=f"dense_tflops_fp8 {words}"):
            parse_spec(GOOD + f"dense_tflops_fp8: {bad}\n", source="bad.yaml")

"""Acceptance limits: shipped files (every value sourced), loading, overrides and every kind of bad input."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from commbench.errors import UsageError
from commbench.inputs.limits import (
    CPU_LIMITS,
    GENERIC_LIMITS,
    KEYS,
    LIMITS_FOLDER,
    load_limits,
    parse_override,
    shipped_limits_name,
    shipped_limits_text,
)
from commbench.inputs.specs import list_specs, load_spec

BANDWIDTH_KEYS = {key for key, spec in KEYS.items() if spec.bandwidth}


def _refused(match: str, *args, **kwargs) -> UsageError:
    with pytest.raises(UsageError, match=match) as info:
        load_limits(*args, **kwargs)
    assert "\n" not in str(info.value) and info.value.exit_code == 2
    return info.value


def test_every_shipped_spec_has_complete_limits():
    for name in list_specs():
        assert shipped_limits_name(name) == name
        limits = load_limits(name)
        assert set(limits.values) == set(KEYS), name
        assert not limits.cpu_run and limits.spec_name == name
        assert f"{LIMITS_FOLDER}/{name}.yaml" in limits.source


def test_every_shipped_value_has_a_comment_saying_where_it_comes_from():
    folder = resources.files("commbench.inputs").joinpath(LIMITS_FOLDER)
    names = [p.name for p in folder.iterdir() if p.name.endswith(".yaml")]
    assert {f"{CPU_LIMITS}.yaml", f"{GENERIC_LIMITS}.yaml"} <= set(names)
    for name in names:
        lines = folder.joinpath(name).read_text().splitlines()
        assert lines[0].startswith("#"), f"{name}: no header comment"
        for number, line in enumerate(lines):
            value = re.match(r"^\s*[a-z_]+:\s*\S", line)  # a leaf (a group line ends with ':')
            if value and "#" not in line:
                previous = lines[number - 1].strip()
                assert previous.startswith("#"), f"{name}:{number + 1}: {line.strip()} has no comment"


def test_the_catalogue_lists_no_limits_file_as_a_spec():
    assert not any("limits" in name or name in (CPU_LIMITS, GENERIC_LIMITS) for name in list_specs())


# Published nccl-tests alltoall_perf busbw in one GB300 NVL72 rack (OCI quick-start README, NCCL 2.28.7):
# (GPUs, size bytes, busbw GB/s) and small-size times (GPUs, size, us). A healthy rack like these must PASS.
GB300_BUSBW = [
    (4, 8 << 20, 196.58), (4, 256 << 20, 490.93), (4, 1 << 30, 553.75), (4, 2 << 30, 614.05),
    (4, 16 << 30, 627.69), (8, 8 << 20, 218.53), (8, 256 << 20, 561.64), (8, 16 << 30, 685.06),
    (64, 8 << 20, 113.90), (64, 32 << 20, 139.98), (64, 256 << 20, 570.55), (64, 16 << 30, 666.92),
]  # fmt: skip
GB300_TIMES = [(4, 512 << 10, 14.50), (8, 4 << 20, 37.98), (64, 512 << 10, 32.65), (64, 4 << 20, 46.68)]


@pytest.mark.parametrize(("ranks", "size", "busbw"), GB300_BUSBW)
def test_published_gb300_figures_pass_the_shipped_floors(ranks, size, busbw):
    limits = load_limits("gb300-nvl72")
    size_range = limits.balanced_range(size)
    assert size_range != "small"
    floor = limits.balanced_floor(size_range)
    assert busbw >= floor.warn_fraction * 900, (size_range, busbw / 900)
    # ... and a rack at 80% of the published figure fails or warns in the bandwidth ranges that matter.
    if size_range in ("large", "huge"):
        assert 0.8 * busbw < floor.warn_fraction * 900


@pytest.mark.parametrize(("ranks", "size", "time_us"), GB300_TIMES)
def test_published_gb300_small_times_pass_the_latency_ceiling(ranks, size, time_us):
    limits = load_limits("gb300-nvl72")
    assert limits.balanced_range(size) == "small"
    warn_us, fail_us = limits.small_ceilings_us(ranks, size * (ranks - 1) / ranks, 900)
    assert time_us <= warn_us < fail_us


def test_gb300_plateau_floor_is_the_documented_fraction_of_900():
    limits = load_limits("gb300-nvl72")
    huge = limits.balanced_floor("huge")
    assert (huge.warn_fraction, huge.fail_fraction) == (0.65, 0.60)
    assert limits.balanced_range(2 << 30) == "huge" and limits.balanced_range(4 << 20) == "small"
    assert limits.balanced_range((4 << 20) + 1) == "medium" and limits.balanced_range(256 << 20) == "large"


def test_cpu_run_limits_hold_no_bandwidth_limit():
    limits = load_limits(None)
    assert limits.cpu_run and limits.spec_name is None
    assert not BANDWIDTH_KEYS & set(limits.values)
    assert limits.value("balanced.huge.busbw_fail_fraction") is None
    assert limits.value("correctness.max_wrong") == 0 and limits.spread.min_ranks == 3
    # A bandwidth override is checked, then has nothing to apply to on a CPU run.
    assert (
        load_limits(None, overrides=["balanced.large.busbw_fail_fraction=0.3"]).value(
            "balanced.large.busbw_fail_fraction"
        )
        is None
    )
    _refused("must be a fraction", None, overrides=["balanced.large.busbw_fail_fraction=3"])


def test_a_user_spec_file_gets_the_generic_limits():
    limits = load_limits("my-own-rack")
    assert shipped_limits_name("my-own-rack") == GENERIC_LIMITS
    assert f"{GENERIC_LIMITS}.yaml" in limits.source and "for my-own-rack" in limits.source
    assert set(limits.values) == set(KEYS)


def test_overrides_replace_one_key_each():
    limits = load_limits(
        "gb300-nvl72",
        overrides=[
            "balanced.large.busbw_fail_fraction=0.3",
            " balanced.huge.min_bytes = 4GiB ",
            "spread.confirm_rule=majority",
            "spread.confirm_reruns=0",
        ],
    )
    assert limits.value("balanced.large.busbw_fail_fraction") == 0.3
    assert limits.value("balanced.huge.min_bytes") == 4 << 30
    assert limits.spread.confirm_rule == "majority" and limits.spread.confirm_reruns == 0
    assert limits.value("balanced.large.busbw_warn_fraction") == 0.52  # the rest as shipped
    assert "--limit balanced.large.busbw_fail_fraction=0.3" in limits.source


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("balanced.large.busbw_fail_fraction", "expected KEY=VALUE, e.g. --limit balanced"),
        (
            "balanced.large.busbw_fial_fraction=0.5",
            "unknown key; did you mean balanced.large.busbw_fail_fraction",
        ),
        (
            "nonsense.key=1",
            "unknown key; known groups: balanced, completion, correctness, health, moe, pairwise, soak, "
            "spread",
        ),
        ("Balanced.Large=1", "is not a limit name"),
        ("balanced.large.busbw_fail_fraction=", "no value after '='; e.g. --limit balanced.large"),
        ("balanced.large.busbw_fail_fraction=abc", "'abc' is not a number; it is a fraction of the spec"),
        ("balanced.large.busbw_fail_fraction=1.5", r"must be a fraction of the spec in \(0, 1\], got 1.5"),
        ("balanced.large.busbw_fail_fraction=0", r"in \(0, 1\], got 0.0"),
        ("balanced.large.busbw_fail_fraction=nan", "got nan"),
        ("balanced.huge.min_bytes=12Q", "must be a byte count"),
        ("spread.confirm_reruns=1.5", "is not a whole number"),
        ("spread.confirm_reruns=11", r"in \[0, 10\], got 11"),
        ("spread.min_ranks=2", "at least 3"),
        ("spread.confirm_rule=some", "must be one of: all, majority"),
        ("correctness.max_wrong=5", "commbench accepts no wrong data"),
        ("completion.max_timeouts=1", "a timeout or a dead rank always fails"),
    ],
)
def test_bad_overrides_are_one_line_errors_naming_the_key(text, match):
    with pytest.raises(UsageError, match=match) as info:
        parse_override(text)
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_an_override_given_twice_or_contradicting_is_refused():
    _refused("given twice; keep one", "gb300-nvl72", overrides=["spread.k_mads=4", "spread.k_mads=6"])
    _refused(
        "busbw_fail_fraction 0.7 is above balanced.large.busbw_warn_fraction 0.52; the FAIL floor must be",
        "gb300-nvl72",
        overrides=["balanced.large.busbw_fail_fraction=0.7"],
    )
    _refused("time_fail_us 10 is below", "gb300-nvl72", overrides=["balanced.small.time_fail_us=10"])
    _refused("size ranges overlap", "gb300-nvl72", overrides=["balanced.large.min_bytes=1M"])


def test_a_user_limits_file_replaces_its_keys_and_keeps_the_rest(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "# tighter\nbalanced:\n  huge:\n    busbw_warn_fraction: 0.7\n    busbw_fail_fraction: 0.66\n"
    )
    limits = load_limits("gb300-nvl72", str(path), ["balanced.huge.busbw_fail_fraction=0.62"])
    assert limits.balanced_floor("huge").warn_fraction == 0.7
    assert limits.balanced_floor("huge").fail_fraction == 0.62  # the command line comes last
    assert limits.value("moe.min_bytes") == 16 << 20 and "mine.yaml" in limits.source


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("balanced: [1, 2\n", r"bad YAML at line \d+ .*; fix the file's syntax"),
        ("balanced:\n  larg:\n    busbw_fail_fraction: 0.5\n", "unknown group 'balanced.larg'; did you mean"),
        ("spread:\n  kmads: 3\n", "unknown key 'spread.kmads'; did you mean spread.k_mads"),
        ("balanced: 0.5\n", "balanced must be a group of limits, got a number"),
        ("spread:\n  k_mads: true\n", "spread.k_mads must be a number of scaled MADs in .1, 100., got True"),
        ("spread:\n  k_mads: -1\n", "got -1"),
        ("moe:\n  min_bytes: 16 lots\n", "moe.min_bytes must be a byte count"),
        ("- a\n- b\n", "expected a mapping of limit groups"),
        ("", "is empty"),
        ("spread:\n  k_mads: 3\n  k_mads: 4\n", "appears twice"),
        ("spread:\n  k_mads: !!python/object:os.system 3\n", "is not accepted"),
    ],
)
def test_bad_limits_files_are_one_line_errors(tmp_path, text, match):
    path = tmp_path / "limits.yaml"
    path.write_text(text)
    error = _refused(match, "gb300-nvl72", str(path))
    assert "limits.yaml" in str(error)


def test_a_missing_limits_file_is_refused(tmp_path):
    _refused("limits file .*nope.yaml not found; check the path", "gb300-nvl72", str(tmp_path / "nope.yaml"))


def test_spec_and_limits_agree_on_what_fractions_are_of():
    # Fractions are of the spec's per-direction NVLink figure; the small ceiling adds the bytes at that rate.
    spec = load_spec("hgx-h800")
    limits = load_limits(spec.name)
    warn_us, _ = limits.small_ceilings_us(8, 3_670_016, spec.nvlink_GBps_per_direction)
    assert warn_us == pytest.approx(40 + 0.6 * 7 + 3_670_016 / 200e3)
    assert "hgx-h800" in shipped_limits_text("hgx-h800")

"""The one backend-option parser: --backend-option text to typed values; each backend declares its options."""

import pytest

from commbench.backends import BACKENDS, get_backend
from commbench.backends.options import BackendOption, checked_options, parse_option_sweep
from commbench.errors import UsageError

DECLARED = (
    BackendOption("chunk_rows", int, None, "rows per chunk", minimum=1, maximum=1 << 20),
    BackendOption("signal", str, "chunk", "granularity", choices=("chunk", "segment")),
    BackendOption("link_GBps", float, 100.0, "bandwidth", minimum=0, exclusive_minimum=True, maximum=1e6),
    BackendOption("pxn", bool, None, "forward over NVLink"),
)


def test_sweep_values_are_typed_by_the_declaration() -> None:
    pairs = ("chunk_rows=4,16", "signal=CHUNK,segment", "link_GBps=50", "pxn=yes")
    sweep = parse_option_sweep("emu", DECLARED, pairs)
    assert sweep.fixed == {"link_GBps": 50.0, "pxn": True}
    assert isinstance(sweep.fixed["link_GBps"], float)
    assert sweep.swept == {"chunk_rows": [4, 16], "signal": ["chunk", "segment"]}
    assert sweep.settings() == [  # cartesian product, first key outermost
        {"chunk_rows": 4, "signal": "chunk"},
        {"chunk_rows": 4, "signal": "segment"},
        {"chunk_rows": 16, "signal": "chunk"},
        {"chunk_rows": 16, "signal": "segment"},
    ]
    assert sweep.describe() == "chunk_rows=4,16 x signal=chunk,segment"
    assert parse_option_sweep("emu", DECLARED, ("chunk_rows=32",)).settings() == [{}]
    # A value listed twice (in any spelling) runs once.
    assert parse_option_sweep("emu", DECLARED, ("link_GBps=2,2.0",)).fixed == {"link_GBps": 2.0}
    assert parse_option_sweep("emu", DECLARED, ()).fixed == {}


@pytest.mark.parametrize(
    ("pairs", "fragment"),
    [
        (("chunk_rows",), "not KEY=VALUE"),
        (("=3",), "not KEY=VALUE"),
        (("chunk_rows=",), "empty value"),
        (("chunk_rows=16,,32",), "empty value"),
        (("signal=chunk", "signal=segment"), "given twice"),
        (("num_blocks=4",), "backend emu has no option(s) num_blocks; known: chunk_rows, signal"),
        (("chunk_rows=4,abc",), "option chunk_rows='abc' is not an integer"),
        (("chunk_rows=0",), "option chunk_rows=0 must be >= 1"),
        (("signal=chunk,bogus",), "option signal='bogus' is unknown; use one of: chunk, segment"),
        (("link_GBps=fast",), "option link_GBps='fast' is not a number"),
        (("link_GBps=nan",), "is not a number"),
        (("link_GBps=1,0",), "option link_GBps=0.0 must be > 0"),
        (("pxn=maybe",), "option pxn='maybe' must be true or false"),
        (("link_GBps=inf",), "option link_GBps='inf' is not a number"),
        (("link_GBps=-inf",), "option link_GBps='-inf' is not a number"),
        (("link_GBps=1e400",), "option link_GBps='1e400' is not a number"),  # overflows to inf
        (("link_GBps=2e6",), "option link_GBps=2000000.0 must be <= 1e+06"),
        (("chunk_rows=inf",), "option chunk_rows='inf' is not an integer"),
        (("chunk_rows=2.5",), "option chunk_rows='2.5' is not an integer"),
        (("chunk_rows=1e3",), "option chunk_rows='1e3' is not an integer"),
        (("chunk_rows=4,2097152",), "option chunk_rows=2097152 must be <= 1048576"),
        (("chunk_rows=" + "9" * 5000,), "is not an integer"),
    ],
)
def test_bad_pairs_are_one_line_usage_errors(pairs: tuple[str, ...], fragment: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_option_sweep("emu", DECLARED, pairs)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_checked_options_fill_defaults_and_accept_typed_values() -> None:
    assert checked_options("emu", DECLARED, {}) == {
        "chunk_rows": None,
        "signal": "chunk",
        "link_GBps": 100.0,
        "pxn": None,
    }
    checked = checked_options("emu", DECLARED, {"chunk_rows": 8, "link_GBps": 3, "pxn": False})
    assert checked["chunk_rows"] == 8 and checked["link_GBps"] == 3.0 and checked["pxn"] is False
    with pytest.raises(UsageError, match="is not an integer"):
        checked_options("emu", DECLARED, {"chunk_rows": 2.5})
    with pytest.raises(UsageError, match="is not an integer"):
        checked_options("emu", DECLARED, {"chunk_rows": True})
    with pytest.raises(UsageError, match="backend gloo takes no options, got chunk_rows; remove them"):
        checked_options("gloo", (), {"chunk_rows": 4})


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_declares_its_options_and_accepts_their_defaults(name: str) -> None:
    backend = get_backend(name)
    declared = backend.OPTIONS
    assert all(isinstance(option, BackendOption) and option.help for option in declared)
    defaults = backend.check_options({})
    assert defaults == {option.name: option.default for option in declared}
    assert backend.check_options(defaults) == defaults  # typed values pass through unchanged


def test_values_given_typed_are_checked_like_text() -> None:
    """Options also arrive as typed values (a job's knob setting, a backend's own defaults): NaN, infinity,
    a fraction or a bool for an int, and values out of range are refused the same way."""
    for bad, fragment in (
        ({"link_GBps": float("nan")}, "is not a number"),
        ({"link_GBps": float("inf")}, "is not a number"),
        ({"link_GBps": -1.0}, "must be > 0"),
        ({"chunk_rows": 2.5}, "is not an integer"),
        ({"chunk_rows": float("inf")}, "is not an integer"),
        ({"chunk_rows": False}, "is not an integer"),
        ({"chunk_rows": 10**30}, "must be <="),
    ):
        with pytest.raises(UsageError, match=fragment):
            checked_options("emu", DECLARED, bad)


def test_number_options_declare_their_range() -> None:
    """The class of "a number option nobody bounded" (latency_us=-100 in a report) cannot be declared."""
    with pytest.raises(TypeError, match="declares its minimum and maximum"):
        BackendOption("latency_us", float, 10.0, "latency")
    with pytest.raises(TypeError, match="declares its minimum and maximum"):
        BackendOption("chunk_rows", int, None, "rows", minimum=1)
    with pytest.raises(TypeError, match="only number options"):
        BackendOption("spec", str, None, "spec", maximum=3)
    for name in sorted(BACKENDS):
        for option in get_backend(name).OPTIONS:
            if option.type in (int, float):
                assert option.minimum is not None and option.maximum is not None, (name, option.name)


def test_int_choices_and_long_values_in_messages() -> None:
    warps = (
        BackendOption("num_warps", int, 16, "warps", choices=(1, 2, 4, 8, 16, 32), minimum=1, maximum=32),
    )
    assert parse_option_sweep("gpu", warps, ("num_warps=4,32",)).swept == {"num_warps": [4, 32]}
    with pytest.raises(UsageError, match="num_warps=3 is unknown; use one of: 1, 2, 4, 8, 16, 32"):
        parse_option_sweep("gpu", warps, ("num_warps=3",))
    with pytest.raises(UsageError) as info:
        parse_option_sweep("emu", DECLARED, ("x" * 10000 + "=1",))
    assert len(str(info.value)) < 300  # an unknown key is echoed shortened, never whole


def test_sim_checks_its_fabric_for_the_launch_world_size() -> None:
    """Typed alone, a spec name is just text; with the launch's world size the fabric is built (spec,
    model knobs, layout), so the parent refuses what a rank's constructor would."""
    sim = get_backend("sim")
    assert sim.check_options({"spec": "nope"})["spec"] == "nope"
    with pytest.raises(UsageError, match="unknown spec 'nope'"):
        sim.check_options({"spec": "nope"}, world_size=2)
    with pytest.raises(UsageError, match="pod_gpus 3 is not a multiple"):
        sim.check_options({"pod_gpus": 3, "ranks_per_domain": 4}, world_size=8)
    assert sim.check_options({"nvlink_efficiency": 0.5}, world_size=8)["nvlink_efficiency"] == 0.5
    for name in ("mock", "shmem-emu"):  # the others take the world size and check what they always do
        assert get_backend(name).check_options({}, world_size=4) == get_backend(name).check_options({})

"""Every bad input is refused before anything starts (issue 8, section 3): one stderr line, exit code 2, no
traceback, nothing launched, no report folder (neither --out nor the default reports/) and nothing written.

The classes: numbers that are not finite or out of range (every float option, integer options given
fractions), backend options (the one parser), sizes that cannot fit this host (memory per rank, rank
processes per core, simulate's ranks), and checks the ranks would make, made in the parent first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

import commbench.cli.resources as resources
from commbench.cli import cli
from commbench.cli.options import FiniteFloat

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
SMALL_MODEL = "name: small\nhidden: 64\nnum_experts: 8\ntopk: 2\ndispatch_dtype: bf16\n"
GiB = 1 << 30


@pytest.fixture(autouse=True)
def nothing_may_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Outside torchrun, in an empty folder (a default reports/ would appear there), with a launch that
    fails the test if anything reaches it (exit 1, not 2)."""
    import commbench.run.dist

    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COMMBENCH_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("launched despite bad input")

    monkeypatch.setattr(commbench.run.dist, "launch", no_launch)
    # Should a check regress, fail at once rather than route 10^9 tokens or lay out 10^8 ranks here.
    import commbench.fabric.ep_groups
    import commbench.traffic.pattern
    import commbench.traffic.routing

    real_route, real_simulate = commbench.traffic.routing.route_rank, commbench.fabric.ep_groups.simulate

    def guarded_route(cfg, rank):  # type: ignore[no-untyped-def]
        if cfg.tokens_per_rank * cfg.model.topk > 1 << 26:
            raise AssertionError(f"routing {cfg.tokens_per_rank} tokens despite the memory check")
        return real_route(cfg, rank)

    def guarded_simulate(model, ranks, *args, **kwargs):  # type: ignore[no-untyped-def]
        if max(ranks) > 1 << 20:
            raise AssertionError(f"simulating {max(ranks)} ranks despite the memory check")
        return real_simulate(model, ranks, *args, **kwargs)

    for module in (commbench.traffic.routing, commbench.traffic.pattern, commbench.fabric.ep_groups):
        monkeypatch.setattr(module, "route_rank", guarded_route)
    monkeypatch.setattr(commbench.fabric.ep_groups, "simulate", guarded_simulate)


@pytest.fixture
def small_model(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL_MODEL)
    return path


def refused(tmp_path: Path, args: list[str], *fragments: str) -> str:
    """Run ``commbench args`` (run and suite get --out); assert the refusal and return its one line."""
    out = tmp_path / "out"
    if args[0] in ("run", "suite"):
        args = [*args, "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("commbench: error: ")
    assert "Traceback" not in result.output and result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert not out.exists()
    assert not (tmp_path / "reports").exists()
    return lines[0]


RUN = ["run", "--world-size", "2", "--backend", "mock", "--tokens", "16"]
BALANCED = ["run", "--world-size", "2", "--backend", "mock", "--pattern", "balanced"]


# ---------------------------------------------------------------------------------------------------------
# 1. Numbers: every float finite and in range; integers are integers


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        ([*RUN, "--timeout", "nan"], ["--timeout", "'nan' is not a finite number"]),
        ([*RUN, "--timeout", "inf"], ["--timeout", "'inf' is not a finite number"]),
        ([*RUN, "--timeout", "-inf"], ["--timeout", "not a finite number"]),
        ([*RUN, "--timeout", "1e400"], ["--timeout", "not a finite number"]),  # overflows to inf
        ([*RUN, "--timeout", "0.5"], ["--timeout", "range"]),
        ([*RUN, "--timeout", "1e9"], ["--timeout", "range"]),
        (["suite", "--world-size", "2", "--timeout", "NaN"], ["--timeout", "not a finite number"]),
        ([*BALANCED, "--step-factor", "nan"], ["--step-factor", "not a finite number"]),
        ([*BALANCED, "--step-factor", "inf"], ["--step-factor", "not a finite number"]),
        ([*BALANCED, "--step-factor", "0.5"], ["--step-factor", "range"]),
        ([*RUN, "--mask-ratio", "nan"], ["--mask-ratio", "not a finite number"]),
        ([*RUN, "--mask-ratio", "1"], ["--mask-ratio", "range"]),
        ([*RUN, "--mask-ratio", "-0.1"], ["--mask-ratio", "range"]),
        ([*RUN, "--capacity-factor", "inf"], ["--capacity-factor", "not a finite number"]),
        ([*RUN, "--capacity-factor", "0"], ["--capacity-factor", "range"]),
        ([*RUN, "--capacity-factor", "1e300"], ["--capacity-factor", "range"]),
        (["pattern", "--world-size", "8", "--mask-ratio", "nan"], ["--mask-ratio", "not a finite"]),
        (["simulate", "--ranks", "72", "--oversubscription", "nan"], ["--oversubscription", "not a finite"]),
        (["simulate", "--ranks", "72", "--oversubscription", "inf"], ["--oversubscription", "not a finite"]),
        (["simulate", "--ranks", "72", "--oversubscription", "0.5"], ["--oversubscription", "range"]),
    ],
)
def test_floats_are_finite_and_in_range(tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    refused(tmp_path, args, *fragments)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        ([*RUN[:-1], "2.5"], ["--tokens", "not a valid integer"]),
        ([*RUN[:-1], "1e12"], ["--tokens", "not a valid integer"]),
        ([*RUN[:-1], "1000000000000"], ["--tokens", "range"]),
        ([*RUN[:-1], "nan"], ["--tokens"]),
        (["run", "--world-size", "2.5"], ["--world-size", "not a valid integer"]),
        ([*RUN, "--iters", "1.5"], ["--iters", "not a valid integer"]),
        ([*RUN, "--warmup", "inf"], ["--warmup", "not a valid integer"]),
        ([*RUN, "--seed", "-1"], ["--seed", "range"]),
        ([*RUN, "--seed", str(1 << 64)], ["--seed", "range"]),  # stored as int64
        (["suite", "--world-size", "2", "--tokens", "0.5"], ["--tokens"]),
        (["simulate", "--ranks", "72", "--tokens", "1e3"], ["--tokens", "not a valid integer"]),
        (["simulate", "--ranks", "72", "--tokens", str(10**20)], ["--tokens", "range"]),
        (["simulate", "--ranks", "72.5"], ["--ranks", "comma-separated"]),
        (["simulate", "--ranks", "1e8"], ["--ranks", "comma-separated"]),
        (["simulate", "--ranks", "72", "--ranks-per-domain", str(10**30)], ["--ranks-per-domain", "range"]),
        (["simulate", "--ranks", "72", "--pod-gpus", str(10**30)], ["--pod-gpus", "range"]),
        ([*RUN, "--ranks-per-host", str(10**30)], ["--ranks-per-host", "range"]),
        ([*BALANCED, "--min-bytes", "2.5K"], ["--min-bytes", "not a byte count"]),
        ([*BALANCED, "--max-bytes", "99999999999999999999999T"], ["--max-bytes", "above the largest"]),
        ([*BALANCED, "--max-bytes", "9" * 5000], ["--max-bytes", "above the largest"]),
    ],
)
def test_integer_options_take_integers_in_range(
    tmp_path: Path, args: list[str], fragments: list[str]
) -> None:
    line = refused(tmp_path, args, *fragments)
    assert len(line) < 400  # a 5000-digit value is not echoed whole


def _all_params() -> list[tuple[str, click.Parameter]]:
    found = []
    for name, command in cli.commands.items():
        found += [(f"{name} {param.name}", param) for param in command.params]
    return found


def test_every_float_option_uses_the_finite_type() -> None:
    floats = [
        (name, param) for name, param in _all_params() if isinstance(param.type, click.types.FloatParamType)
    ]
    assert floats, "no float options found: the walk over the commands is broken"
    assert [name for name, param in floats if not isinstance(param.type, FiniteFloat)] == []
    assert FiniteFloat().convert("2.5", None, None) == 2.5


def test_no_option_takes_unbounded_text_as_a_number() -> None:
    """Every number option has a type that parses and checks it (no bare click.INT / FLOAT / python type)."""
    loose = [
        name
        for name, param in _all_params()
        if param.type in (click.INT, click.FLOAT) or isinstance(param.type, click.types.FuncParamType)
    ]
    assert loose == []


# ---------------------------------------------------------------------------------------------------------
# 2. Backend options: the one parser refuses every bad value, every setting of a sweep, before launch


@pytest.mark.parametrize(
    ("backend", "option", "fragment"),
    [
        ("mock", "latency_us=-100", "latency_us=-100.0 must be >= 0"),
        ("mock", "latency_us=1e12", "must be <= 1e+09"),
        ("mock", "link_GBps=nan", "link_GBps='nan' is not a number"),
        ("mock", "link_GBps=inf", "link_GBps='inf' is not a number"),
        ("mock", "link_GBps=100,-inf", "is not a number"),  # the second setting of a sweep
        ("mock", "link_GBps=0", "must be > 0"),
        ("shmem-emu", "chunk_rows=inf", "chunk_rows='inf' is not an integer"),
        ("shmem-emu", "chunk_rows=2.5", "chunk_rows='2.5' is not an integer"),
        ("shmem-emu", "chunk_rows=1e3", "chunk_rows='1e3' is not an integer"),
        ("shmem-emu", "chunk_rows=99999999999999999999", "must be <= "),
        ("shmem-emu", "chunk_bytes=0", "chunk_bytes=0 must be >= 1"),
        ("shmem-emu", "chunk_rows=" + "7" * 5000, "is not an integer"),
        ("sim", "nvlink_efficiency=nan", "nvlink_efficiency='nan' is not a number"),
        ("sim", "nvlink_efficiency=1.5", "must be <= 1"),
        ("sim", "scaleout_efficiency=0", "must be > 0"),
        ("sim", "oversubscription=0.5", "must be >= 1"),
        ("sim", "phase_latency_us=-1", "must be >= 0"),
        ("sim", "pod_gpus=2.5", "is not an integer"),
        ("sim", "pxn=maybe", "must be true or false"),
    ],
)
def test_bad_backend_option_values(tmp_path: Path, backend: str, option: str, fragment: str) -> None:
    args = ["run", "--world-size", "2", "--tokens", "16", "--backend", backend, "--backend-option", option]
    line = refused(tmp_path, args, fragment, f"backend {backend}")
    assert len(line) < 400


# ---------------------------------------------------------------------------------------------------------
# 3. Checks the ranks would make run in the parent first


@pytest.mark.parametrize(
    ("model_yaml", "fragments"),
    [
        (
            "name: tiny\nhidden: 2\nnum_experts: 8\ntopk: 2\ndispatch_dtype: bf16\n",
            ["hidden size 2", "header"],
        ),
        (
            "name: tiny\nhidden: 3\nnum_experts: 8\ntopk: 2\ndispatch_dtype: fp8\n",
            ["hidden size 3", "header"],
        ),
        ("name: huge\nhidden: 1e20\nnum_experts: 8\ntopk: 2\n", ["hidden"]),
    ],
)
def test_model_checks_of_the_ranks_run_before_launch(
    tmp_path: Path, model_yaml: str, fragments: list[str]
) -> None:
    model = tmp_path / "model.yaml"
    model.write_text(model_yaml)
    for backend in ("gloo", "mock"):
        args = ["run", "--world-size", "2", "--backend", backend, "--model", str(model), "--tokens", "16"]
        refused(tmp_path, args, *fragments)


@pytest.mark.parametrize(
    ("world", "options", "fragment"),
    [
        ("2", ["spec=nope"], "unknown spec 'nope'"),
        ("2", ["spec=hgx-h100,nope"], "unknown spec 'nope'"),  # the second setting of a sweep
        ("4", ["pod_gpus=3"], "pod_gpus 3 is not a multiple"),
        ("4", ["ranks_per_domain=4", "ranks_per_host=3"], "not a multiple of --ranks-per-host"),
    ],
)
def test_sim_backend_checks_its_fabric_before_launch(
    tmp_path: Path, world: str, options: list[str], fragment: str
) -> None:
    args = ["run", "--world-size", world, "--tokens", "16", "--backend", "sim"]
    for option in options:
        args += ["--backend-option", option]
    refused(tmp_path, args, fragment)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["--ranks-per-domain", "3", "--ranks-per-host", "2"], "not a multiple of --ranks-per-host"),
        (["--ranks-per-domain", "0"], "--ranks-per-domain"),
        (["--ranks-per-host", "2.5"], "--ranks-per-host"),
    ],
)
def test_layout_overrides_that_do_not_fit(tmp_path: Path, overrides: list[str], fragment: str) -> None:
    refused(
        tmp_path, ["run", "--world-size", "4", "--backend", "mock", "--tokens", "16", *overrides], fragment
    )


GLOO_NODE = ["run", "--world-size", "4", "--backend", "gloo", "--tokens", "16", "--send-mode", "node"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([*RUN, "--send-mode", "node"], "--backend mock cannot"),
        ([*RUN, "--send-mode", "node", "--backend", "sim"], "--backend sim cannot"),
        ([*GLOO_NODE, "--imbalance-cost"], "drop --imbalance-cost"),
        ([*GLOO_NODE, "--nccl-tests-matrix", "m.txt"], "--nccl-tests-matrix writes one all-to-all"),
        (["pattern", "--world-size", "4", "--tokens", "16", "--send-mode", "node"], "--ranks-per-domain N"),
        (
            ["pattern", "--world-size", "4", "--tokens", "16", "--send-mode", "node", "--ranks-per-host", "2"]
            + ["--nccl-tests-matrix", "m.txt"],
            "--nccl-tests-matrix writes one all-to-all",
        ),
    ],
)
def test_node_send_mode_refusals(tmp_path: Path, args: list[str], fragment: str) -> None:
    refused(tmp_path, args, fragment)
    assert not (tmp_path / "m.txt").exists()


# ---------------------------------------------------------------------------------------------------------
# 4. Sizes that cannot fit: estimated before launch (one line naming the value, the estimate, the limit)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            [*RUN[:-1], "1000000000"],
            ["--tokens 1000000000", "needs about", "TiB of host memory", "available"],
        ),
        (
            ["suite", "--world-size", "2", "--backend", "gloo", "--tokens", "1000000000"],
            ["--tokens 1000000000", "needs about", "lower --tokens"],
        ),
        (
            [*RUN[:-1], "100000000", "--send-mode", "selection", "--imbalance-cost"],
            ["--tokens 100000000", "selection mode", "needs about"],
        ),
        (
            [*BALANCED, "--min-bytes", "1T", "--max-bytes", "1T"],
            ["1 TiB", "needs about", "lower --max-bytes"],
        ),
        ([*BALANCED, "--max-bytes", "512T"], ["512 TiB", "needs about", "lower --max-bytes"]),
        ([*RUN, "--iters", "2000000000"], ["--iters 2000000000", "needs about", "lower --iters"]),
        (["pattern", "--world-size", "8", "--tokens", "1000000000"], ["--tokens 1000000000", "needs about"]),
        (["simulate", "--ranks", "100000000"], ["--ranks 100000000", "needs about", "available"]),
        (["simulate", "--ranks", "72,100000000"], ["--ranks 100000000", "needs about"]),
        (["simulate", "--ranks", "100000000", "--ep-size", "1"], ["--ranks 100000000", "needs about"]),
        (
            ["simulate", "--ranks", "256", "--tokens", "100000000", "--exact"],
            ["--ranks 256", "routed exactly"],
        ),
        (["simulate", "--ranks", "72", "--sample-tokens", "2000000000"], ["needs about", "--sample-tokens"]),
    ],
)
def test_sizes_that_cannot_fit_this_host(tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    refused(tmp_path, args, *fragments)


def test_model_at_the_hidden_limit_with_many_tokens(tmp_path: Path) -> None:
    """Each value within its own bound, the combination far beyond any host: 2^20 tokens of 2 MiB rows."""
    model = tmp_path / "wide.yaml"
    model.write_text("name: wide\nhidden: 1048576\nnum_experts: 8\ntopk: 2\n")
    args = ["run", "--world-size", "2", "--backend", "gloo", "--model", str(model), "--tokens", "1048576"]
    refused(tmp_path, args, "wide at --tokens 1048576 (hidden 1048576", "needs about", "model's hidden size")


def test_rank_processes_are_bounded_by_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import commbench.cli.run

    launched: list[int] = []
    monkeypatch.setattr(resources, "usable_cores", lambda: 2)
    monkeypatch.setattr(commbench.cli.run, "launch", lambda _c, settings, *a, **k: launched.append(1))
    limit = 2 * resources.RANKS_PER_CORE
    base = ["run", "--backend", "mock", "--pattern", "balanced", "--max-bytes", "1M"]
    for world in (limit + 1, 100000):
        refused(tmp_path, [*base, "--world-size", str(world)], f"--world-size {world}", f"at most {limit}")
    assert launched == []
    result = CliRunner().invoke(cli, [*base, "--world-size", str(limit), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0 and launched == [1], result.output


def test_memory_limit_is_the_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a host with 4 GiB available: a small run passes the check, one a few times larger is refused
    naming the estimate and the limit, and the sum grows with the ranks on the host."""
    import commbench.cli.run

    launched: list[int] = []
    monkeypatch.setattr(resources, "host_memory_available", lambda: (4 * GiB, "test host"))
    monkeypatch.setattr(resources, "usable_cores", lambda: 8)
    monkeypatch.setattr(commbench.cli.run, "launch", lambda *a, **k: launched.append(1))
    ok = CliRunner().invoke(cli, [*BALANCED, "--max-bytes", "16M", "--out", str(tmp_path / "o")])
    assert ok.exit_code == 0 and launched == [1], ok.output
    line = refused(tmp_path, [*BALANCED, "--max-bytes", "2G"], "needs about", "4 GiB available (test host)")
    assert "2 local rank(s) x" in line
    refused(tmp_path, [*BALANCED, "--max-bytes", "256M", "--world-size", "16"], "16 local rank(s)")


def test_under_torchrun_the_local_ranks_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun started the ranks: no bound on processes per core, and memory is summed over this host's
    LOCAL_WORLD_SIZE ranks, not the world's."""
    env = {"RANK": "0", "WORLD_SIZE": "64", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    for name, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(resources, "usable_cores", lambda: 1)
    monkeypatch.setattr(resources, "host_memory_available", lambda: (2 * GiB, "test host"))
    args = ["run", "--backend", "mock", "--pattern", "balanced", "--max-bytes", "64M"]
    refused(tmp_path, args, "on 64 ranks", "8 local rank(s) x", "2 GiB available (test host)")


def test_gpu_memory_is_checked_when_buffers_live_on_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nccl with two (faked) 8 GiB GPUs: buffers over the GPU's memory less the reserve are refused even
    when the host has room; the device properties are read, no CUDA context is made."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=8 * GiB))
    monkeypatch.setattr(resources, "host_memory_available", lambda: (1 << 50, "test host"))
    args = ["run", "--world-size", "2", "--backend", "nccl", "--pattern", "balanced", "--max-bytes", "4G"]
    refused(tmp_path, args, "of GPU memory per rank", "7 GiB a GPU here offers", "lower --max-bytes")


# ---------------------------------------------------------------------------------------------------------
# The estimate itself


@pytest.mark.parametrize("model_name", ["deepseek-v3", "kimi-k2", "gpt-oss-120b", "mixtral-8x22b"])
@pytest.mark.parametrize("send_mode", ["token", "selection"])
def test_rows_per_token_matches_uniform_routing(model_name: str, send_mode: str) -> None:
    """The estimate's rows per token (the size of every buffer) against the rows routing really makes."""
    from commbench.inputs.models import load_model
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.pattern import build_pattern
    from commbench.traffic.routing import RoutingConfig

    model = load_model(model_name)
    for world in (2, 8):
        cfg = RoutingConfig(model=model, skew=parse_skew("uniform"), world_size=world, tokens_per_rank=256)
        actual = build_pattern(cfg, send_mode).dispatch_rows.sum() / (world * 256)
        estimate = resources.rows_per_token(model, world, send_mode)
        assert estimate == pytest.approx(actual, rel=0.1), (model_name, world)


def test_estimate_grows_with_each_size() -> None:
    from commbench.backends.shmem.emu import ShmemEmuBackend
    from commbench.inputs.models import load_model
    from commbench.inputs.skew import parse_skew
    from commbench.traffic.routing import RoutingConfig

    def total(tokens: int = 256, world: int = 4, iters: int = 20, one_sided: bool = False) -> int:
        cfg = RoutingConfig(
            model=load_model("deepseek-v3"),
            skew=parse_skew("uniform"),
            world_size=world,
            tokens_per_rank=tokens,
        )
        backend = ShmemEmuBackend if one_sided else None
        return resources.moe_rank_memory(cfg, "token", iters, False, backend).total()

    assert total(tokens=512) > 1.9 * total()  # buffers scale with the tokens
    assert total(world=8) > total() and total(iters=10**6) > total() and total(one_sided=True) > total()
    sweep = resources.balanced_rank_memory([1 << 20, 1 << 30], 4, 20)
    assert sweep == resources.balanced_rank_memory([1 << 30], 4, 20)  # the largest size counts
    assert sweep.buffers >= 3 << 30  # token rows, receive buffer and expected rows, at least

"""First-use set-up keeps the user's environment: a venv holding torch, activated, no package index."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _copy_checkout(destination: Path) -> None:
    """The files a fresh clone (plus uncommitted work) would hold: no .venv, no reports."""
    listing = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listing.split("\0")):
        source = REPO / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


@pytest.fixture(scope="module")
def user_environment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A user's venv holding every dependency (this interpreter's packages, not the checkout), activated."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to copy")
    root = tmp_path_factory.mktemp("setup")
    user_venv = root / "user-venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(user_venv)
    site_packages = next(user_venv.glob("lib/python*/site-packages"))
    installed = [path for path in sys.path if path.endswith(("site-packages", "dist-packages"))]
    (site_packages / "deps.pth").write_text("".join(f"{path}\n" for path in installed))
    checkout = root / "checkout"
    _copy_checkout(checkout)
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "COMMBENCH_", "PIP_"))
    }
    env.update(
        VIRTUAL_ENV=str(user_venv),
        PATH=f"{user_venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",  # no ruff, no torchrun of another torch
        PIP_NO_INDEX="1",  # any attempt to download fails
        PIP_FIND_LINKS="",
    )
    env.pop("OMP_NUM_THREADS", None)
    return checkout, env


def test_run_suite_in_a_users_venv_installs_nothing(user_environment: tuple[Path, dict[str, str]]) -> None:
    checkout, env = user_environment
    result = subprocess.run(
        ["./run_suite.sh", "--quick", "--out", str(checkout / "out")],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "installing" not in result.stderr, result.stderr[-3000:]
    setup_lines = [line for line in result.stderr.splitlines() if line.startswith("[setup] python=")]
    assert len(setup_lines) == 1 and "torch=" in setup_lines[0] and "CPU build" in setup_lines[0]
    assert str(checkout / ".venv") not in setup_lines[0].split(" from ")[1]  # the user's torch, not a new one
    assert (checkout / "out" / "results.json").is_file()
    origin = subprocess.run(
        [str(checkout / ".venv" / "bin" / "python"), "-c", "import commbench; print(commbench.__file__)"],
        cwd=checkout.parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert origin.startswith(str(checkout)), origin  # the fresh clone's own code, not another checkout


def test_the_venvs_commbench_command_spawns_ranks_once(user_environment: tuple[Path, dict[str, str]]) -> None:
    # Spawned ranks import the parent's main script again: the launcher must not run the CLI on import.
    checkout, env = user_environment
    launcher = checkout / ".venv" / "bin" / "commbench"
    out = checkout / "out-launcher"
    args = ["run", "--pattern", "balanced", "--world-size", "2", "--backend", "gloo", "--min-bytes", "1K"]
    args += ["--max-bytes", "1K", "--warmup", "1", "--iters", "2", "--out", str(out)]
    result = subprocess.run(
        [str(launcher), *args], cwd=checkout, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "claimed by another" not in result.stderr
    assert (out / "verdict.json").is_file()


def test_run_tests_without_ruff_skips_lint_and_runs_tests(
    user_environment: tuple[Path, dict[str, str]],
) -> None:
    checkout, env = user_environment
    result = subprocess.run(
        ["./run_tests.sh", "tests/test_architecture.py", "-p", "no:cacheprovider"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "lint skipped" in result.stderr
    assert "installing" not in result.stderr
    assert " passed" in result.stdout


def test_lint_required_but_missing_is_an_error(user_environment: tuple[Path, dict[str, str]]) -> None:
    checkout, env = user_environment
    result = subprocess.run(
        ["./run_tests.sh", "tests/test_architecture.py"],
        cwd=checkout,
        env={**env, "COMMBENCH_REQUIRE_LINT": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 2 and "ruff is not installed" in result.stderr

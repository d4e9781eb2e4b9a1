"""First-use set-up of ./.venv for run_suite.sh and run_tests.sh, keeping the user's own environment.

Three steps, each a sub-command (tools/bootstrap.sh calls them):

``create VENV``     run by the user's interpreter (a venv, conda or the system python): make VENV so that it
                    sees every package that interpreter sees. A venv made from a venv only sees the *base*
                    interpreter, so the parent's own sys.path entries go into a .pth file.
``install REPO X``  run inside VENV: install only what does not import yet (nothing if everything is
                    there, so no network is needed), never replace an installed torch (it is pinned as a
                    constraint), and put REPO on the path with a .pth file instead of ``pip install -e``
                    (which needs build isolation, hence the network).
``describe``        one ``[setup]`` line: which python and which torch (version, CUDA or CPU build).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path

# The repo's .pth must come before the parent's paths (files are read in name order), so that a checkout
# being set up imports its own commbench even when the parent environment holds another checkout.
REPO_PTH = "00_commbench_repo.pth"
PARENT_PTH = "zz_commbench_parent.pth"
DEFAULT_TORCH = "torch==2.13.0"


def _stdlib_paths() -> set[str]:
    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib")}
    return stdlib | {os.path.join(path, "lib-dynload") for path in stdlib}


def parent_paths() -> list[str]:
    """This interpreter's import path less the standard library and the current directory, in order."""
    stdlib = _stdlib_paths()
    kept = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry) or entry.endswith(".zip"):
            continue
        real = os.path.realpath(entry)
        if real in stdlib or real == os.path.realpath(os.getcwd()) or real in kept:
            continue
        kept.append(real)
    return kept


def _venv_site_packages(venv_dir: Path) -> Path:
    found = sorted(venv_dir.glob("lib/python*/site-packages")) + sorted(venv_dir.glob("Lib/site-packages"))
    if not found:
        raise SystemExit(f"[setup] {venv_dir} has no site-packages folder: remove it and run again")
    return found[0]


def create(venv_dir: Path) -> None:
    print(
        f"[setup] creating {venv_dir} on top of {sys.executable} (its packages stay visible)", file=sys.stderr
    )
    venv.EnvBuilder(system_site_packages=True, with_pip=True, symlinks=os.name != "nt").create(venv_dir)
    site_packages = _venv_site_packages(venv_dir)
    (site_packages / PARENT_PTH).write_text("".join(f"{path}\n" for path in parent_paths()))


def _requirement_names(spec_list: list[str]) -> list[tuple[str, str]]:
    """(distribution name, requirement) pairs; markers and extras are not used by commbench's list."""
    pairs = []
    for requirement in spec_list:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        if match:
            pairs.append((match.group(1), requirement.strip()))
    return pairs


def _project_requirements(repo: Path, extras: list[str]) -> list[str]:
    text = (repo / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the two lists are plain, one string per line
        tomllib = None
    if tomllib is not None:
        project = tomllib.loads(text)["project"]
        requirements = list(project["dependencies"])
        for extra in extras:
            requirements += project.get("optional-dependencies", {}).get(extra, [])
        return requirements
    dependency_block = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    requirements = re.findall(r'^\s*"([^"]+)",?\s*$', dependency_block, re.M)
    for extra in extras:
        block = re.search(rf"^{re.escape(extra)} = \[([^\]]*)\]", text, re.M)
        requirements += re.findall(r'"([^"]+)"', block.group(1)) if block else []
    return requirements


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def install(repo: Path, extras: list[str]) -> None:
    site_packages = _venv_site_packages(Path(sys.prefix))
    (site_packages / REPO_PTH).write_text(f"{repo.resolve()}\n")
    _write_console_script()
    torch_version = _installed("torch")
    if torch_version is None:
        spec = os.environ.get("COMMBENCH_TORCH_SPEC", DEFAULT_TORCH)
        print(f"[setup] no torch importable: installing {spec}", file=sys.stderr)
        _pip([spec])
        torch_version = _installed("torch")
    missing = [
        requirement
        for name, requirement in _requirement_names(_project_requirements(repo, extras))
        if name != "torch" and _installed(name) is None
    ]
    if not missing:
        return
    print(f"[setup] installing what is missing: {' '.join(missing)}", file=sys.stderr)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(f"torch=={torch_version}\n")  # never replace the torch the user has
    try:
        _pip(["-c", constraints.name, *missing])
    finally:
        os.unlink(constraints.name)


def _write_console_script() -> None:
    """``commbench`` in the venv's bin: what the entry point would be, without building a wheel. The main
    guard matters: spawned ranks (multiprocessing "spawn") import the parent's main script again, and
    without it every rank would run the command line once more."""
    bin_dir = Path(sys.prefix) / ("Scripts" if os.name == "nt" else "bin")
    script = bin_dir / "commbench"
    text = (
        f"#!{sys.executable}\nimport sys\n\nfrom commbench.cli import main\n\n"
        'if __name__ == "__main__":\n    sys.exit(main())\n'
    )
    if not script.is_file() or script.read_text() != text:
        script.write_text(text)
    script.chmod(0o755)


def describe() -> None:
    try:
        import torch
    except ImportError as error:
        raise SystemExit(f"[setup] torch does not import in {sys.executable}: {error}") from None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    origin = Path(torch.__file__).resolve().parent.parent
    version = sys.version.split()[0]
    print(f"[setup] python={sys.executable} ({version}) torch={torch.__version__} ({build}) from {origin}")


def main(argv: list[str]) -> None:
    command = argv[0] if argv else ""
    if command == "create" and len(argv) == 2:
        create(Path(argv[1]))
    elif command == "install" and len(argv) in (2, 3):
        extras = [extra for extra in (argv[2] if len(argv) == 3 else "").split(",") if extra]
        install(Path(argv[1]), extras)
    elif command == "describe":
        describe()
    else:
        raise SystemExit("usage: setup_env.py create VENV | install REPO [EXTRAS] | describe")


if __name__ == "__main__":
    main(sys.argv[1:])

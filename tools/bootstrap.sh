# Sourced by run_suite.sh and run_tests.sh: make ./.venv on first use and activate it.
#
# The venv is created with --system-site-packages so a CUDA build of torch that is already installed on a GPU
# machine is kept. Only when no torch is importable at all do we install one: torch==2.13.0 (on the dev/CI
# machines that resolves to a CPU wheel already on disk; elsewhere set COMMBENCH_TORCH_SPEC to what you want).
# Usage: COMMBENCH_EXTRAS=test . tools/bootstrap.sh
set -euo pipefail
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${COMMBENCH_VENV:-$_repo/.venv}"
_python="${PYTHON:-python3}"
_extras="${COMMBENCH_EXTRAS:-}"
_stamp="$_venv/.commbench-installed${_extras:+-$_extras}"

if [ ! -x "$_venv/bin/python" ]; then
  echo "[setup] creating $_venv (system site packages visible, so an installed CUDA torch is kept)" >&2
  "$_python" -m venv --system-site-packages "$_venv"
fi
# shellcheck disable=SC1091
. "$_venv/bin/activate"

if [ ! -f "$_stamp" ] || [ "$_repo/pyproject.toml" -nt "$_stamp" ]; then
  if ! python -c "import torch" >/dev/null 2>&1; then
    echo "[setup] no torch found: installing ${COMMBENCH_TORCH_SPEC:-torch==2.13.0}" >&2
    python -m pip install -q "${COMMBENCH_TORCH_SPEC:-torch==2.13.0}"
  fi
  echo "[setup] installing commbench${_extras:+[$_extras]} (editable) and its dependencies" >&2
  python -m pip install -q -e "$_repo${_extras:+[$_extras]}"
  touch "$_stamp"
fi
unset _repo _venv _python _extras _stamp

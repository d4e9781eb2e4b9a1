# Sourced by run_suite.sh and run_tests.sh: make ./.venv on first use, activate it, say which python and torch.
#
# The user's environment is kept: .venv is made from the python on PATH (a venv, conda or the system one) and
# sees every package that python sees, so an installed CUDA torch is used as it is. Only what does not import
# is installed (nothing, when everything is there: no network needed), and torch only when none imports
# (COMMBENCH_TORCH_SPEC, default torch==2.13.0). Details in tools/setup_env.py.
# Usage: COMMBENCH_EXTRAS=test . tools/bootstrap.sh
set -euo pipefail
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${COMMBENCH_VENV:-$_repo/.venv}"
_python="${PYTHON:-python3}"
_extras="${COMMBENCH_EXTRAS:-}"
_stamp="$_venv/.commbench-ready${_extras:+-${_extras//,/-}}"

if [ ! -x "$_venv/bin/python" ]; then
  "$_python" "$_repo/tools/setup_env.py" create "$_venv"
fi
# shellcheck disable=SC1091
. "$_venv/bin/activate"
if [ ! -f "$_stamp" ] || [ "$_repo/pyproject.toml" -nt "$_stamp" ] || [ "$_repo/tools/setup_env.py" -nt "$_stamp" ]; then
  python "$_repo/tools/setup_env.py" install "$_repo" "$_extras"
  touch "$_stamp"
fi
python "$_repo/tools/setup_env.py" describe >&2
unset _repo _venv _python _extras _stamp

#!/usr/bin/env bash
# Set up (first use) and run the test suite: lint where ruff is installed (CI installs it), then pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
COMMBENCH_EXTRAS="${COMMBENCH_EXTRAS:-test}" . tools/bootstrap.sh
if command -v ruff >/dev/null 2>&1; then
  ruff check .
  ruff format --check .
elif [ "${COMMBENCH_REQUIRE_LINT:-0}" = 1 ]; then
  echo "[tests] COMMBENCH_REQUIRE_LINT=1 but ruff is not installed" >&2
  exit 2
else
  echo "[tests] ruff not installed: lint skipped (pip install ruff to lint)" >&2
fi
# Two workers where pytest-xdist is installed (the test extra has it): most tests wait on rank processes
# they started, so two run side by side on 2 cores; a module's tests stay on one worker (--dist loadscope)
# and share its launches. COMMBENCH_TEST_WORKERS=0 runs them in one process, =auto one per core.
workers="${COMMBENCH_TEST_WORKERS:-2}"
if [ "$workers" != 0 ] && python -c "import xdist" 2>/dev/null; then
  python -m pytest -q -n "$workers" --dist loadscope "$@"
else
  python -m pytest -q "$@"
fi

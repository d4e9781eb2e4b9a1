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
python -m pytest -q "$@"

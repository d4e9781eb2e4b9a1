#!/usr/bin/env bash
# Set up (first use) and run the test suite: lint, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
COMMBENCH_EXTRAS=test . tools/bootstrap.sh
ruff check .
ruff format --check .
python -m pytest -q "$@"

#!/usr/bin/env bash
# The project's test command: every test, the slow many-rank cases included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_env.sh
PY=${PYTHON:-python3}
# --durations=30: the slowest tests close every run (CI's log included); the budget and the
# before/after table are in docs/testing.md, the full breakdown is `python bench/test_time.py --run`.
exec "$PY" -m pytest -q --durations=30 "$@"

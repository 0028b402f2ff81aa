#!/usr/bin/env bash
# The project's test command: every test, the slow many-rank cases included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_env.sh
PY=${PYTHON:-python3}
# Style first (seconds): a lint finding or an unformatted file fails the run (config: pyproject.toml).
LINTED=(src tests bench scripts examples)
"$PY" -m ruff check "${LINTED[@]}"
"$PY" -m ruff format --check "${LINTED[@]}"
# Test workers (pytest-xdist), one test file at a time each, the longest files first
# (tests/conftest.py, tests/durations.json): 2 on a 2-core machine, at most 4;
# NDPARALLEL_TEST_WORKERS=1 runs everything in this one process.
CORES=$(nproc 2>/dev/null || echo 2)
WORKERS=${NDPARALLEL_TEST_WORKERS:-$((CORES < 2 ? 2 : (CORES > 4 ? 4 : CORES)))}
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then PARALLEL=(-n "$WORKERS" --dist loadfile); fi
# --durations=30: the slowest tests close every run (CI's log included); the budget and the
# runs: docs/testing.md, bench/reference/test_suite_runs.md; the breakdown: tests/tools/suite_time.py --run.
exec "$PY" -m pytest -q --durations=30 "${PARALLEL[@]}" "$@"

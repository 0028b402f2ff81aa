#!/usr/bin/env bash
# The project's test command: every test, the slow many-rank cases included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_env.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q "$@"

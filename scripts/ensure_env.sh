#!/usr/bin/env bash
# Install ndparallel and what it needs into the current Python, keeping an installed torch.
# Never lets pip resolve an unpinned torch on a machine without one (that pulls a multi-GB CUDA
# build): a missing torch is installed first as the CPU build 2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if compgen -G "/opt/wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
    echo "[ensure_env] no torch found: installing the CPU build torch==2.13.0 (local wheel)"
    "$PY" -m pip install -q "torch==2.13.0"
  else
    echo "[ensure_env] no torch found: installing a CPU build from the PyTorch CPU index"
    "$PY" -m pip install -q "torch>=2.11" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# The dev extras again where one is missing, or where ruff is not the version pyproject pins (an
# install from before ruff was added, or another ruff: lint and format results differ by version).
RUFF_PIN=$(sed -n 's/.*"ruff==\([0-9.]*\)".*/\1/p' pyproject.toml)
# Also where the installed ndparallel is another checkout's (a second clone on the same machine
# would otherwise test the first one's code in every test process).
HERE="$(pwd)/src/ndparallel/__init__.py"
if ! "$PY" -c "import ndparallel, pytest_timeout, xdist, accelerate" 2>/dev/null \
   || [ "$(cd / && "$PY" -c "import ndparallel; print(ndparallel.__file__)" 2>/dev/null)" != "$HERE" ] \
   || [ "$("$PY" -m ruff --version 2>/dev/null)" != "ruff $RUFF_PIN" ] \
   || [ "${NDPARALLEL_REINSTALL:-0}" = 1 ]; then
  echo "[ensure_env] installing ndparallel (editable) with its dev extras"
  "$PY" -m pip install -q -e ".[dev]"
fi

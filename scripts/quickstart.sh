#!/usr/bin/env bash
# The main job: install if needed, then train the built-in tiny Llama on the Python standard
# library's source (BPE tokenizer trained on it) on 8 CPU ranks, FSDP 2 × CP 2 × TP 2. Writes the
# model to outputs/quickstart/final and the loss curve to outputs/quickstart/metrics.png.
# Extra arguments go to `ndparallel train`, e.g. --set max_steps=200.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_env.sh
exec "${PYTHON:-python3}" -m ndparallel train examples/quickstart.yaml "$@"

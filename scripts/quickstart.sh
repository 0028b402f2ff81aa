#!/usr/bin/env bash
# The main job: install if needed, then train the built-in tiny Llama on the Python standard
# library's source (BPE tokenizer trained on it) on 8 CPU ranks, FSDP 2 × CP 2 × TP 2; saves the
# model to outputs/quickstart/final and the loss curve to outputs/quickstart/metrics.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_env.sh
ndparallel train examples/quickstart.yaml "$@"
out=$(python3 -c "import sys; from ndparallel.config import load_config; print(load_config('examples/quickstart.yaml', sys.argv[1:]).output_dir)" $(printf -- '%s\n' "$@" | sed -n 's/^--set=\{0,1\}//p' | sed 's/^/--set=/' | tr '\n' ' ') 2>/dev/null || echo outputs/quickstart)
ndparallel plot "$out"

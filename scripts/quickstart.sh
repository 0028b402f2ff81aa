#!/usr/bin/env bash
# The main job: install if needed, then train the built-in tiny model on built-in data, 8 CPU ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_env.sh
exec ndparallel launch --nproc-per-node 8 examples/show_mesh.py --dp-shard 2 --cp 2 --tp 2 "$@"

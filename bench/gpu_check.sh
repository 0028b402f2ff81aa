#!/usr/bin/env bash
# The one-GPU runtime checks (issue 13): train + checkpoint, resume, export, CPU offload, process-group
# timeouts, the CPU-pinned tests with the GPU visible. Now steps of bench/gpu_all.sh; this runs just
# those (results in $OUT or /tmp/gpu_all, exit 1 on any FAIL):  bash bench/gpu_check.sh [--budget S]
exec bash "$(dirname "$0")/gpu_all.sh" --only 'runtime_*,group_timeouts,tests_gpu_visible' "$@"

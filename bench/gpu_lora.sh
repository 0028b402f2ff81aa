#!/usr/bin/env bash
# The one-GPU LoRA checks (issue 20): train + checkpoint, resume, adapter and merged exports that agree,
# a run from the exported adapter (lora_model_dir), LoRA vs full fine-tuning speed and memory
# (bench/gpu_lora.py). Now steps of bench/gpu_all.sh; this runs just those (results in $OUT or
# /tmp/gpu_all, exit 1 on any FAIL):  bash bench/gpu_lora.sh [--budget S]
exec bash "$(dirname "$0")/gpu_all.sh" --only 'lora_*' "$@"

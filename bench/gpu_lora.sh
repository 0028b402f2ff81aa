#!/usr/bin/env bash
# The prepared GPU check of LoRA (issue #20): one command, ~5 min on one GPU, prints a table.
# NOT YET RUN on a GPU (see docs/lora.md).
#   bash bench/gpu_wheels.sh            # once, where the internet is (the GPU image lacks datasets, pydantic)
#   bash bench/gpu_lora.sh              # on the GPU machine, from the repository root (carry .whl)
# It checks: the CPU-pinned LoRA equivalence/checkpoint tests with a GPU visible; a one-GPU bf16
# `ndparallel train` with `adapter: lora` (bf16 frozen base, checkpoint, resume, adapter + merged
# export that agree); a run continuing from that adapter (lora_model_dir) on CUDA; LoRA vs full fine-tuning speed and peak memory on the Llama-3.2-1B shape,
# next to the planner's prediction (bench/gpu_lora.py).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_lora}
source "$(dirname "$0")/_gpu_common.sh"
RUN=/tmp/gpu_lora_run; rm -rf "$RUN"
COMMON=(--set base_model=quickstart-llama --set "datasets=[{path: 'builtin:stdlib', max_bytes: 2000000}]"
        --set dp_shard_size=1 --set tensor_parallel_size=1 --set sequence_len=512 --set micro_batch_size=4
        --set device=cuda --set bf16=true --set save_steps=8 --set logging_steps=4 --set learning_rate=1e-3
        --set "output_dir=$RUN" --set "dataset_cache_dir=/tmp/gpu_lora_cache")
check peft_imports python3 -c "import peft; print('peft', peft.__version__)"
check lora_cpu_tests python3 -m pytest -q -x tests/test_lora.py -k "fsdp2 or tp2" -m "not slow" \
  tests/test_lora_checkpoint.py
check lora_train_1gpu python3 -m ndparallel train examples/cpu/lora_fsdp_tp.yaml "${COMMON[@]}" --set max_steps=8
check lora_resume_1gpu python3 -m ndparallel train examples/cpu/lora_fsdp_tp.yaml "${COMMON[@]}" --set max_steps=12 \
  --set resume_from_checkpoint=auto
check lora_exports_agree python3 - <<PY
import torch, transformers
from peft import PeftModel
merged = transformers.AutoModelForCausalLM.from_pretrained("$RUN/merged", dtype=torch.float32).cuda().eval()
torch.manual_seed(42)  # the preset's random base, drawn like load_model (seed 42)
base = transformers.AutoModelForCausalLM.from_config(merged.config, dtype=torch.bfloat16).float().cuda()
lora = PeftModel.from_pretrained(base, "$RUN/final").eval()
ids = torch.randint(0, merged.config.vocab_size, (2, 64), device="cuda")
with torch.no_grad():
    a, b = lora(input_ids=ids).logits, merged(input_ids=ids).logits
    with lora.disable_adapter():
        c = lora(input_ids=ids).logits
diff, effect = (a - b).abs().max().item(), (a - c).abs().max().item()
print(f"max |adapter - merged| logits {diff:.4f}; the adapter's own effect {effect:.4f}")
assert diff < 0.2 * effect, "merged (bf16 weights) and adapter should agree far closer than the adapter moves"
PY
check lora_model_dir_1gpu python3 -m ndparallel train examples/cpu/lora_fsdp_tp.yaml "${COMMON[@]}" --set max_steps=4 \
  --set "output_dir=${RUN}_continue" --set "lora_model_dir=$RUN/final"
check lora_model_dir_tests python3 -m pytest -q -x tests/test_lora_model_dir.py
check added_tokens_tests python3 -m pytest -q -x tests/test_added_tokens.py
check lora_vs_full_perf python3 bench/gpu_lora.py --seq 2048 --batch 4 --steps 8
grep -h "step 8:\|step 12:" "$OUT"/lora_train_1gpu.log "$OUT"/lora_resume_1gpu.log | tail -2
tail -12 "$OUT"/lora_vs_full_perf.log
report

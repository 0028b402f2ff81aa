#!/usr/bin/env bash
# The shell-bodied steps of bench/gpu_all.sh, one function each, run as `bash bench/gpu_steps.sh NAME`
# by gpu_all.sh's step helper (which owns the timeout, the log and the summary row). Each function
# prints `HEADLINE: ...` (the summary's figure) and exits 0 (PASS), 1 (FAIL) or 77 (SKIP, the
# headline says why). They read what gpu_all.sh exports:
#   GPU_ALL_DEVICE   cuda | cpu (--cpu-smoke)        GPU_ALL_SCRATCH  a private scratch folder
#   GPU_ALL_SMOKE    0 | 1                           PY, PYTHONPATH   set by bench/_gpu_common.sh
# Both forms run the same commands; the smoke form is a tiny model, a small corpus and 2-3 steps.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_common.sh"
: "${GPU_ALL_DEVICE:?run through bench/gpu_all.sh}" "${GPU_ALL_SCRATCH:?}" "${GPU_ALL_SMOKE:?}"
gpu_env "$([ "$GPU_ALL_DEVICE" = cuda ] && echo 1 || echo 0)" >/dev/null  # this checkout's src/ first
S=$GPU_ALL_SCRATCH

if [ "$GPU_ALL_SMOKE" = 1 ]; then
  TRAIN=(--set base_model=tiny-llama --set tokenizer_vocab_size=512 --set sequence_len=32
         --set micro_batch_size=2 --set logging_steps=1 --set learning_rate=1e-2
         --set "datasets=[{path: 'builtin:stdlib', max_bytes: 50000}]")
  FIRST=2 THEN=3   # train to FIRST (checkpoint there), resume to THEN
else
  TRAIN=(--set base_model=quickstart-llama --set sequence_len=512 --set micro_batch_size=4
         --set logging_steps=4 --set learning_rate=1e-3
         --set "datasets=[{path: 'builtin:stdlib', max_bytes: 400000}]")
  FIRST=8 THEN=12
fi
TRAIN+=(--set device="$GPU_ALL_DEVICE" --set bf16=true --set "dataset_cache_dir=$S/cache")
LORA=(examples/cpu/lora_fsdp_tp.yaml --set dp_shard_size=1 --set tensor_parallel_size=1 "${TRAIN[@]}")

train() { "$PY" -m ndparallel train "$@"; }
fail() { echo "FAIL $*"; echo "HEADLINE: $*"; exit 1; }
last_step_line() { grep -h "^step $1: loss" "${@:2}" | tail -1 | cut -d"|" -f1,4- | cut -c1-140; }
grep_or_fail() {  # grep_or_fail PATTERN FILE WHAT
  grep -q -- "$1" "$2" || fail "$3 (no '$1' in the output)"
}

# --- LoRA on one device (issue 20): train + checkpoint, resume, adapter/merged exports, lora_model_dir
lora_train() {
  rm -rf "$S/lora"
  train "${LORA[@]}" --set "output_dir=$S/lora" --set max_steps=$FIRST --set save_steps=$FIRST \
    | tee "$S/lora_train.out" || fail "ndparallel train (LoRA) exited non-zero"
  grep_or_fail "checkpoint saved" "$S/lora_train.out" "no checkpoint written"
  echo "HEADLINE: LoRA bf16 $(last_step_line "$FIRST" "$S/lora_train.out")"
}
lora_resume() {
  train "${LORA[@]}" --set "output_dir=$S/lora" --set max_steps=$THEN --set save_steps=$FIRST \
    --set resume_from_checkpoint=auto | tee "$S/lora_resume.out" || fail "resumed LoRA run exited non-zero"
  grep_or_fail "resumed from .*checkpoint-$FIRST at step $FIRST" "$S/lora_resume.out" "did not resume"
  [ -f "$S/lora/final/adapter_config.json" ] || fail "no PEFT adapter in $S/lora/final"
  [ -d "$S/lora/merged" ] || fail "no merged model in $S/lora/merged"
  echo "HEADLINE: resumed at $FIRST; $(last_step_line "$THEN" "$S/lora_resume.out"); adapter + merged exported"
}
lora_exports_agree() {
  "$PY" - "$S/lora" "$GPU_ALL_DEVICE" <<'PY'
import sys
import torch, transformers
from peft import PeftModel
run, dev = sys.argv[1], sys.argv[2]
merged = transformers.AutoModelForCausalLM.from_pretrained(f"{run}/merged", dtype=torch.float32).to(dev).eval()
torch.manual_seed(42)  # the preset's random base, drawn like load_model (seed 42)
base = transformers.AutoModelForCausalLM.from_config(merged.config, dtype=torch.bfloat16).float().to(dev)
lora = PeftModel.from_pretrained(base, f"{run}/final").eval()
ids = torch.randint(0, merged.config.vocab_size, (2, 64), device=dev)
with torch.no_grad():
    a, b = lora(input_ids=ids).logits, merged(input_ids=ids).logits
    with lora.disable_adapter():
        c = lora(input_ids=ids).logits
diff, effect = (a - b).abs().max().item(), (a - c).abs().max().item()
print(f"max |adapter - merged| logits {diff:.4f}; the adapter's own effect {effect:.4f}")
ok = effect > 0 and diff < 0.2 * effect
print(f"HEADLINE: |adapter - merged| {diff:.2e} vs the adapter's effect {effect:.2e} ({'<' if ok else 'NOT <'} 0.2x)")
sys.exit(0 if ok else 1)
PY
}
lora_model_dir() {
  rm -rf "$S/lora_continue"
  train "${LORA[@]}" --set "output_dir=$S/lora_continue" --set max_steps=2 --set save_steps=null \
    --set "lora_model_dir=$S/lora/final" | tee "$S/lora_continue.out" || fail "run from lora_model_dir exited non-zero"
  [ -f "$S/lora_continue/final/adapter_config.json" ] || fail "no adapter exported"
  echo "HEADLINE: continued from the exported adapter: $(last_step_line 2 "$S/lora_continue.out")"
}

# --- runtime (issue 13): train + checkpoint, resume, export, CPU offload, process-group timeouts
runtime_train() {
  rm -rf "$S/run"
  train "${TRAIN[@]}" --set "output_dir=$S/run" --set max_steps=$FIRST --set save_steps=$FIRST \
    | tee "$S/run_train.out" || fail "ndparallel train exited non-zero"
  grep_or_fail "checkpoint saved" "$S/run_train.out" "no checkpoint written"
  echo "HEADLINE: $(last_step_line "$FIRST" "$S/run_train.out")"
}
runtime_resume() {
  train "${TRAIN[@]}" --set "output_dir=$S/run" --set max_steps=$THEN --set save_steps=$FIRST \
    --set resume_from_checkpoint=auto | tee "$S/run_resume.out" || fail "resumed run exited non-zero"
  grep_or_fail "resumed from .*checkpoint-$FIRST at step $FIRST" "$S/run_resume.out" "did not resume"
  echo "HEADLINE: resumed at $FIRST; $(last_step_line "$THEN" "$S/run_resume.out")"
}
runtime_export() {
  "$PY" - "$S/run/final" "$GPU_ALL_DEVICE" <<'PY'
import sys
import torch, transformers
path, dev = sys.argv[1], sys.argv[2]
m = transformers.AutoModelForCausalLM.from_pretrained(path).to(dev)
dtype = next(m.parameters()).dtype
ids = m.generate(torch.tensor([[1, 2, 3]], device=dev), max_new_tokens=8, do_sample=False)
n = sum(p.numel() for p in m.parameters())
print(f"HEADLINE: final model loads ({n:,} params, {dtype}) and generates {ids.shape[1] - 3} tokens")
sys.exit(0 if dtype == torch.bfloat16 else 1)  # a bf16 run exports bf16
PY
}
runtime_offload() {
  rm -rf "$S/run_offload"
  train "${TRAIN[@]}" --set "output_dir=$S/run_offload" --set max_steps=$FIRST --set save_steps=null \
    --set fsdp_config.cpu_offload=true | tee "$S/run_offload.out" || fail "CPU-offload run exited non-zero"
  echo "HEADLINE: CPU offload: $(last_step_line "$FIRST" "$S/run_offload.out")"
}
group_timeouts() {
  "$PY" - "$GPU_ALL_DEVICE" <<'PY'
import sys
import torch
from ndparallel import Accelerator, ParallelismConfig
dev = sys.argv[1]
acc = Accelerator(ParallelismConfig(), device=dev, timeout_s=123)
got = {d: acc.mesh(d).get_group()._get_backend(torch.device(dev)).options._timeout.total_seconds()
       for d in ("dp_shard", "tp", "cp", "dp_cp")}
print(got)
ok = all(v == 123 for v in got.values())
backend = torch.distributed.get_backend()
print(f"HEADLINE: {backend} groups of every mesh dim time out after {set(got.values())} s (asked 123)")
sys.exit(0 if ok else 1)
PY
}

# --- tests with the GPU visible: CPU-pinned tests must not pick up (or be broken by) the GPU
tests_gpu_visible() {
  local sel=(tests/test_layout.py tests/test_faults_subgroups.py tests/test_prepare_init.py tests/test_nonfinite.py
             tests/test_rank0_and_rotation.py tests/test_lora_checkpoint.py tests/test_lora_model_dir.py
             tests/test_added_tokens.py tests/test_float8.py)
  if [ "$GPU_ALL_SMOKE" = 1 ]; then  # the suite runs these itself: here only check the selection exists
    "$PY" -m pytest -q -p no:cacheprovider --collect-only "${sel[@]}" | tee "$S/collect.out" || fail "collection failed"
    echo "HEADLINE: $(tail -1 "$S/collect.out") (smoke: collected, not run)"
    return 0
  fi
  "$PY" -m pytest -q -p no:cacheprovider -m "not slow" "${sel[@]}" | tee "$S/tests.out"
  local rc=${PIPESTATUS[0]}
  echo "HEADLINE: $(tail -1 "$S/tests.out")"
  return "$rc"
}

# --- hooks for rows other issues add (see bench/gpu_all.sh, "Adding a step")
simulate() {  # issue 28: one real rank of big worlds over fake collectives, vs the planner
  # GPU: the Llama-3.1-8B / Qwen3-8B / 70B / 405B rows of bench/gpu_simulate.py, one JSON each as it
  # ends; smoke: its tiny CPU row (same code path: `ndparallel simulate --json`)
  "$PY" bench/gpu_simulate.py --out "${BENCH_RESULTS_DIR:-$S/simulate}" \
    $([ "$GPU_ALL_SMOKE" = 1 ] && echo --cpu-smoke) | tee "$S/simulate.out"
  local rc=${PIPESTATUS[0]}
  echo "HEADLINE: $(grep -cE '^PASS' "$S/simulate.out") rows passed; $(grep -E '^(PASS|FAIL)' "$S/simulate.out" | head -1 | cut -c1-200)"
  return "$rc"
}
long_context() {  # issue 31: the long-context rows
  if [ ! -f bench/gpu_long_context.py ]; then
    echo "HEADLINE: bench/gpu_long_context.py absent (issue 31 not built yet)"
    exit 77
  fi
  "$PY" bench/gpu_long_context.py $([ "$GPU_ALL_SMOKE" = 1 ] && echo --tiny --seqs 128 --steps 1)
}

name=${1:?usage: bash bench/gpu_steps.sh STEP}
declare -F "$name" >/dev/null || { echo "gpu_steps.sh: no step named $name" >&2; exit 2; }
"$name"

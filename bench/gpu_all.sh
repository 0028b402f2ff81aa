#!/usr/bin/env bash
# GPU acceptance in one command (issue 30): every prepared one-GPU check, most valuable first, inside
# one time budget, so that one device call (~9 minutes) brings back everything measured.
#
#   bash bench/gpu_wheels.sh                      # once, where the internet is: wheels into .whl/
#   bash bench/gpu_all.sh [--budget S] [--out DIR] [--only GLOBS] [--list]     # on the GPU machine
#   bash bench/gpu_all.sh --cpu-smoke --out DIR   # every step in its tiny CPU form (tests/test_gpu_all.py)
#   python bench/run_all.py --list                # the whole bench suite; these steps appear as gpu:NAME
#
#   --budget S   seconds for the whole run (default 540; 1500 with --cpu-smoke, where every cap is also
#                CAP_SCALE=4 times larger: two shared CPU cores are slower than the GPU machine's 16)
#   --out DIR    where results go (default $OUT when set: the folder that comes back from the GPU
#                machine; else /tmp/gpu_all)
#   --only GLOBS comma-separated step names or globs (e.g. 'lora_*,perf_2048'): the others are SKIP rows
#   --list       print the steps with their caps and commands, run nothing
#   --cpu-smoke  the same steps, each in a tiny CPU form: tiny model, 2-3 steps, same code path; every
#                `$PY` there is a fork of one interpreter that imported torch & co. once (bench/_warm_python.py)
#
# DIR/env.txt is written first (GPU, versions, compiler, the step list); then each step runs under
# `timeout min(cap, time left)`, or is a SKIP row when less than half its cap is left; its output goes
# to DIR/NAME.log and one row to DIR/summary.tsv as soon as it ends: name, PASS/FAIL/SKIP, seconds, the
# headline figure (the step's last `HEADLINE:` line, or why it failed). JSON results of the bench
# scripts go to DIR/results/. Exit 1 if any step FAILed, 2 on bad arguments or no GPU (without
# --cpu-smoke). When DIR is $OUT (which brings back at most 8 files), the logs and results are kept
# in a scratch folder and packed into DIR/gpu_all.tar.gz after every step, beside summary.tsv and
# env.txt; a run cut short still returns everything up to its last finished step.
#
# Adding a step: one `step NAME CAP COMMAND...` line in plan_steps below, in order of value. COMMAND
# runs from the repository root with PY, PYTHONPATH, GPU_ALL_DEVICE (cuda|cpu), GPU_ALL_SMOKE (0|1),
# GPU_ALL_SCRATCH and BENCH_RESULTS_DIR set; it takes its tiny CPU form when GPU_ALL_SMOKE=1 (a bench
# script: `$TINY`, i.e. --tiny), prints `HEADLINE: <figure>`, exits 0 PASS / 1 FAIL / 77 SKIP (the
# headline then says why), and fits CAP seconds on one H200. Shell bodies go in bench/gpu_steps.sh.
# The scale rows (issue 28, `ndparallel simulate`, bench/gpu_simulate.py): one rank of Llama-3.1-8B
# HSDP 2x4 x TP 2 (world 16, seq 2048), Qwen3-8B FSDP 2 x CP 2 x TP 2 (seq 8192), Llama-3.1-70B FSDP 8
# x TP 8 (world 64), 405B on 512: measured peak memory and compute time vs the planner (step
# `simulate`). The long-context rows (issue 31): step `long_context` (bench/gpu_long_context.py).
# Steps `compile` and `fp8` (issue 50): tokens/s and MFU of regional compile and of float8 linears beside
# eager bf16 and Accelerate, read from perf_2048's JSON (bench/gpu_row.py; measured there when absent).
# Step `dynamic_widths` (issue 62): micro-batches cut after their longest row under compile, with and
# without the width buckets: distinct widths and dynamo's compilations (bench/dynamic_widths.py).
# The SP activation memory of issue 50 (saved bytes per token and layer, tp 1-8, fake tp world on one
# GPU): step `sp_memory` (bench/sp_activation_memory.py).
# Pipeline parallel (one GPU cannot hold two NCCL stages): step `pipeline_stages`, stage 0 and the
# last stage of a 2-stage cut of the Llama-3.2-1B shape, fwd/bwd time and memory per micro-batch in flight.
set -uo pipefail
T0=$SECONDS  # the budget counts from here: wheel installation and env.txt included
BUDGET="" DIR="" SMOKE=0 ONLY="" LIST=0
while (($#)); do
  case $1 in
    --budget) BUDGET=${2:-}; shift 2 || shift ;;
    --out) DIR=${2:-}; shift 2 || shift ;;
    --only) ONLY=${2:-}; shift 2 || shift ;;
    --cpu-smoke) SMOKE=1; shift ;;
    --list) LIST=1; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_all.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
BUDGET=${BUDGET:-$([ "$SMOKE" = 1 ] && echo 1500 || echo 540)}
[[ $BUDGET =~ ^[1-9][0-9]*$ ]] || { echo "gpu_all.sh: --budget must be a positive number of seconds, got '$BUDGET'" >&2; exit 2; }
if [ "$LIST" = 0 ]; then  # resolve DIR before _gpu_common.sh moves to the repository root
  DIR=${DIR:-${OUT:-/tmp/gpu_all}}
  mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd) || { echo "gpu_all.sh: cannot create --out $DIR" >&2; exit 2; }
fi
export GPU_ALL_DEVICE=$([ "$SMOKE" = 1 ] && echo cpu || echo cuda)
source "$(dirname "${BASH_SOURCE[0]}")/_gpu_common.sh" || exit 2

# ------------------------------------------------------------------------------------ the steps
TINY=$([ "$SMOKE" = 1 ] && echo --tiny)
CAP_SCALE=$([ "$SMOKE" = 1 ] && echo 4 || echo 1)
plan_steps() {
  step perf_2048 300 "$PY" bench/gpu_single.py --seqs "$([ "$SMOKE" = 1 ] && echo 32 || echo 2048)" \
    --name gpu_single_2048 $TINY
  step compile 240 "$PY" bench/gpu_row.py compile $TINY  # perf_2048's compile row; measures it when absent
  step fp8 240 "$PY" bench/gpu_row.py fp8 $TINY          # perf_2048's float8 row; likewise
  step dynamic_widths 120 "$PY" bench/dynamic_widths.py --device "$GPU_ALL_DEVICE" $TINY  # compilations per width
  step accelerate_compat 90 "$PY" bench/gpu_accelerate_compat.py $TINY
  step lora_train 90 bash bench/gpu_steps.sh lora_train
  step lora_resume 90 bash bench/gpu_steps.sh lora_resume
  step lora_exports_agree 60 bash bench/gpu_steps.sh lora_exports_agree
  step lora_model_dir 90 bash bench/gpu_steps.sh lora_model_dir
  step lora_perf 150 "$PY" bench/gpu_lora.py $TINY
  step bad_inputs 150 bash tests/scripts/gpu_inputs_check.sh
  step runtime_train 90 bash bench/gpu_steps.sh runtime_train
  step runtime_resume 90 bash bench/gpu_steps.sh runtime_resume
  step runtime_export 60 bash bench/gpu_steps.sh runtime_export
  step runtime_offload 90 bash bench/gpu_steps.sh runtime_offload
  step group_timeouts 60 bash bench/gpu_steps.sh group_timeouts
  step cp_kernels 120 "$PY" bench/gpu_cp.py --device "$GPU_ALL_DEVICE" $TINY
  step sp_memory 90 "$PY" bench/sp_activation_memory.py --device "$GPU_ALL_DEVICE" \
    $([ "$SMOKE" = 1 ] && echo --tiny || echo --hidden 4096 --seq 8192)
  step planner_rows 150 "$PY" bench/plan_gpu_check.py --configs 1b-mb4,1b-mb4-ac,1b-s8k-mb1 $TINY
  step perf_8192 240 "$PY" bench/gpu_single.py --seqs "$([ "$SMOKE" = 1 ] && echo 64 || echo 8192)" \
    --name gpu_single_8192 $TINY
  step simulate 300 bash bench/gpu_steps.sh simulate
  step long_context 200 bash bench/gpu_steps.sh long_context
  step checkpoint_async 150 "$PY" bench/gpu_checkpoint_async.py $TINY
  step pipeline_stages 120 "$PY" bench/pipeline.py --one-rank-stage --device "$GPU_ALL_DEVICE" $TINY
  step tests_gpu_visible 300 bash bench/gpu_steps.sh tests_gpu_visible
}

# ------------------------------------------------------------------------------ the step helper
selected() {
  [ -z "$ONLY" ] && return 0
  local glob
  IFS=, read -ra globs <<<"$ONLY"
  for glob in "${globs[@]}"; do [[ $1 == $glob ]] && return 0; done  # glob match intended
  return 1
}
row() {  # row NAME RESULT SECONDS HEADLINE: append to summary.tsv, then bring DIR up to date
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ' | cut -c1-400)" >>"$WORK/summary.tsv"
  printf '%-20s %-4s %5ss  %s\n' "$1" "$2" "$3" "$4"
  [ "$2" = FAIL ] && FAILS=$((FAILS + 1))
  sync_out
}
step() {  # step NAME CAP COMMAND...
  local name=$1 cap=$2; shift 2
  if [ "$LIST" = 1 ]; then printf '%-20s %4ss  %s\n' "$name" "$cap" "$*"; return 0; fi
  if ! selected "$name"; then row "$name" SKIP 0 "not selected (--only $ONLY)"; return 0; fi
  cap=$((cap * CAP_SCALE))
  local left=$((BUDGET - (SECONDS - T0)))
  if ((2 * left < cap)); then row "$name" SKIP 0 "budget: ${left}s left, under half the ${cap}s cap"; return 0; fi
  local limit=$((cap < left ? cap : left)) t=$SECONDS rc result headline cpu0 cpu
  echo "=== $name (limit ${limit}s): $*" >"$WORK/$name.log"
  children_cpu; cpu0=$CPU
  timeout -k 10 "$limit" "$@" >>"$WORK/$name.log" 2>&1 </dev/null
  rc=$?
  children_cpu; cpu=$(awk -v a="$cpu0" -v b="$CPU" 'BEGIN {printf "%.1f", b - a}')
  echo "=== $name: exit $rc after $((SECONDS - t)) s, ${cpu} s CPU (user + sys)" >>"$WORK/$name.log"
  headline=$(grep -a '^HEADLINE: ' "$WORK/$name.log" | tail -1 | cut -c11-)
  case $rc in
    0) result=PASS ;;
    77) result=SKIP ;;
    124 | 137) result=FAIL; headline="timed out after ${limit}s${headline:+; $headline}" ;;
    *) result=FAIL
       [ -n "$headline" ] || headline="exit $rc: $(grep -av '^\s*$' "$WORK/$name.log" | tail -1)" ;;
  esac
  [ "$result" = FAIL ] && tail -n 12 "$WORK/$name.log" | sed "s/^/  [$name] /"
  row "$name" "$result" "$((SECONDS - t))" "$headline"
}
children_cpu() {  # CPU = user + sys seconds of this shell's finished children (`times`, 2nd line;
  times >"$SCRATCH/.times"  # in this shell: a subshell would count only its own children) and the warm
  # interpreter's (bench/_warm_python.py: its forks are its children, not this shell's)
  CPU=$(tail -1 "$SCRATCH/.times" | awk -v warm="$(cat "$SCRATCH/warm.sock.cpu" 2>/dev/null)" \
    '{ for (i = 1; i <= 2; i++) { split($i, t, /[ms]/); s += t[1] * 60 + t[2] } } END { printf "%.2f", s + warm }')
}
sync_out() {  # in pack mode: summary, env and an archive of everything else into DIR
  [ "$PACK" = 1 ] || return 0
  cp -f "$WORK/summary.tsv" "$WORK/env.txt" "$DIR/" 2>/dev/null
  tar -czf "$DIR/gpu_all.tar.gz.tmp" -C "$WORK" . && mv -f "$DIR/gpu_all.tar.gz.tmp" "$DIR/gpu_all.tar.gz"
}

warm_python() {  # --cpu-smoke: every `$PY` a fork of one interpreter that imported torch & co. once
  local sock=$SCRATCH/warm.sock real
  real=$(command -v "$PY") || return 0
  "$real" bench/_warm_python.py serve "$sock" </dev/null >"$SCRATCH/warm.log" 2>&1 &
  WARM_PID=$!
  while [ ! -S "$sock" ] && [ -e "/proc/$WARM_PID" ] && ! grep -q '^[^)]*) Z' "/proc/$WARM_PID/stat" 2>/dev/null
  do sleep 0.1; done
  [ -S "$sock" ] || { WARM_PID=""; return 0; }  # it did not start (PY=false in the tests): PY unchanged
  printf '#!/usr/bin/env bash\nexec %q -S %q run %q "$@"\n' "$real" "$GPU_ROOT/bench/_warm_python.py" "$sock" \
    >"$SCRATCH/python" && chmod +x "$SCRATCH/python" && PY=$SCRATCH/python && export GPU_ALL_WARM_PY=$PY
  WHEELS+="; every \$PY a fork of one warm interpreter (bench/_warm_python.py)"
}

write_env() {
  echo "gpu_all.sh $([ "$SMOKE" = 1 ] && echo --cpu-smoke) budget ${BUDGET}s, started $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (not a git checkout)')" \
    "$(git status --porcelain 2>/dev/null | grep -c . | sed 's/^0$//; s/.\+/+ & uncommitted changes/')"
  echo "steps: $(LIST=1 plan_steps | awk '{printf "%s ", $1}')"
  echo "host: $(uname -srm), $(nproc --all) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo)"
  echo "$WHEELS"
  echo "--- nvidia-smi"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv 2>&1
  else echo "not found"; fi
  echo "--- C compiler (inductor and triton build kernels with it)"
  for cc in cc gcc clang; do command -v "$cc" >/dev/null && echo "$cc: $("$cc" --version 2>&1 | head -1)"; done
  echo "--- python packages (version, from where)"
  "$PY" - <<'PY' 2>&1
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "accelerate", "peft", "torchao", "triton", "datasets", "pydantic",
             "safetensors", "tensorboard"):
    try:
        m = importlib.import_module(name)
        print(f"{name:13} {getattr(m, '__version__', '?'):24} {m.__file__}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:13} MISSING ({type(e).__name__}: {str(e)[:120]})")
import torch
cuda = torch.cuda.is_available()
print("cuda", torch.version.cuda, "available", cuda, "devices", torch.cuda.device_count(),
      "cudnn", torch.backends.cudnn.version() if cuda else None)
if cuda:
    p = torch.cuda.get_device_properties(0)
    print("device 0:", p.name, f"{p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}, {p.multi_processor_count} SMs")
PY
}

# ------------------------------------------------------------------------------------- the run
if [ "$LIST" = 1 ]; then plan_steps; exit 0; fi
PACK=0 WORK=$DIR
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ "$(cd "$OUT" && pwd)" = "$DIR" ]; then
  PACK=1 WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_all_out.XXXXXX")
fi
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_all_scratch.XXXXXX")
WARM_PID=""
trap '[ -n "$WARM_PID" ] && kill "$WARM_PID" && wait "$WARM_PID"; rm -rf "$SCRATCH"; [ "$PACK" = 1 ] && rm -rf "$WORK"' EXIT
rm -f "$DIR/summary.tsv" "$DIR/env.txt" "$DIR/gpu_all.tar.gz"
for name in $(LIST=1 plan_steps | awk '{print $1}'); do rm -f "$DIR/$name.log"; done  # no stale logs
if [ "$SMOKE" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  gpu_env 0 >"$SCRATCH/wheels.txt" 2>&1
  WHEELS="wheels: not used (--cpu-smoke)"
else
  gpu_env 1 >"$SCRATCH/wheels.txt" 2>&1
  WHEELS=$(tail -3 "$SCRATCH/wheels.txt")
fi
export GPU_ALL_SMOKE=$SMOKE GPU_ALL_SCRATCH=$SCRATCH BENCH_RESULTS_DIR=$WORK/results
[ "$SMOKE" = 1 ] && warm_python
FAILS=0
write_env >"$WORK/env.txt" 2>&1
printf 'step\tresult\tseconds\theadline\n' >"$WORK/summary.tsv"
sync_out
echo "gpu_all.sh: results in $DIR$([ "$PACK" = 1 ] && echo ' (packed: gpu_all.tar.gz)'); budget ${BUDGET}s"
if [ "$SMOKE" = 0 ] && ! grep -q "available True" "$WORK/env.txt"; then
  echo "gpu_all.sh: no CUDA device visible (see $DIR/env.txt); on a machine without one use --cpu-smoke" >&2
  exit 2
fi
plan_steps
n() { awk -F'\t' -v r="$1" 'NR > 1 && $2 == r' "$WORK/summary.tsv" | grep -c .; }
echo "gpu_all.sh: $(n PASS) PASS, $(n FAIL) FAIL, $(n SKIP) SKIP in $((SECONDS - T0)) s (budget ${BUDGET}s); $DIR/summary.tsv"
((FAILS == 0))

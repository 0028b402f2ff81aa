# Shared by the prepared one-GPU checks (bench/gpu_check.sh, bench/gpu_lora.sh); sourced, not run.
# Sets up the GPU image's Python path (wheels carried in .whl/, see bench/gpu_wheels.sh), defines
# `check NAME COMMAND...` (runs it, logs to $OUT/NAME.log, records PASS/FAIL and seconds) and
# `report` (prints the table of checks).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -d .whl ] && ! python3 -c "import datasets, pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT"
results=()
check() {
  local name=$1; shift; local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then results+=("$name|PASS|$((SECONDS - t0))"); else
    results+=("$name|FAIL (see $OUT/$name.log)|$((SECONDS - t0))"); tail -20 "$OUT/$name.log"; fi
}
report() {
  printf '\n%-22s %-34s %s\n' check result seconds
  for r in "${results[@]}"; do IFS='|' read -r a b c <<<"$r"; printf '%-22s %-34s %s\n' "$a" "$b" "$c"; done
}

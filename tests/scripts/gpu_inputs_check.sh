#!/usr/bin/env bash
# Bad inputs on CUDA (issue 14): the `bad_inputs` step of bench/gpu_all.sh; also runs alone, from
# anywhere, on the GPU machine (carry .whl): bash tests/scripts/gpu_inputs_check.sh
# Checks, each a PASS/FAIL line (exit 1 if any FAILed): with `device: cuda` a 1-rank run passes the
# pre-launch checks, trains and claims its output_dir (the run record); a second run into it is
# refused in one stderr line with exit 2 and leaves the first run's files byte for byte; the
# in-process bad-input cases of tests/test_bad_inputs.py pass with the GPU visible. Under
# `gpu_all.sh --cpu-smoke` (GPU_ALL_DEVICE=cpu) the same on CPU, the pytest cases collected, not
# run (the suite runs them).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../bench/_gpu_common.sh" || exit 2
DEVICE=${GPU_ALL_DEVICE:-cuda}
gpu_env "$([ "$DEVICE" = cuda ] && echo 1 || echo 0)" >/dev/null
W=${GPU_ALL_SCRATCH:-${TMPDIR:-/tmp}}/bad_inputs
rm -rf "$W" && mkdir -p "$W"
fails=0 passed=0
expect() {  # expect WHAT OK(0|1)
  if [ "$2" = 1 ]; then echo "PASS $1"; passed=$((passed + 1)); else echo "FAIL $1"; fails=$((fails + 1)); fi
}
yes_no() { "$@" && echo 1 || echo 0; }
digest() { (cd "$1" && find . -type f | LC_ALL=C sort | xargs -d '\n' sha256sum | sha256sum); }

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
args=(--set base_model=tiny-llama --set tokenizer_vocab_size=512 --set sequence_len=32
      --set "datasets=[{path: 'builtin:stdlib', max_bytes: 50000}]" --set "output_dir=$W/run"
      --set "dataset_cache_dir=$W/cache" --set "device=$DEVICE" --set save_steps=1 --set save_total_limit=1
      --set max_steps=2 --set logging_steps=1)
timeout 200 "$PY" -m ndparallel train "${args[@]}" >"$W/first.log" 2>&1
rc=$?
tail -3 "$W/first.log"
expect "first run on $DEVICE exits 0 (got $rc)" "$((rc == 0))"
expect "first run claimed its output_dir (.ndparallel-run.json)" "$(yes_no test -f "$W/run/.ndparallel-run.json")"
before=$(digest "$W/run")
timeout 100 "$PY" -m ndparallel train "${args[@]}" --set seed=7 >"$W/second.out" 2>"$W/second.err"
rc=$?
cat "$W/second.err"
expect "a second run into that output_dir is refused with exit 2 (got $rc)" "$((rc == 2))"
lines=$(grep -c . "$W/second.err")
one_line=0
[ "$lines" = 1 ] && grep -q output_dir "$W/second.err" && one_line=1
expect "in one stderr line naming output_dir (got $lines lines)" "$one_line"
expect "the first run's files are intact" "$(yes_no [ "$before" = "$(digest "$W/run")" ])"
cases=(tests/test_bad_inputs.py -k "not end_to_end and not found_on_the_ranks")
if [ "$DEVICE" = cpu ]; then
  timeout 200 "$PY" -m pytest -q -p no:cacheprovider --collect-only "${cases[@]}" >"$W/pytest.log" 2>&1
  rc=$?
  expect "the in-process bad-input cases are collected: $(tail -1 "$W/pytest.log")" "$((rc == 0))"
else
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider "${cases[@]}" >"$W/pytest.log" 2>&1
  rc=$?
  expect "the in-process bad-input cases pass with the GPU visible: $(tail -1 "$W/pytest.log")" "$((rc == 0))"
fi
tail -3 "$W/pytest.log"
echo "HEADLINE: $passed/$((passed + fails)) bad-input checks on $DEVICE passed"
exit $((fails > 0))

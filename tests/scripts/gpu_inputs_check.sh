#!/usr/bin/env bash
# GPU check for issue #14 (a few minutes on one GPU): on a CUDA machine `device: cuda` passes the
# pre-launch checks, a 1-rank CUDA run claims its output_dir (run record), a second run into it is
# refused in one line with exit 2 leaving the first run's files intact, and the in-process bad-input
# cases pass. Run from the repository root: bash tests/scripts/gpu_inputs_check.sh
set -u
export PYTHONPATH=src HF_HUB_OFFLINE=1
W=${OUT:-/tmp}/gpu14; rm -rf "$W"; mkdir -p "$W"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
args=(--set base_model=tiny-llama --set tokenizer_vocab_size=512 --set sequence_len=32
      --set "datasets=[{path: 'builtin:stdlib', max_bytes: 50000}]" --set "output_dir=$W/run"
      --set "dataset_cache_dir=$W/cache" --set device=cuda --set save_steps=1 --set save_total_limit=1
      --set max_steps=2 --set logging_steps=1)
timeout 200 python -m ndparallel train "${args[@]}" > "$W/first.log" 2>&1; echo "first run rc=$? (expect 0)"
tail -3 "$W/first.log"
ls -a "$W/run"; cat "$W/run/.ndparallel-run.json"; echo
before=$(cd "$W/run" && find . -type f | sort | xargs sha256sum | sha256sum)
timeout 100 python -m ndparallel train "${args[@]}" --set seed=7 2> "$W/second.err"; echo "second run rc=$? (expect 2)"
echo "stderr lines: $(wc -l < "$W/second.err")"; cat "$W/second.err"
after=$(cd "$W/run" && find . -type f | sort | xargs sha256sum | sha256sum)
[ "$before" = "$after" ] && echo "first run's files intact: yes" || echo "first run's files intact: NO"
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_bad_inputs.py -k "not end_to_end and not found_on_the_ranks" 2>&1 | tail -3

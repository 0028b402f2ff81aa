#!/usr/bin/env bash
# The prepared GPU check of the runtime (issue #13): one command, < 8 min on one GPU, prints a table.
#   bash bench/gpu_wheels.sh            # once, where the internet is (the GPU image lacks datasets, pydantic)
#   bash bench/gpu_check.sh             # on the GPU machine, from the repository root (carry .whl)
# It checks: the CPU-pinned tests and `verify` pass with GPUs visible; one-GPU `ndparallel train`
# (bf16, NCCL eager init, checkpoint, resume, export) and CPU offload; mesh groups carry the timeout.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
source "$(dirname "$0")/_gpu_common.sh"
RUN=/tmp/gpu_check_run; rm -rf "$RUN" "$RUN-offload"
COMMON=(--set base_model=quickstart-llama --set "datasets=[{path: 'builtin:stdlib', max_bytes: 2000000}]"
        --set sequence_len=512 --set micro_batch_size=4 --set device=cuda --set bf16=true
        --set save_steps=8 --set logging_steps=4 --set "output_dir=$RUN" --set "dataset_cache_dir=/tmp/gpu_check_cache")
check cpu_pinned_tests python3 -m pytest -q -x tests/test_layout.py tests/test_faults_subgroups.py \
  tests/test_prepare_init.py tests/test_nonfinite.py tests/test_rank0_and_rotation.py
check verify_on_gpu_box python3 -m ndparallel verify examples/cpu/fsdp_tp.yaml
check train_1gpu python3 -m ndparallel train "${COMMON[@]}" --set max_steps=8
check resume_1gpu python3 -m ndparallel train "${COMMON[@]}" --set max_steps=12 --set resume_from_checkpoint=auto
check export_loads python3 -c "
import torch, transformers
m = transformers.AutoModelForCausalLM.from_pretrained('$RUN/final')
assert next(m.parameters()).dtype == torch.bfloat16, 'bf16 run exports bf16'
print('final model', sum(p.numel() for p in m.parameters()), 'params, dtype bf16')"
check cpu_offload_1gpu python3 -m ndparallel train "${COMMON[@]}" --set max_steps=4 --set save_steps=null \
  --set "output_dir=$RUN-offload" --set fsdp_config.cpu_offload=true
check nccl_group_timeouts python3 - <<'PY'
import torch
from ndparallel import Accelerator, ParallelismConfig
acc = Accelerator(ParallelismConfig(), device="cuda", timeout_s=123)
for dim in ("dp_shard", "tp", "cp", "dp_cp"):
    be = acc.mesh(dim).get_group()._get_backend(torch.device("cuda"))
    print(dim, be.options._timeout)
    assert be.options._timeout.total_seconds() == 123, dim
print("bound device", torch.distributed.distributed_c10d._get_default_group().bound_device_id)
PY
grep -h "step 12:\|step 8:" "$OUT"/resume_1gpu.log "$OUT"/train_1gpu.log | tail -3
report

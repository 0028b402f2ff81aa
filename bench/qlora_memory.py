"""Memory of QLoRA (a 4-bit NF4 base, torchao) against LoRA on a bf16 base, measured on CPU ranks.

(a) Base bytes per rank: a Llama (hidden 1024, MLP 2816, 16 heads / 4 KV heads; bf16 safetensors) is
    loaded with ``acc.load_model(..., adapter=LoRA r16 on every linear)`` under FSDP 1, 2, 4, once
    with a bf16 base and once with ``quantization=NF4Config()``; each rank sums the bytes its base
    shards hold (an NF4 shard: its packed codes, int8 scales, fp32 scaler-block scales, mean and
    table). Next to it: the planner's prediction (0.516 byte per linear value, 2 bytes for the rest).
(b) Host memory while loading (VmHWM increase over the RSS before ``load_model``, reset first via
    ``/proc/self/clear_refs``; the same load of a tiny model first, so lazy imports do not count): a
    QLoRA rank reads its rows in bf16 one decoder layer at a time and keeps only the NF4 shards, so
    its peak is its NF4 shards + one layer's bf16 rows + torchao's quantisation working set, never
    the whole model in bf16. Two peaks: of live tensors (torch's ``MemTracker``: what a device's
    ``max_memory_allocated`` would count) and of the RSS (glibc keeps freed temporaries resident).
(c) The dequantisation workspace: the peak of live tensors (torch's ``MemTracker``) while one
    ``get_original_weight()`` of an NF4 weight (bf16, 4096 x 4096) runs, against the planner's
    ``(8 + 3e)`` bytes per value (``plan/adapters/qlora.py``).

    python bench/qlora_memory.py               # table + bench/results/qlora_memory.json
    python bench/qlora_memory.py --layers 2    # quicker
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers  # noqa: F401  (imported once before forking the ranks)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, vm_bytes, write_json  # noqa: E402

from ndparallel.testing import run_on_ranks  # noqa: E402

MB = 2**20


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    )


def _save(path: str, layers: int) -> bool:
    from transformers import AutoModelForCausalLM

    from ndparallel.models.presets import preset_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(layers)).to(torch.bfloat16).save_pretrained(f"{path}/model")
    AutoModelForCausalLM.from_config(preset_config("tiny-llama")).save_pretrained(f"{path}/warmup")
    return True


def _nbytes(t: torch.Tensor) -> int:
    from ndparallel.models.quantized import is_nf4

    local = t.to_local() if hasattr(t, "to_local") else t
    if is_nf4(local):
        return sum(
            getattr(local, a).numel() * getattr(local, a).element_size()
            for a in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
        )
    return local.numel() * local.element_size()


def _load(path: str, fsdp: int, nf4: bool) -> dict:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.adapters import lora_config
    from ndparallel.models.quantized import NF4Config

    acc = Accelerator(ParallelismConfig(dp_shard_size=fsdp))
    # the same code path on a tiny model first: lazy imports (peft, torchao, DCP) are not the load's
    warm = acc.load_model(
        f"{path}/warmup",
        adapter=lora_config(r=4, target_linear=True),
        quantization=NF4Config(32, 4) if nf4 else None,
    )
    del warm
    acc._models.clear()
    from torch.distributed._tools.mem_tracker import MemTracker

    before = vm_bytes("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    tracker = MemTracker()
    with tracker:
        model = acc.load_model(
            f"{path}/model",
            dtype=torch.bfloat16,
            adapter=lora_config(r=16, target_linear=True),
            quantization=NF4Config() if nf4 else None,
        )
    peak = vm_bytes("VmHWM:") - before
    live = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    base = sum(_nbytes(p) for n, p in model.named_parameters() if ".lora_" not in n)
    return {"base_bytes": base, "load_peak": peak, "load_live_peak": live}


def _dequant_peak(rows: int, cols: int) -> dict:
    """Peak bytes of live tensors (torch's MemTracker: what max_memory_allocated would count) while
    one NF4 weight is dequantised."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from ndparallel.models.quantized import require_torchao

    _, to_nf4 = require_torchao()
    nf4 = to_nf4(torch.randn(rows, cols, dtype=torch.bfloat16))
    tracker = MemTracker()
    with tracker:
        out = nf4.get_original_weight()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {"peak": peak, "values": out.numel()}


def _predicted_base(layers: int, fsdp: int) -> float:
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.hardware import PRESETS as HW
    from ndparallel.plan.memory.peak import estimate_memory
    from ndparallel.plan.models import ModelSpec
    from ndparallel.plan.settings import Settings

    spec = ModelSpec(
        "bench", hidden=1024, layers=layers, heads=16, kv_heads=4, intermediate=2816, vocab=32000
    )
    layout = ParallelDims(dp_shard=fsdp)
    s = Settings(sequence_len=32, lora_r=16, load_in_4bit=True)
    from ndparallel.plan.adapters.lora_cost import adapter_shard_numel

    return (
        estimate_memory(spec, layout, s, HW["h100-80gb"]).params - adapter_shard_numel(spec, layout, 16) * 4
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run_on_ranks(_save, 1, tmp, args.layers)  # in a child: no rank inherits memory the parent freed
        for fsdp in (1, 2, 4):
            bf16 = max(
                run_on_ranks(_load, fsdp, tmp, fsdp, False, timeout_s=900), key=lambda r: r["load_peak"]
            )
            nf4 = max(run_on_ranks(_load, fsdp, tmp, fsdp, True, timeout_s=900), key=lambda r: r["load_peak"])
            predicted = _predicted_base(args.layers, fsdp)
            rows.append(
                [
                    f"FSDP {fsdp}",
                    bf16["base_bytes"] / MB,
                    nf4["base_bytes"] / MB,
                    nf4["base_bytes"] / bf16["base_bytes"],
                    predicted / MB,
                    bf16["load_live_peak"] / MB,
                    nf4["load_live_peak"] / MB,
                    bf16["load_peak"] / MB,
                    nf4["load_peak"] / MB,
                ]
            )
            results.append({"fsdp": fsdp, "bf16": bf16, "nf4": nf4, "planner_nf4_base_bytes": predicted})
    print_table(
        f"QLoRA vs LoRA on a bf16 base: Llama h1024 x {args.layers} layers, worst rank",
        [
            "layout",
            "bf16 base MB",
            "NF4 base MB",
            "NF4 / bf16",
            "planner NF4 MB",
            "load live bf16 MB",
            "load live NF4 MB",
            "load RSS bf16 MB",
            "load RSS NF4 MB",
        ],
        rows,
    )
    deq = run_on_ranks(_dequant_peak, 1, 4096, 4096)[0]
    per_value = deq["peak"] / deq["values"]
    print_table(
        "one NF4 dequantisation (bf16, 4096 x 4096)",
        ["measured peak MB", "bytes/value", "planner bytes/value"],
        [[deq["peak"] / MB, per_value, 8 + 3 * 2]],
    )
    print(f"wrote {write_json('qlora_memory', {'layers': args.layers, 'rows': results, 'dequant': deq})}")


if __name__ == "__main__":
    main()

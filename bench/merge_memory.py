"""Host memory of merging a LoRA adapter into its base offline: ``ndparallel export --merge``
(streamed tensor by tensor) against PEFT's ``merge_and_unload`` (the whole model loaded), for a base
of size S and 2·S. Each merge runs in a fresh process; the private memory it holds at its peak
(RssAnon, sampled, minus the imports') and VmHWM (process-wide, also counting the imports and the
memory-mapped safetensors pages) are reported.
Goal (the bound docs/lora.md states): ours stays about one output shard + one tensor whatever S;
PEFT's grows with S.

    python bench/merge_memory.py              # S ≈ 0.4 GB fp32; table + bench/results/merge_memory.json
    python bench/merge_memory.py --layers 2   # quicker
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import AnonPeak, print_table, vm_bytes, write_json  # noqa: E402

SHARD = "64MB"


def _make(root: Path, layers: int) -> tuple[Path, Path, int]:
    """A random Llama base (fp32 safetensors, 100 MB shards) and a random LoRA adapter over it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    base, adapter = root / f"base{layers}", root / f"adapter{layers}"
    model.save_pretrained(base, max_shard_size="100MB")
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(adapter)
    return base, adapter, nbytes


def _child(mode: str, base: str, adapter: str, out: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ndparallel.checkpoint.adapter_merge import merge_adapter_files

    before = vm_bytes("RssAnon:")  # the imports: not the merge's
    peak = AnonPeak()
    if mode == "ours":
        merge_adapter_files(adapter, out, base=base, max_shard_size=SHARD)
    else:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
        model.merge_and_unload().save_pretrained(out, max_shard_size=SHARD)
    print(json.dumps({"anon": peak.stop() - before, "hwm": vm_bytes("VmHWM:")}))


def _measure(mode: str, base: Path, adapter: Path, out: Path) -> dict:
    import os

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(base), str(adapter), str(out)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", type=int, default=4, help="decoder layers of the S model (2·S doubles them)"
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(*args.child)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for layers in (args.layers, 2 * args.layers):
            base, adapter, nbytes = _make(root, layers)
            for mode in ("ours", "peft"):
                got = _measure(mode, base, adapter, root / f"out-{mode}{layers}")
                results.append({"layers": layers, "model_bytes": nbytes, "merge": mode, **got})
                rows.append(
                    [
                        f"{layers} layers",
                        f"{nbytes / 2**20:.0f}",
                        mode,
                        f"{got['anon'] / 2**20:.0f}",
                        f"{got['hwm'] / 2**20:.0f}",
                        f"{got['anon'] / nbytes:.2f}",
                    ]
                )
    print_table(
        f"offline LoRA merge, host memory (MiB; output shards {SHARD})",
        ["base", "model", "merge", "private peak held by the merge", "VmHWM", "held / model"],
        rows,
    )
    by = {(r["layers"], r["merge"]): r["anon"] for r in results}
    small, large = args.layers, 2 * args.layers
    growth = {m: (by[(large, m)] - by[(small, m)]) / 2**20 for m in ("ours", "peft")}
    print(
        f"private peak growth from S to 2·S: ours {growth['ours']:+.0f} MiB, PEFT {growth['peft']:+.0f} MiB"
    )
    print(f"wrote {write_json('merge_memory', {'shard': SHARD, 'results': results, 'growth_mib': growth})}")


if __name__ == "__main__":
    main()

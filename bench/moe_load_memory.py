"""Host memory while loading a mixture-of-experts checkpoint as transformers writes it (one tensor per
expert on disk, fused ``experts.gate_up_proj`` / ``down_proj`` in the model): the sharded load builds
each rank's slice of a fused tensor from the experts in its rows only (``models/key_conversion.py``),
so the peak per rank should fall with the FSDP degree like a dense model's, not stay at one fused
tensor. Same measurement as ``bench/memory.py`` (b): per-rank VmHWM increase over the RSS after
imports, after the load and a read of every parameter, against ``from_pretrained`` on one process.

    python bench/moe_load_memory.py               # table + bench/results/moe_load_memory.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import transformers
from memory import MB, bench_loading  # bench/memory.py: the same loader measurement


def mixtral_config(hidden: int, layers: int, experts: int, intermediate: int):
    """A Mixtral whose experts are most of its bytes (small vocabulary)."""
    return transformers.MixtralConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_local_experts=experts,
        num_experts_per_tok=2,
        intermediate_size=intermediate,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        vocab_size=4096,
        max_position_embeddings=256,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--sizes", default="1,2,4", help="FSDP degrees")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe_load_memory.json"))
    args = ap.parse_args()
    config = mixtral_config(args.hidden, args.layers, args.experts, args.intermediate)
    model_bytes, rows = bench_loading(config, [int(s) for s in args.sizes.split(",")])
    print(
        f"host peak RSS increase per rank while loading a {model_bytes / MB:.0f} MB fp32 Mixtral "
        f"({args.experts} experts x {args.layers} layers, stored one tensor per expert; worst rank)"
    )
    print(f"{'layout':<28} {'peak MB':>8} {'x model':>8} {'local params MB':>16} {'load s':>7}")
    for r in rows:
        print(
            f"{r['layout']:<28} {r['peak_increase_max'] / MB:>8.1f} {r['ratio']:>8.3f} "
            f"{r['local_param_bytes'] / MB:>16.1f} {r['seconds']:>7.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(dict(model=config.to_dict(), model_bytes=model_bytes, rows=rows), indent=1, default=str)
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

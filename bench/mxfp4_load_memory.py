"""Host memory while loading a gpt-oss checkpoint whose experts are stored in MXFP4 (``*_blocks`` +
``*_scales``, as ``openai/gpt-oss-*`` are published) and dequantised on load
(``models/checkpoint_formats.py``): each rank reads and dequantises only its experts' rows, so the
peak per rank should fall with the FSDP degree, at about its fp32 parameters plus a transient of one
tensor's rows (packed + 2 × fp32). Same measurement as ``bench/memory.py`` (b): per-rank VmHWM
increase over the RSS after imports, after the load and a read of every parameter.

    python bench/mxfp4_load_memory.py            # table + bench/results/mxfp4_load_memory.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import transformers
from memory import MB, _load_rss  # bench/memory.py: the same loader measurement

from ndparallel.testing import run_on_ranks


def gpt_oss_config(hidden: int, layers: int, experts: int, intermediate: int):
    """A gpt-oss whose experts are most of its bytes (small vocabulary)."""
    return transformers.GptOssConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_local_experts=experts,
        num_experts_per_tok=2,
        intermediate_size=intermediate,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=4096,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2)
        + ["full_attention"] * (layers % 2),
    )


def _save_mxfp4(config, path: str) -> dict:
    """The model with every expert tensor replaced by random MXFP4 blocks + scales (the stored layout
    transformers dequantises: [experts, out, in / 32, 16] uint8 and [experts, out, in / 32])."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path + "/plain")  # the control: the same model stored unquantised
    model.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = state.pop(name).shape
        state[name + "_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8)
        state[name + "_scales"] = torch.randint(118, 124, (e, rows, cols // 32), dtype=torch.uint8)
    for f in Path(path).glob("*.safetensors"):
        f.unlink()
    save_file(state, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    biggest = max(p.numel() for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj"))
    return dict(
        model_bytes=fp32,
        file_bytes=(Path(path) / "model.safetensors").stat().st_size,
        biggest_expert_values=biggest,
    )


def _load(path: str, fsdp: int) -> dict:
    import transformers.integrations.mxfp4  # noqa: F401  (imports before the baseline)
    import transformers.models.gpt_oss.modeling_gpt_oss  # noqa: F401

    return _load_rss(path, "nd", fsdp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--sizes", default="1,2,4", help="FSDP degrees")
    ap.add_argument(
        "--block-values",
        type=int,
        default=None,
        help="values dequantised at once (default: the loader's, 2**24)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "mxfp4_load_memory.json"))
    args = ap.parse_args()
    config = gpt_oss_config(args.hidden, args.layers, args.experts, args.intermediate)
    import ndparallel.models.key_conversion as kc

    if args.block_values:  # set before the ranks fork
        kc._BLOCK_VALUES = args.block_values
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        info = run_on_ranks(_save_mxfp4, 1, config, tmp)[0]
        for n in [int(s) for s in args.sizes.split(",")]:
            per_rank = run_on_ranks(_load, n, tmp, n, timeout_s=600)
            plain = run_on_ranks(_load, n, tmp + "/plain", n, timeout_s=600)
            transient = min(
                info["biggest_expert_values"] / n,
                max(kc._BLOCK_VALUES, info["biggest_expert_values"] / args.experts),
            ) * (17 / 32 + 20)
            rows.append(
                dict(
                    ranks=n,
                    peak_increase_max=max(r["increase"] for r in per_rank),
                    plain_peak_increase_max=max(r["increase"] for r in plain),
                    local_param_bytes=per_rank[0]["local_param_bytes"],
                    transient_bound=transient,
                    seconds=max(r["seconds"] for r in per_rank),
                    plain_seconds=max(r["seconds"] for r in plain),
                )
            )
    print(
        f"host peak RSS increase per rank while loading a gpt-oss of {info['model_bytes'] / MB:.0f} MB in "
        f"fp32 "
        f"from a {info['file_bytes'] / MB:.0f} MB MXFP4 checkpoint ({args.experts} experts x {args.layers} "
        f"layers;"
        " worst rank)"
    )
    print(
        f"{'FSDP':>5} {'local params MB':>16} {'peak MB: plain':>15} {'MXFP4':>7} {'MXFP4 - plain':>14} "
        f"{'bound MB':>9} {'load s: plain':>14} {'MXFP4':>6}"
    )
    for r in rows:
        extra = r["peak_increase_max"] - r["plain_peak_increase_max"]
        print(
            f"{r['ranks']:>5} {r['local_param_bytes'] / MB:>16.1f} "
            f"{r['plain_peak_increase_max'] / MB:>15.1f} "
            f"{r['peak_increase_max'] / MB:>7.1f} {extra / MB:>14.1f} {r['transient_bound'] / MB:>9.1f} "
            f"{r['plain_seconds']:>14.2f} {r['seconds']:>6.2f}"
        )
    print(
        "bound: one block of this rank's rows of the biggest expert tensor (all its rows, or "
        "--block-values), "
        "packed + 20 bytes per value (transformers' dequantisation temporaries and the transposed copy)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=config.to_dict(), **info, rows=rows), indent=1, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

"""What QAT keeps for backward, per decoder layer, against the planner's model of it.

torchao's fake quantisers run in autograd. ndparallel runs each under an activation checkpoint
(``techniques/qat.py``: ``RecomputedQuantizer``), so a fake-quantised linear keeps the rounded weight
(and rounded input) that ``F.linear`` needs; ``--plain`` measures torchao's quantisers as they come
(they also keep their fp32 intermediates). Measured on one process (bf16, as FSDP2's gathered
weights compute): the bytes saved for backward by one more decoder layer (a 3-layer minus a 2-layer
Llama), with QAT minus without, for two layer shapes and two token counts, with trained linears and
with frozen ones (LoRA's base); fitted as ``a · (layer's linear weight elements) + b · tokens ·
(layer's linear input elements)`` per format. The planner's constants (``ndparallel.plan.memory.qat_memory``)
must be within 10 % of the fit (not checked with ``--plain``).

    python bench/qat_memory.py          # table + bench/results/qat_memory.json
    python bench/qat_memory.py --plain  # torchao's quantisers without the recompute
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from ndparallel.plan.memory.qat_memory import (  # noqa: E402
    QAT_FORMATS,
    qat_saved_bytes_per_input,
    qat_saved_bytes_per_weight,
)

SHAPES = [
    dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2),
    dict(hidden_size=384, intermediate_size=512, num_attention_heads=6, num_key_value_heads=6),
]
TOKENS = (64, 256)


def _saved_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters not counted)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set = set()

    def pack(t):
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except RuntimeError:  # a tensor subclass without a plain storage (MX's packed data)
            return t
        if key[0] not in params and key not in seen:
            seen.add(key)
        return t

    x = torch.randint(0, 512, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return sum(nbytes for _, nbytes in seen)


def _model(shape: dict, layers: int, fmt: str | None, frozen: bool = False, plain: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ndparallel.techniques.qat import apply_qat
    from ndparallel.techniques.technique_options import QATOptions

    torch.manual_seed(0)
    config = LlamaConfig(**shape, num_hidden_layers=layers, vocab_size=512, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    if fmt is not None:
        weight, _, act = fmt.partition("/")
        model = apply_qat(model, QATOptions(weight_dtype=weight, activation_dtype=act or None, group_size=32))
        if plain:  # torchao's quantisers as they come
            from ndparallel.techniques.qat import plain_quantizers

            plain_quantizers(model)
    if frozen:  # LoRA's frozen base: the decoder linears get no weight gradient
        for name, p in model.named_parameters():
            if ".layers." in name and name.endswith("proj.weight"):
                p.requires_grad_(False)
    return model


def layer_extra(shape: dict, tokens: int, fmt: str, frozen: bool, plain: bool = False) -> float:
    """Saved bytes of one more decoder layer with QAT ``fmt`` minus without."""

    def per_layer(f):
        return _saved_bytes(_model(shape, 3, f, frozen, plain), tokens) - _saved_bytes(
            _model(shape, 2, f, frozen, plain), tokens
        )

    return per_layer(fmt) - per_layer(None)


def layer_counts(shape: dict) -> tuple[int, int]:
    """(linear weight elements, linear input elements per token) of one Llama decoder layer."""
    h, f = shape["hidden_size"], shape["intermediate_size"]
    d = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    weights = h * (q + 2 * kv) + q * h + 3 * h * f
    inputs = 3 * h + q + 2 * h + f  # q, k, v and gate, up read h; o reads q; down reads f
    return weights, inputs


def fit(fmt: str, frozen: bool = False, plain: bool = False) -> dict:
    rows, targets = [], []
    for shape in SHAPES:
        weights, inputs = layer_counts(shape)
        for tokens in TOKENS:
            rows.append([weights, tokens * inputs])
            targets.append(layer_extra(shape, tokens, fmt, frozen, plain))
    (a, b), *_ = np.linalg.lstsq(np.array(rows, float), np.array(targets, float), rcond=None)
    worst = max(abs(r[0] * a + r[1] * b - t) / max(abs(t), 1.0) for r, t in zip(rows, targets))
    return {
        "format": fmt + (" + LoRA" if frozen else ""),
        "per_weight": float(a),
        "per_input": float(b),
        "fit_error": float(worst),
        "planner_per_weight": qat_saved_bytes_per_weight(fmt),
        "planner_per_input": qat_saved_bytes_per_input(fmt, frozen),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default=",".join(QAT_FORMATS))
    parser.add_argument("--plain", action="store_true", help="torchao's quantisers without the recompute")
    args = parser.parse_args(argv)
    results = [fit(f, frozen, args.plain) for frozen in (False, True) for f in args.formats.split(",")]
    print_table(
        "QAT: bytes saved for backward per decoder layer, beyond the same layer without QAT (bf16)",
        ["format", "per weight elem", "planner", "per input elem·token", "planner", "fit error"],
        [
            [
                r["format"],
                f"{r['per_weight']:.2f}",
                f"{r['planner_per_weight']:.2f}",
                f"{r['per_input']:.2f}",
                f"{r['planner_per_input']:.2f}",
                f"{r['fit_error']:.1%}",
            ]
            for r in results
        ],
    )
    ok = all(
        abs(r["per_weight"] - r["planner_per_weight"]) <= 0.1 * max(r["per_weight"], 1.0)
        and abs(r["per_input"] - r["planner_per_input"]) <= 0.1 * max(r["per_input"], 1.0)
        for r in results
    )
    if args.plain:
        print(
            "--plain: torchao's quantisers keep their intermediates; the planner models ndparallel's "
            "recompute"
        )
        print(f"wrote {write_json('qat_memory_plain', {'rows': results})}")
        return 0
    print(f"goal: the planner's constants within 10 % of the fit: {'met' if ok else 'NOT met'}")
    print(f"wrote {write_json('qat_memory', {'rows': results, 'goal_met': ok})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Checkpoint layouts the model's own transformers mapping does not cover, read on load:

* **MXFP4 experts** (gpt-oss: ``openai/gpt-oss-*`` are published only so): each expert weight
  is stored as ``<name>_blocks`` (uint8, two 4-bit E2M1 codes per byte, 32 values per block) and
  ``<name>_scales`` (one uint8 power-of-two exponent per block). They are dequantised on load with
  transformers' own converter for them (``Mxfp4HfQuantizer`` with ``dequantize=True``: its
  ``Mxfp4Dequantize`` op), to the dtype of the parameter they fill — exactly: every MXFP4 value
  is a bf16 (and fp32) number. Only this rank's experts (rows) are read and dequantised: a rank
  holds at most its rows of one tensor in the packed form (≈ 0.53 byte per value) plus twice in
  the load dtype (the dequantised and the transposed copy). Training an MXFP4 base as it is is not
  supported (transformers' MXFP4 modules are inference kernels): the model is trained in the run's
  dtype and saved in transformers' plain layout, as ``from_pretrained(...,
  quantization_config=Mxfp4Config(dequantize=True))`` does.
* **Axolotl's linearized Llama 4 experts** (e.g.
  ``axolotl-quants/Llama-4-Scout-17B-16E-Linearized-*``): each expert stored as three linears,
  ``experts.gate_projs.<e>.weight`` / ``up_projs`` [I, H] and ``down_projs`` [H, I]. They are
  fused into transformers' ``Llama4TextExperts`` parameters, ``gate_up_proj`` [E, H, 2I] =
  ``[gate_e.T | up_e.T]`` and ``down_proj`` [E, I, H] = ``down_e.T`` (what Axolotl's
  ``delinearize-llama4`` does), with transformers' conversion operations; the same forward as
  Axolotl's linearized module. Saved in transformers' layout.

Pre-quantised bitsandbytes checkpoints (``quantization_config.quant_method: bitsandbytes``) are
refused by name: ndparallel's QLoRA quantises a bf16 base itself (torchao NF4).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

MXFP4_SUFFIXES = ("_blocks", "_scales")


def _quant_method(config: Any) -> str | None:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return str(getattr(method, "value", method)).lower() if method is not None else None


def mxfp4_transforms() -> list:
    """transformers' converters from ``*_blocks`` + ``*_scales`` to the dequantised parameter."""
    from transformers import Mxfp4Config
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer

    quantizer = Mxfp4HfQuantizer(Mxfp4Config(dequantize=True), pre_quantized=True)
    return quantizer.get_weight_conversions()


def linearized_llama4_transforms() -> list:
    """Axolotl's per-expert linears -> ``Llama4TextExperts.gate_up_proj`` / ``down_proj``."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose, WeightConverter

    return [
        WeightConverter(
            [".experts.gate_projs.*.weight", ".experts.up_projs.*.weight"],
            ".experts.gate_up_proj",
            [MergeModulelist(dim=0), Concatenate(dim=1), Transpose(1, 2)],
        ),
        WeightConverter(
            [".experts.down_projs.*.weight"], ".experts.down_proj", [MergeModulelist(dim=0), Transpose(1, 2)]
        ),
    ]


def extra_transforms(model: nn.Module, stored: dict) -> list:
    """The converters ``stored`` (key -> header info) needs for ``model``: applied on load only (the
    model is saved in transformers' own layout, so they are not reverted on save)."""
    extra = []
    if any(k.endswith(MXFP4_SUFFIXES) for k in stored):
        extra += mxfp4_transforms()
    if any(".experts.gate_projs." in k for k in stored) and any(
        type(m).__name__ == "Llama4TextExperts" for m in model.modules()
    ):
        extra += linearized_llama4_transforms()
    return extra


def keeps_rows(op) -> bool:
    """The conversion op leaves dim 0 (the experts) alone: row ``e`` of its output comes from row
    ``e`` of its input(s) only."""
    from transformers.core_model_loading import Transpose
    from transformers.integrations.mxfp4 import Mxfp4Dequantize

    if isinstance(op, Mxfp4Dequantize):
        return True
    if isinstance(op, Transpose):
        return 0 not in (op.dim0, op.dim1)
    return getattr(op, "dim", None) not in (None, 0)


def prequantized_problem(config: Any, stored: dict) -> str | None:
    """Why a checkpoint stored in a quantised format ndparallel does not read cannot be loaded, or None."""
    method = _quant_method(config)
    bnb = method == "bitsandbytes" or any(
        k.endswith((".absmax", ".quant_map")) or ".quant_state." in k for k in stored
    )
    if bnb:
        return (
            "its weights are pre-quantised by bitsandbytes (quantization_config.quant_method: bitsandbytes): "
            "ndparallel does not read bitsandbytes' packed weights; give the bf16 checkpoint instead "
            "(adapter: qlora + load_in_4bit: true quantises it to NF4 on load)"
        )
    return None


def drop_dequantized_config(config: Any) -> None:
    """Remove an MXFP4 ``quantization_config`` (the model is built and saved unquantised), as
    transformers does after a dequantising load."""
    if _quant_method(config) == "mxfp4":
        del config.quantization_config

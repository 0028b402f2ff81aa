"""The optimizer names a training config accepts (``optimizer:``) and what each means here: a
torch optimizer, a torchao low-bit AdamW, Muon. Imports nothing heavy: a config is read and refused
before torch is imported."""

from __future__ import annotations

from typing import Literal

TORCHAO = {
    "adamw_torch_8bit": "AdamW8bit",
    "ao_adamw_8bit": "AdamW8bit",
    "adamw_8bit": "AdamW8bit",
    "adamw_bnb_8bit": "AdamW8bit",
    "paged_adamw_8bit": "AdamW8bit",
    "adamw_torch_4bit": "AdamW4bit",
    "ao_adamw_4bit": "AdamW4bit",
    "ao_adamw_fp8": "AdamWFp8",
}
"""Optimizer names (YAML ``optimizer:``) -> torchao.optim class."""

ALIASES = {"paged_adamw_32bit": "adamw"}
"""Names that mean a torch optimizer here."""

OPTIMIZER_NAMES = ("adamw", "adamw_torch", "adamw_torch_fused", "sgd", "muon", *TORCHAO, *ALIASES)
OptimizerName = Literal[OPTIMIZER_NAMES]  # type: ignore[valid-type]
"""Every ``optimizer:`` value ``ndparallel train`` accepts."""

NOTES = {
    "adamw_8bit": "bitsandbytes' block-wise 8-bit AdamW -> torchao AdamW8bit (the same algorithm: 256-value "
    "blocks, tensors >= 4096 values; torchao's kernels, so not bit-equal to bitsandbytes')",
    "paged_adamw_8bit": "-> torchao AdamW8bit; bitsandbytes' paging of optimizer states to host memory under "
    "GPU memory pressure is not done: the 8-bit states (~2 bytes/param) stay on the GPU "
    "(fsdp_config.cpu_offload keeps parameters, gradients and states in host memory)",
    "paged_adamw_32bit": "-> torch AdamW; bitsandbytes' paging of optimizer states to host memory is not "
    "done (fsdp_config.cpu_offload keeps them in host memory)",
    "ao_adamw_fp8": "torchao AdamWFp8 (float8 e4m3 states, 256-value blocks)",
}
NOTES["adamw_bnb_8bit"] = NOTES["adamw_8bit"]


def is_low_bit(name: str) -> bool:
    return name in TORCHAO


def optimizer_note(name: str) -> str | None:
    """One ``--dry-run`` line for an optimizer name that means something else here, else None."""
    if name == "muon":
        from ndparallel.optim.muon import NOTE

        return f"optimizer: muon: {NOTE}"
    return f"optimizer: {name}: {NOTES[name]}" if name in NOTES else None

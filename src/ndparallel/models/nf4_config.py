"""The settings of a 4-bit NF4 frozen base (QLoRA), apart from the code that quantises with them
(``quantized.py``): a training config reads them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

NF4_BYTES_PER_PARAM = 0.5 + 1 / 64
"""4-bit codes + one int8 scale per 64-value block (the per-16,384 fp scales are negligible)."""


@dataclass(frozen=True)
class NF4Config:
    """A 4-bit NF4 frozen base (QLoRA): ``acc.load_model(path, adapter=lora, quantization=NF4Config())``.

    ``block_size`` / ``scaler_block_size``: torchao's (and bitsandbytes') 64 and 256; smaller
    blocks only for tiny test models. ``skip_modules``: leaf module names kept in the load dtype
    besides the output head (bitsandbytes' ``llm_int8_skip_modules``)."""

    block_size: int = 64
    scaler_block_size: int = 256
    skip_modules: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("block_size", "scaler_block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 2 or v % 2:
                raise ValueError(f"NF4Config.{name} must be an even integer >= 2, got {v!r}")

    @property
    def group(self) -> int:
        """Values per scaler block: the unit a weight (and each of its shards) must be made of."""
        return self.block_size * self.scaler_block_size

"""Low-bit AdamW (8-bit, 4-bit, fp8 states) through torchao's optimizers, under Axolotl's /
transformers' optimizer names.

torchao's ``AdamW8bit`` stores both moments block-wise quantised (256 values per block, a dynamic
int8 code book and one fp32 scale per block: ~2 bytes per parameter for m and v instead of 8),
only for tensors of >= 4096 values (smaller ones keep fp32 states, as bitsandbytes does); it
updates each parameter with a ``torch.compile``d kernel that dequantises, applies AdamW in fp32
and re-quantises. Its states are DTensors with quantised local shards, so FSDP2 / TP / HSDP shard
them with their parameters (checked on CPU/gloo, ``tests/test_optim_lowbit.py``); they checkpoint
through DCP (codes and scales, resumable on another layout).

Names: transformers' ``adamw_torch_8bit`` / ``adamw_torch_4bit`` and Axolotl's ``ao_adamw_*`` are
torchao's already. bitsandbytes' ``adamw_8bit`` / ``adamw_bnb_8bit`` run the same algorithm
(block-wise 8-bit moments, the same block and size threshold) and are mapped to torchao's; its
``paged_*`` variants page optimizer states to host memory under GPU memory pressure (CUDA unified
memory), which has no torchao counterpart: they are mapped to the unpaged optimizer, saying so.
"""

from __future__ import annotations

import torch

from ndparallel.optim.names import TORCHAO
from ndparallel.runtime.extras import require

FP32_STATES = "fp32_states"
"""A parameter group key: its parameters keep fp32 states (the token embeddings, see ``embedding_groups``)."""


def build_low_bit(
    name: str, groups: list[dict], lr: float, betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    """The torchao optimizer ``name`` over the parameter ``groups`` (weight decay per group), deciding
    per parameter which states to quantise (``_PerParameterStates``)."""
    require("qlora", f"optimizer: {name}", ("torchao",))
    import torchao.optim as ao

    base = getattr(ao, TORCHAO[name])
    cls = type(base.__name__, (_PerParameterStates, base), {"__doc__": base.__doc__})
    return cls(groups, lr=lr, betas=betas, eps=eps)


def embedding_groups(groups: list[dict], embeddings: set[int]) -> list[dict]:
    """``groups`` with the parameters in ``embeddings`` (ids of ``nn.Embedding`` weights) moved to
    groups of their own that keep fp32 states: what transformers' Trainer does for bitsandbytes' 8-bit
    optimizers (``optim_bits: 32`` for every embedding). A row no token of the batch uses has a zero
    gradient; quantised, its second moment can round to 0 while the first does not, and the update
    m / (sqrt(v) + eps) explodes — rows of the table jumped by 0.6 in a 3-step test without this."""
    out = []
    for g in groups:
        keep = [p for p in g["params"] if id(p) not in embeddings]
        moved = [p for p in g["params"] if id(p) in embeddings]
        out += [{**g, "params": keep}] if keep else []
        out += [{**g, "params": moved, FP32_STATES: True}] if moved else []
    return out


class _PerParameterStates:
    """torchao's ``_AdamBase._new_buffer`` quantises a state when the *local shard* has >= 4096
    values (and whole blocks): under FSDP a shard can drop below that where the whole parameter does
    not, and the same model would get fp32 states on one layout and 8-bit ones on another. Here the
    decision looks at the whole parameter (>= 4096 values, as bitsandbytes) and at the shard (whole
    blocks only). With dim-0 shards of whole blocks the blocks are the same values on every layout,
    so the states are too (tested: FSDP 2 = one process). Parameters of a group marked
    ``FP32_STATES`` (the embeddings) keep fp32 states."""

    def step(self, closure=None):
        self._fp32_ids = {id(p) for g in self.param_groups if g.get(FP32_STATES) for p in g["params"]}
        # torchao compiles one update per parameter shape and state kind. AOTAutograd's on-disk cache
        # was seen to hand a graph compiled for quantised DTensor states to plain ones of the same
        # shape in a later process (AttributeError: 'Tensor' object has no attribute 'codes'): skip
        # that cache here (inductor's own cache of the compiled kernels still applies).
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return super().step(closure)

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = p.to_local() if isinstance(p, DTensor) else p
        quantise = id(p) not in getattr(self, "_fp32_ids", ())
        if quantise and p.numel() >= 4096 and local.numel() % self.block_size == 0 and local.numel() > 0:
            out = self._subclass_zeros(local, signed, self.block_size)
        else:
            out = torch.zeros_like(local)
        if isinstance(p, DTensor):
            out = DTensor.from_local(
                out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return out.to(p.device)

"""Let ``model.save_pretrained(dir)`` on a parallelised model write one consolidated HF checkpoint.

transformers' ``save_pretrained`` takes ``model.state_dict()`` — sharded DTensors here — and hands
it to ``gather_sharded_state_dict_for_save``, the method it provides for exactly this step
(``transformers.distributed.mixin.DistributedMixin``). Its own version only gathers models that
transformers sharded itself (it keys on ``config.distributed_config``, and its TP branch re-gathers
with transformers' TP plan); setting that config ourselves would tell the Trainer and the TP branch
that transformers sharded the model, which is false. No other hook exists on this path (a
``state_dict`` hook would also change what DCP checkpoints see), so ``prepare`` sets this one method
(and the barrier after writing) on the prepared *instance*: no transformers class is modified.

The gather runs only when the state dict holds DTensors, i.e. when every rank calls
``save_pretrained`` without ``state_dict=`` (collective); a full state dict passed by the caller
(``accelerator.get_state_dict(model)``: tensors on rank 0, ``{}`` elsewhere) is written as is.
"""

from __future__ import annotations

import types

import torch.distributed as dist
import torch.nn as nn

from ndparallel.models.quantized import dequantize, is_nf4


def full_state_dict(model: nn.Module) -> dict:
    """The whole model's state dict as plain CPU tensors on rank 0 (``{}`` on other ranks).
    Collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    main = (dist.get_rank() if dist.is_initialized() else 0) == 0
    full = {}
    for name, value in get_model_state_dict(model).items():  # sharded: gathered one at a time
        # a QLoRA base's NF4 shards: dequantised, then gathered (``dequantize`` says why)
        value = (
            dequantize(value)
            if is_nf4(value)
            else value.full_tensor()
            if isinstance(value, DTensor)
            else value
        )
        if main:
            full[name] = value.detach().cpu()
        del value
    return full


def _has_dtensor(state: dict) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(v, DTensor) for v in state.values())


def _gather_for_save(self, model_to_save, state_dict, distributed_config, *, save_on_this_rank=True):
    if not _has_dtensor(state_dict):
        return state_dict
    self._ndparallel_gathered = True
    return full_state_dict(model_to_save)


def _barrier_after_save(self, distributed_config) -> None:
    if self.__dict__.pop("_ndparallel_gathered", False) and dist.is_initialized():
        dist.barrier()


def enable_consolidated_save_pretrained(model: nn.Module) -> nn.Module:
    """Make ``model.save_pretrained`` gather the shards (see the module docstring). Models without
    transformers' save path (no ``gather_sharded_state_dict_for_save``) are left unchanged."""
    if hasattr(type(model), "gather_sharded_state_dict_for_save"):
        model.gather_sharded_state_dict_for_save = types.MethodType(_gather_for_save, model)
        model.barrier_after_gathered_checkpoint_save = types.MethodType(_barrier_after_save, model)
    return model

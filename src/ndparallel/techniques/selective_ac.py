"""Selective activation checkpointing: recompute the norms and the MLP's activation, keep the rest
(Megatron's selective scheme, Korthikanti et al. 2022 §5, for a Llama-shaped decoder layer).

``fsdp_config.ac_policy: selective`` (``ActivationOptions(ac_policy="selective")``, with
``activation_checkpointing``) checkpoints, with ``torch.utils.checkpoint`` (non-reentrant), only
the cheap elementwise parts of each decoder layer whose saved tensors are large:

* every **RMSNorm** (``input_layernorm``, ``post_attention_layernorm``, Qwen3's ``q_norm`` /
  ``k_norm``): it upcasts to fp32 and keeps fp32 copies of its input (``(4+e)·h`` bytes per
  token); checkpointed it keeps its input only (``e·h``) and is recomputed in backward;
* the **MLP's activation**: ``down_proj(act_fn(gate) * up)`` runs checkpointed, keeping ``gate``
  and ``up`` instead of ``gate``, ``act_fn(gate)``, ``up`` and their product. A selective
  checkpoint policy (``create_selective_checkpoint_contexts``) keeps the output of the
  collective of ``down_proj`` under TP (``e·h/t_sp``), so the recompute in backward moves no data;
  ``down_proj``'s matmul is recomputed once (its input is the product).

Attention is not recomputed: a fused kernel (SDPA's flash / efficient paths, the CP attention)
never keeps the ``s²`` softmax — it recomputes it in its own backward, which is Megatron's
selective attention recompute done by the kernel — and keeps q, k, v, its output and the
log-sum-exp. Under TP + sequence parallel (``parallel/tp/sp_saves.py``) a layer then keeps about
``(4·e·h + e·(a+2k)·d + e·a·d + 2·e·f + e·h)/t`` bytes per token, below Megatron's ``34·h/t``
(``bench/sp_activation_memory.py``; ``plan/memory/activations.py::selective_saved_per_token``).

With ``activation_offloading`` everything a layer keeps lives in host memory between its forward
and its backward, except the collective's output the policy keeps (``techniques/offload.py``).

Refused (one line naming the fix) where it cannot apply: without ``activation_checkpointing``,
with ``tiled_mlp`` (the tiled MLP already recomputes the MLP), under ``compile``, and for a layer
whose ``mlp`` is not a gated MLP (mixture of experts). Recomputation repeats the same arithmetic:
the result is that of the plain layer (``tests/test_equivalence_techniques.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ndparallel.models.layers import outer_decoder_layers

_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _collectives() -> set:
    ops = torch.ops._c10d_functional
    return {ops.reduce_scatter_tensor.default, ops.all_reduce.default, ops.all_gather_into_tensor.default}


def _keep_collectives(ctx, op, *args, **kwargs):
    """The policy of the MLP region: a collective's output is kept (no data moves in the
    recompute), everything else recomputed."""
    return CheckpointPolicy.MUST_SAVE if op in _collectives() else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts():
    return create_selective_checkpoint_contexts(_keep_collectives)


class RecomputedNormMixin:
    """Mixed into a norm instance's class: its forward runs checkpointed (input kept only)."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


def _mlp_tail(mlp: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_fn(gate) * up)


class RecomputedActivationMixin:
    """Mixed into a gated MLP instance's class: ``down_proj(act_fn(gate) * up)`` checkpointed."""

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not torch.is_grad_enabled():
            return _mlp_tail(self, gate, up)
        return checkpoint(_mlp_tail, self, gate, up, use_reentrant=False, context_fn=_contexts)


@functools.cache
def _subclass(mixin: type, cls: type) -> type:
    return type(f"{mixin.__name__.removesuffix('Mixin')}{cls.__name__}", (mixin, cls), {})


def _mixin(module: nn.Module, mixin: type) -> None:
    if not isinstance(module, mixin):
        module.__class__ = _subclass(mixin, type(module))


def is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm")) or isinstance(module, nn.LayerNorm)


def selective_problem(model: nn.Module, override=None) -> str | None:
    """Why ``ac_policy: selective`` cannot apply to ``model`` (None when it can)."""
    for layer in outer_decoder_layers(model, override):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module) or not all(hasattr(mlp, n) for n in _MLP_PARTS):
            return (
                f"fsdp_config.ac_policy: selective recomputes a gated MLP (gate_proj, up_proj, "
                f"down_proj, act_fn); {type(layer).__name__}.mlp is "
                f"{type(mlp).__name__ if mlp is not None else 'missing'} (mixture of experts?): use "
                "ac_policy: full"
            )
    return None


def apply_selective_checkpointing(model: nn.Module, override=None) -> list[nn.Module]:
    """Checkpoint the norms and the MLP activation of every decoder layer (in place, idempotent);
    returns the modules changed. ValueError when a layer has no gated MLP."""
    problem = selective_problem(model, override)
    if problem:
        raise ValueError(problem)
    changed = []
    for layer in outer_decoder_layers(model, override):
        for module in layer.modules():
            if is_norm(module):
                _mixin(module, RecomputedNormMixin)
                changed.append(module)
        _mixin(layer.mlp, RecomputedActivationMixin)
        changed.append(layer.mlp)
    return changed


def is_selective(activation) -> bool:
    """Whether ``activation`` (``ActivationOptions``, or the YAML's ``fsdp_config``) checkpoints
    selectively."""
    return activation.ac_policy == "selective"


def selective_policy_problem(activation, compiled: bool = False) -> str | None:
    """What ``ac_policy: selective`` cannot be combined with, from ``ActivationOptions``
    ``activation`` and whether the layers are compiled (None: nothing here)."""
    if activation.ac_policy == "full":
        return None
    if activation.ac_policy != "selective":
        return f"fsdp_config.ac_policy: {activation.ac_policy!r} is not a policy: use full or selective"
    if not activation.activation_checkpointing:
        return (
            "fsdp_config.ac_policy: selective needs activation_checkpointing: true (or use ac_policy: full)"
        )
    if activation.tiled_mlp:
        return (
            "tiled_mlp already recomputes the MLP, which ac_policy: selective checkpoints: use one of "
            "them (ac_policy: full with tiled_mlp)"
        )
    if compiled:
        return (
            "fsdp_config.ac_policy: selective is not supported with compile (its checkpointed norms and MLP "
            "activation are untested under dynamo): use ac_policy: full, or turn compile off"
        )
    return None


def apply_activation_checkpointing(model: nn.Module, activation, override=None) -> None:
    """``ActivationOptions``' checkpointing of every decoder layer: 'full' is transformers' own
    per-layer checkpointing (``GradientCheckpointingLayer``; the non-reentrant variant composes
    with FSDP2's hooks and DTensor), 'selective' the norms and MLP activation only; ``override``:
    the decoder-layer class names, as ``models/layers.py`` takes them."""
    problem = selective_policy_problem(activation)
    if problem:
        raise ValueError(problem)
    if not activation.activation_checkpointing:
        return
    if activation.ac_policy == "selective":
        apply_selective_checkpointing(model, override)
    else:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.25's name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

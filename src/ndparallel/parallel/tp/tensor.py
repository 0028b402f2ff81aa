"""Tensor parallelism (+ sequence parallel, loss parallel) on a 1-D ``tp`` mesh.

``apply_tensor_parallel`` turns the model's plan (see ``ndparallel.models.tp_plans``) into DTensor
styles and applies them with ``parallelize_module``:

* attention / MLP: q,k,v,gate,up column-wise, o,down row-wise (one all-reduce per pair; under
  sequence parallel an all-gather before and a reduce-scatter after each block instead);
* embedding and ``lm_head`` sharded on the vocabulary (``Shard(0)`` of both weights), so tied
  embeddings stay one Parameter; under loss parallel the logits stay a ``Shard(-1)`` DTensor;
* every other parameter (norms) becomes a ``Replicate`` DTensor whose module takes DTensor inputs,
  so optimizers and grad clipping see DTensors only, all on the tp mesh.

Mixture-of-experts blocks are not tensor-parallel: the experts are split off by
``parallel/ep/expert.py`` (each tp rank runs all experts of its ``ep`` rank on its own tokens), the
rest of the block (router, shared experts) is replicated over tp and reads the block input as it
comes — the whole sequence, or under sequence parallel the rank's own sequence shard.

Sequence parallel shards the residual stream on dim 1: the sequence length must be divisible by
tp_size, ``position_ids`` are filled in when missing (HF would derive them from the local length;
``positions.position_hook``), a 2-D attention mask may only be all ones (padding masks raise: pack
with position_ids), and attention is ndparallel's document attention (transformers would build
its masks from the local length: packed rows crashed its sdpa), which derives the causal and
document masks from the positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
)
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    loss_parallel,
    parallelize_module,
)

from ndparallel.models.adapters import is_lora_layer
from ndparallel.models.moe import moe_prefixes
from ndparallel.models.naming import tied_parameter_groups
from ndparallel.models.tp_plans import (
    TPPlanError,
    match_plan,
    model_tp_plan,
    resolve_tp_plan,
)
from ndparallel.parallel.document_attention import apply_document_attention
from ndparallel.parallel.options import TPOptions
from ndparallel.parallel.positions import position_hook
from ndparallel.parallel.tp.lora import LoraParallel
from ndparallel.parallel.tp.sp_saves import sequence_parallel_block_input
from ndparallel.parallel.tp.styles import (
    MlaKvAProjParallel,
    ReplicateBlockInput,
    ReplicateParallel,
    align_grad_placements,
    parallel_style,
)
from ndparallel.parallel.tp.validate import validate_tensor_parallel  # noqa: F401  (public here)

_TP_MESH_ATTR = "_ndparallel_tp_mesh"


# --------------------------------------------------------------------------------------- apply
def _layer_position(name: str) -> tuple[bool, str | None]:
    """(on the residual stream?, enclosing block) for a module name: a module inside a numbered
    layer's child (``model.layers.0.self_attn.q_proj``) is in block ``model.layers.0.self_attn``."""
    parts = name.split(".")
    idx = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if idx is None or len(parts) <= idx + 2:
        return True, None
    return False, ".".join(parts[: idx + 2])


def _output_embedding_name(model: nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def _leftovers_of_transformers_tp(
    model: nn.Module, tp_mesh: DeviceMesh, options: TPOptions, adapted: bool
) -> nn.Module:
    """A model transformers made tensor-parallel (``tp_plan``): its leftover plain parameters
    replicated; LoRA, sequence parallelism and loss parallelism refused there."""
    if adapted:
        # transformers' TP hooks know nothing of LoRA A/B: its forward would add a full-size
        # adapter output to a sharded base output (a different model, found by a test).
        raise ValueError(
            "LoRA on a model made tensor-parallel by transformers (tp_plan) is not supported: "
            "load the model without tp_plan; prepare applies TP and shards each adapter "
            "with its base linear"
        )
    if options.sequence_parallel or options.loss_parallel:
        raise ValueError(
            "the model is already tensor-parallel (loaded by transformers with tp_plan/device_mesh); "
            "sequence_parallel and loss_parallel need ndparallel's own TP: load the model "
            "without tp_plan/device_mesh, or turn those options off"
        )
    return distribute_leftover_params(model, tp_mesh)


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    options: TPOptions | None = None,
    adapted: bool = False,
) -> nn.Module:
    """Shard ``model`` over the 1-D ``tp_mesh`` in place (and return it).

    Every parameter ends up a DTensor on ``tp_mesh``; tied parameters stay one Parameter.
    ``loss_parallel=None`` counts as off here (``resolve_loss_parallel`` picks the default). A model
    already made tensor-parallel (by transformers' ``from_pretrained(tp_plan=..., device_mesh=...)``)
    is not sharded again: only its leftover plain parameters are replicated. ``adapted``: the model
    carries LoRA layers (PEFT), which transformers' own TP would compute wrongly: refused there.
    """
    options = options or TPOptions()
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D tp mesh (mesh['tp']), got {tp_mesh}")
    tp_size = tp_mesh.size()
    if is_tensor_parallel(model):
        return _leftovers_of_transformers_tp(model, tp_mesh, options, adapted)
    validate_tensor_parallel(model.config, tp_size, options)
    assigned = match_plan(model, resolve_tp_plan(model, options.plan), strict=bool(options.plan))
    experts, moe_blocks = moe_prefixes(model)
    assigned = {
        n: st
        for n, st in assigned.items()
        if not n.startswith(moe_blocks) and any(True for _ in model.get_submodule(n).parameters())
    }  # a pipeline stage's stand-ins
    if getattr(model.config, "qk_rope_head_dim", None):  # MLA: transformers < 5.25's plans lack the style
        for name, _ in model.named_modules():
            if (
                name.endswith("kv_a_proj_with_mqa")
                and name not in assigned
                and not name.startswith(moe_blocks)
            ):
                assigned[name] = "mla_kv_a_proj"
    head = _output_embedding_name(model)
    head_colwise = head in assigned and str(assigned[head]).startswith("colwise")
    if options.loss_parallel and not head_colwise:
        raise ValueError(
            f"loss_parallel needs the output embedding ({head}) sharded column-wise in the tp plan "
            f"(e.g. {head!r}: 'colwise_gather_output'); it has {assigned.get(head)!r}"
        )
    sp = options.sequence_parallel
    styles: dict[str, ParallelStyle] = {}
    blocks: set[str] = set()
    for name, style in assigned.items():
        on_residual, block = _layer_position(name)
        if block:
            blocks.add(block)
        if style == "mla_kv_a_proj":  # needs the rotary width: from the config
            styles[name] = MlaKvAProjParallel(model.config.qk_rope_head_dim)
        else:
            styles[name] = parallel_style(
                style,
                on_residual=on_residual,
                sequence_parallel=sp,
                output_sharded=options.loss_parallel and name == head,
            )
        if is_lora_layer(model.get_submodule(name)):  # PEFT wrapped it: shard A/B with the base
            styles[name] = LoraParallel(styles[name], name)
    _replicate_the_rest(model, styles, blocks, sp, experts, moe_blocks)
    for block in blocks:
        styles[block] = (
            sequence_parallel_block_input(options.sequence_parallel_saved_shards)
            if sp
            else ReplicateBlockInput()
        )
    if sp:
        _sequence_parallel_inputs(model, tp_size)
    tied = tied_parameter_groups(model)
    for name, style in styles.items():
        parallelize_module(model.get_submodule(name), tp_mesh, style)
    _retie(model, tied)
    if options.loss_parallel and hasattr(type(model), "loss_function"):
        model.loss_function = _in_loss_parallel(model.loss_function)  # transformers' setter
    setattr(model, _TP_MESH_ATTR, tp_mesh)
    _check_all_dtensor(model, skip=experts)
    align_grad_placements(model)
    return model


def _replicate_the_rest(
    model: nn.Module,
    styles: dict[str, ParallelStyle],
    blocks: set[str],
    sp: bool,
    experts: tuple[str, ...],
    moe_blocks: tuple[str, ...],
) -> None:
    """Give every other module owning parameters a ``ReplicateParallel`` style (in ``styles``):
    norms read the residual stream (sequence-sharded under SP) or a block's input; modules of an
    MoE block (router, shared experts) read the block's rows (this rank's own under SP); the
    experts themselves are left to ``parallel/ep/expert.py`` and FSDP."""
    wrapped = tuple(f"{n}." for n, s in styles.items() if isinstance(s, LoraParallel))
    moe_input = Shard(0) if sp else Replicate()
    for name, module in model.named_modules():
        if name in styles or not any(True for _ in module.parameters(recurse=False)):
            continue
        if name.startswith(wrapped):  # base_layer / lora_A / lora_B: sharded by LoraParallel
            continue
        if f"{name}.".startswith(experts):  # split off by parallel/ep/expert.py, sharded by FSDP
            continue
        if name.startswith(moe_blocks):
            styles[name] = ReplicateParallel(moe_input, buffers=True)
            continue
        if any(n.startswith(name + ".") for n in styles) or (sp and name in blocks):
            raise TPPlanError(
                f"module {name!r} owns parameters and contains tensor-parallel submodules; give it "
                "a style in the tp plan"
            )
        on_residual, _ = _layer_position(name)
        styles[name] = ReplicateParallel(Shard(1) if sp and on_residual else Replicate())


def _sequence_parallel_inputs(model: nn.Module, tp_size: int) -> None:
    """Positions and attention for a sequence-sharded residual stream: ``position_ids`` filled in
    from the full length (``positions.position_hook``), and ndparallel's document attention —
    transformers builds its masks from the local length, which breaks on packed rows; the
    document attention derives them from the positions."""

    model.register_forward_pre_hook(position_hook(sp_size=tp_size), with_kwargs=True)
    apply_document_attention(model)


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Point every location of a tied group at one DTensor Parameter (the first location's)."""
    for group in groups:
        mod0, p0 = group[0]
        first = getattr(model.get_submodule(mod0), p0)
        for mod_name, p_name in group[1:]:
            other = getattr(model.get_submodule(mod_name), p_name)
            if other is first:
                continue
            if isinstance(first, DTensor) != isinstance(other, DTensor) or (
                isinstance(first, DTensor) and first.placements != other.placements
            ):
                raise TPPlanError(
                    f"tied parameters {mod0}.{p0} and {mod_name}.{p_name} get different tp "
                    f"shardings ({getattr(first, 'placements', 'plain')} vs "
                    f"{getattr(other, 'placements', 'plain')}): shard both on the vocabulary "
                    "('embedding_rowwise' + 'colwise'/'colwise_gather_output') or replicate both"
                )
            model.get_submodule(mod_name).register_parameter(p_name, first)


def _check_all_dtensor(model: nn.Module, skip: tuple[str, ...] = ()) -> None:
    plain = [
        n
        for n, p in model.named_parameters()
        if not isinstance(p, DTensor) and not (skip and n.startswith(skip))
    ]
    if plain:
        raise RuntimeError(f"tensor parallel left plain (non-DTensor) parameters: {plain[:5]}")


# -------------------------------------------------------------------- transformers' own TP path
def is_tensor_parallel(model: nn.Module) -> bool:
    """True if the model is already tensor-parallel: by ``apply_tensor_parallel`` or by
    transformers (``from_pretrained(..., tp_plan="auto", device_mesh=...)``)."""
    if getattr(model, _TP_MESH_ATTR, None) is not None:
        return True
    if (getattr(model, "_tp_size", None) or 1) > 1:
        return True
    for p in model.parameters():
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            if "tp" in names:
                i = names.index("tp")
                if p.device_mesh.size(i) > 1 and not p.placements[i].is_replicate():
                    return True
    return False


def distribute_leftover_params(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Make every plain parameter of a TP model a ``Replicate`` DTensor on the tp mesh, with its
    module taking DTensor inputs, so no optimizer / clipping sees a Tensor-DTensor mix.

    For a model made TP by transformers: norms get ``Replicate`` inputs; modules its plan marks
    ``replicated_with_grad_allreduce`` (Qwen3 q_norm/k_norm) get head-sharded inputs instead, and
    transformers' forward wrapper on them (a gradient all-reduce hook that cannot take DTensors)
    is removed, DTensor autograd doing that all-reduce."""
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), tp_mesh)
    if mesh.ndim != 1 or mesh.size() != tp_mesh.size():
        raise ValueError(
            f"the model is tensor-parallel over {mesh.size()} ranks ({mesh}) but the layout's tp mesh has "
            f"{tp_mesh.size()}: transformers 5 ignores device_mesh when given tp_plan and shards over the "
            "whole world (given tp_size too, it refuses: 'The parallel mesh requires N processes'). Load "
            "the model without tp_plan/tp_size (prepare then shards it with TP), or use tp_size = world size"
        )
    grad_allreduce = {
        n
        for n, s in match_plan(model, model_tp_plan(model), strict=False).items()
        if s == "replicated_with_grad_allreduce"
    }
    for name, module in model.named_modules():
        if not any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            continue
        if name in grad_allreduce:
            _drop_transformers_grad_allreduce(module)
            style = ReplicateParallel(Shard(-2))
        else:
            style = ReplicateParallel(Replicate())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallelize_module(module, mesh, style)
    _check_all_dtensor(model)
    align_grad_placements(model)
    return model


def _drop_transformers_grad_allreduce(module: nn.Module) -> None:
    """Remove transformers' gradient all-reduce of a ``replicated_with_grad_allreduce`` module: a
    per-instance forward wrapper (transformers < 5.25) or a forward pre-hook that hooks the
    parameters' accumulated gradients (5.25); both call ``dist.all_reduce`` on a gradient, which
    a DTensor gradient cannot take. DTensor autograd does that reduction here."""
    module.__dict__.pop("forward", None)
    for key, hook in list(module._forward_pre_hooks.items()):
        if getattr(hook, "__module__", "").startswith("transformers.") and "tp_forward_pre_hook" in getattr(
            hook, "__qualname__", ""
        ):
            del module._forward_pre_hooks[key]


def _in_loss_parallel(loss_fn):
    """The model's own loss (``model(..., labels=...).loss``) on vocab-sharded logits: run inside
    ``loss_parallel()`` (its backward too, through ``Accelerator.backward``); a plain scalar out."""

    def loss_function(*args, **kwargs):
        with loss_parallel():
            loss = loss_fn(*args, **kwargs)
        # a clone: full_tensor() returns a view made by a custom Function, which a caller's
        # in-place op (e.g. dist.all_reduce(loss) to log it) may not modify
        return loss.full_tensor().clone() if isinstance(loss, DTensor) else loss

    return loss_function


def resolve_loss_parallel(model: nn.Module, options: TPOptions) -> TPOptions:
    """``options`` with ``loss_parallel=None`` resolved: on when the plan shards the LM head
    column-wise (ndparallel's own TP only; a model made TP by transformers keeps it off)."""
    if options.loss_parallel is not None:
        return options
    on = False
    if not is_tensor_parallel(model):
        head = _output_embedding_name(model)
        style = match_plan(model, resolve_tp_plan(model, options.plan), strict=False).get(head)
        on = str(style).startswith("colwise") and any(True for _ in model.get_submodule(head).parameters())
    return dataclasses.replace(options, loss_parallel=on)


def loss_parallel_context(options: TPOptions | None) -> contextlib.AbstractContextManager:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``options.loss_parallel``, else a
    no-op: wrap the cross-entropy (forward and backward) on ``Shard(-1)`` logits in it."""
    if options is not None and options.loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()

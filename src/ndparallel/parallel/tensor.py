"""Tensor parallelism (+ sequence parallel, loss parallel) on a 1-D ``tp`` mesh.

``apply_tensor_parallel`` turns the model's plan (see ``ndparallel.models.tp_plans``) into DTensor
styles and applies them with ``parallelize_module``:

* attention / MLP: q,k,v,gate,up column-wise, o,down row-wise (one all-reduce per pair; under
  sequence parallel an all-gather before and a reduce-scatter after each block instead);
* embedding and ``lm_head`` sharded on the vocabulary (``Shard(0)`` of both weights), so tied
  embeddings stay one Parameter; under loss parallel the logits stay a ``Shard(-1)`` DTensor;
* every other parameter (norms) becomes a ``Replicate`` DTensor whose module takes DTensor inputs,
  so optimizers and grad clipping see DTensors only, all on the tp mesh.

Sequence parallel shards the residual stream on dim 1: the sequence length must be divisible by
tp_size, ``position_ids`` are filled in when missing (HF would derive them from the local length),
and a 2-D attention mask may only be all ones (padding masks raise: pack with position_ids).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from ndparallel.models.naming import tied_parameter_groups
from ndparallel.models.tp_plans import (
    STYLES,
    TPPlanError,
    match_plan,
    model_tp_plan,
    resolve_tp_plan,
)
from ndparallel.parallel.options import TPOptions
from ndparallel.parallel.tp_validate import validate_tensor_parallel  # noqa: F401  (public here)

_TP_MESH_ATTR = "_ndparallel_tp_mesh"


# ------------------------------------------------------------------------------ custom styles
def _replicate(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    if param.is_meta:
        data = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
    else:  # broadcast from rank 0: replicas are identical even if initialised differently
        data = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=0)
    return nn.Parameter(data, requires_grad=param.requires_grad)


def _grad_to_param_placements(param: nn.Parameter) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _align_grad_placements(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements as soon as it is accumulated.

    DTensor autograd leaves a replicated norm weight applied to sharded activations with a
    ``Partial`` gradient (summed here: one small all-reduce) and the vocab-sharded embedding with a
    full ``Replicate`` one (sliced here: no communication, less memory). Clipping, DDP and
    checkpoints then see gradients laid out like their parameters.

    Needed for TP without FSDP (else the vocab-sharded embedding's gradient is the full matrix on
    every tp rank; ``tests/test_tensor_parallel.py`` checks). Under FSDP2 they do not fire.
    """
    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad and not getattr(p, "_ndp_grad_aligned", False):
            p.register_post_accumulate_grad_hook(_grad_to_param_placements)
            p._ndp_grad_aligned = True


class ReplicateParallel(ParallelStyle):
    """Parameters → ``Replicate`` DTensors; plain tensor inputs → DTensors with ``input_layout``
    (``Replicate()`` for a replicated activation, ``Shard(1)`` for a sequence-parallel one,
    ``Shard(-2)`` for head-sharded q/k of a per-head norm); DTensor outputs back to local tensors.

    DTensor autograd then sums the parameter gradients over tp exactly when the input is sharded.
    """

    def __init__(self, input_layout: Placement = Replicate()):
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                module.register_parameter(name, _replicate(param, device_mesh))
        layout = self.input_layout

        def to_dtensor(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.is_floating_point():
                return DTensor.from_local(x, device_mesh, [layout], run_check=False)
            return x

        def pre_hook(_mod, args, kwargs):
            return tuple(to_dtensor(a) for a in args), {k: to_dtensor(v) for k, v in kwargs.items()}

        def post_hook(_mod, _args, output):
            if isinstance(output, DTensor):
                return output.to_local()
            if isinstance(output, tuple):
                return tuple(o.to_local() if isinstance(o, DTensor) else o for o in output)
            return output

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook)
        return module


class _BlockInput(ParallelStyle):
    """Turn a block's input (first positional argument, or the ``hidden_states`` keyword HF
    attention uses) into one ``Replicate`` DTensor that all its column-wise linears share."""

    def _to_replicate(self, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(_mod, args, kwargs):
            if args and isinstance(args[0], torch.Tensor):
                return (self._to_replicate(args[0], device_mesh), *args[1:]), kwargs
            if isinstance(kwargs.get("hidden_states"), torch.Tensor):
                return args, {**kwargs, "hidden_states": self._to_replicate(kwargs["hidden_states"], device_mesh)}
            raise ValueError(
                f"tensor parallel: {type(_mod).__name__} got no tensor input "
                "(expected a positional tensor or hidden_states=...)"
            )

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module


class ReplicateBlockInput(_BlockInput):
    """Without sequence parallel: q, k, v (or gate, up) read one shared ``Replicate`` DTensor, so
    their partial input gradients are summed first and all-reduced once per block (Megatron's "f"),
    instead of once per column-wise linear."""

    def _to_replicate(self, x, mesh):
        return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)


class GatherSequenceInput(_BlockInput):
    """Sequence parallel: all-gather a block's sequence-sharded input into a ``Replicate`` DTensor;
    its backward is the reduce-scatter of the summed partial input gradients."""

    def _to_replicate(self, x, mesh):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return x.redistribute(mesh, [Replicate()])


def parallel_style(
    style: object, *, on_residual: bool, sequence_parallel: bool, output_sharded: bool = False
) -> ParallelStyle:
    """DTensor style for a HF style name (``ParallelStyle`` objects pass through unchanged).

    ``on_residual``: the module reads/writes the residual stream (embedding, lm_head, a layer's
    direct children), which sequence parallel shards on dim 1. ``output_sharded``: keep a colwise
    output as a ``Shard(-1)`` DTensor (loss parallel on lm_head).
    """
    if isinstance(style, ParallelStyle):
        return style
    seq = sequence_parallel and on_residual
    resid = Shard(1) if seq else Replicate()
    if style == "colwise" and not output_sharded:
        return ColwiseParallel(input_layouts=resid)
    if style in ("colwise", "colwise_gather_output", "colwise_rep"):
        if output_sharded:
            return ColwiseParallel(input_layouts=resid, output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(input_layouts=resid, output_layouts=Replicate())
    block_out = Shard(1) if sequence_parallel else Replicate()  # a row-wise layer ends a block
    if style == "rowwise":
        return RowwiseParallel(output_layouts=block_out)
    if style in ("rowwise_split_input", "rowwise_rep"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=block_out)
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=resid)
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=resid)
    if style == "replicated_with_grad_allreduce":
        return ReplicateParallel(Shard(-2))
    if style in ("replicate", "sequence_parallel"):
        return ReplicateParallel(resid)
    raise TPPlanError(
        f"tp style {style!r} is not supported by ndparallel; supported: {', '.join(STYLES)} "
        "(or a torch ParallelStyle object in TPOptions.plan)"
    )


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


def _sp_position_hook(tp_size: int):
    def hook(_mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            return args, kwargs
        seq = ids.shape[1]
        if seq % tp_size:
            raise ValueError(
                f"sequence parallel: sequence length {seq} is not divisible by tp_size={tp_size}; "
                f"pad the batch to a multiple of {tp_size} (or disable sequence_parallel)"
            )
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            if not bool(mask.all()):
                raise ValueError(
                    "sequence parallel does not support padding attention masks (HF builds the mask "
                    "from the local sequence length): pack sequences with position_ids instead, or "
                    "disable sequence_parallel"
                )
            kwargs = {**kwargs, "attention_mask": None}  # all ones: plain causal attention
        if kwargs.get("position_ids") is None:
            pos = torch.arange(seq, device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
            kwargs = {**kwargs, "position_ids": pos}
        return args, kwargs

    return hook


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, options: TPOptions | None = None
) -> nn.Module:
    """Shard ``model`` over the 1-D ``tp_mesh`` in place (and return it).

    Every parameter ends up a DTensor on ``tp_mesh``; tied parameters stay one Parameter.
    ``loss_parallel=None`` counts as off here (``resolve_loss_parallel`` picks the default). A model
    already made tensor-parallel (by transformers' ``from_pretrained(tp_plan=..., device_mesh=...)``)
    is not sharded again: only its leftover plain parameters are replicated.
    """
    options = options or TPOptions()
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D tp mesh (mesh['tp']), got {tp_mesh}")
    tp_size = tp_mesh.size()
    if is_tensor_parallel(model):
        if options.sequence_parallel or options.loss_parallel:
            raise ValueError(
                "the model is already tensor-parallel (loaded by transformers with tp_plan/device_mesh); "
                "sequence_parallel and loss_parallel need ndparallel's own TP: load the model "
                "without tp_plan/device_mesh, or turn those options off"
            )
        return distribute_leftover_params(model, tp_mesh)
    validate_tensor_parallel(model.config, tp_size, options)
    assigned = match_plan(model, resolve_tp_plan(model, options.plan), strict=bool(options.plan))
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
        styles[name] = parallel_style(
            style, on_residual=on_residual, sequence_parallel=sp,
            output_sharded=options.loss_parallel and name == head,
        )
    for name, module in model.named_modules():
        if name in styles or not any(True for _ in module.parameters(recurse=False)):
            continue
        if any(n.startswith(name + ".") for n in styles) or (sp and name in blocks):
            raise TPPlanError(
                f"module {name!r} owns parameters and contains tensor-parallel submodules; give it "
                "a style in the tp plan"
            )
        on_residual, _ = _layer_position(name)
        styles[name] = ReplicateParallel(Shard(1) if sp and on_residual else Replicate())
    for block in blocks:
        styles[block] = GatherSequenceInput() if sp else ReplicateBlockInput()
    if sp:
        model.register_forward_pre_hook(_sp_position_hook(tp_size), with_kwargs=True)

    tied = tied_parameter_groups(model)
    for name, style in styles.items():
        parallelize_module(model.get_submodule(name), tp_mesh, style)
    _retie(model, tied)
    if options.loss_parallel and hasattr(type(model), "loss_function"):
        model.loss_function = _in_loss_parallel(model.loss_function)  # transformers' setter
    setattr(model, _TP_MESH_ATTR, tp_mesh)
    _check_all_dtensor(model)
    _align_grad_placements(model)
    return model


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


def _check_all_dtensor(model: nn.Module) -> None:
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
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
    is removed, DTensor autograd doing that all-reduce.
    """
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), tp_mesh)
    if mesh.ndim != 1 or mesh.size() != tp_mesh.size():
        raise ValueError(
            f"the model is tensor-parallel over {mesh.size()} ranks ({mesh}) but the layout's tp mesh "
            f"has {tp_mesh.size()}: transformers 5 ignores device_mesh when given tp_plan and shards "
            "over the whole world. Load the model without tp_plan (ndparallel then shards it), or "
            "use tp_size = world size"
        )
    grad_allreduce = {
        n for n, s in match_plan(model, model_tp_plan(model), strict=False).items()
        if s == "replicated_with_grad_allreduce"
    }
    for name, module in model.named_modules():
        if not any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            continue
        if name in grad_allreduce:
            module.__dict__.pop("forward", None)  # transformers' per-instance TP forward wrapper
            style = ReplicateParallel(Shard(-2))
        else:
            style = ReplicateParallel(Replicate())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallelize_module(module, mesh, style)
    _check_all_dtensor(model)
    _align_grad_placements(model)
    return model


def _in_loss_parallel(loss_fn):
    """The model's own loss (``model(..., labels=...).loss``) on vocab-sharded logits: run inside
    ``loss_parallel()`` (its backward too, through ``Accelerator.backward``); a plain scalar out."""
    def loss_function(*args, **kwargs):
        with loss_parallel():
            loss = loss_fn(*args, **kwargs)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

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
        on = str(style).startswith("colwise")
    return dataclasses.replace(options, loss_parallel=on)


def loss_parallel_context(options: TPOptions | None) -> contextlib.AbstractContextManager:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``options.loss_parallel``, else a
    no-op: wrap the cross-entropy (forward and backward) on ``Shard(-1)`` logits in it."""
    if options is not None and options.loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()

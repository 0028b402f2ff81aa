"""The DTensor parallel styles tensor parallelism uses beyond torch's Colwise/Rowwise: replicated
parameters on DTensor inputs, shared block inputs, and the mapping of Hugging Face style names to
styles (``parallel_style``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

from ndparallel.models.tp_plans import RESIDUAL_STYLES, STYLES, TPPlanError


def replicate_param(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """``param`` as a ``Replicate`` DTensor Parameter on ``mesh`` (rank 0's values)."""
    if param.is_meta:
        data = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
    else:  # broadcast from rank 0: replicas are identical even if initialised differently
        data = distribute_tensor(param.data, mesh, [Replicate()], src_data_rank=0)
    return nn.Parameter(data, requires_grad=param.requires_grad)


def _grad_to_param_placements(param: nn.Parameter) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def align_grad_placements(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements as soon as it is accumulated.

    DTensor autograd leaves a replicated norm weight applied to sharded activations with a
    ``Partial`` gradient (summed here: one small all-reduce) and the vocab-sharded embedding with a
    full ``Replicate`` one (sliced here: no communication, less memory). Clipping, DDP and
    checkpoints then see gradients laid out like their parameters.

    Needed for TP without FSDP: without it the vocab-sharded embedding's gradient is the full
    (vocab × hidden) matrix on every tp rank (``tests/test_tensor_parallel.py`` asserts gradient
    placements == parameter placements and fails without these hooks). Under FSDP2 they do not
    fire: FSDP2 owns the sharded parameters and reduces their gradients itself.
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
    ``buffers``: floating-point buffers become ``Replicate`` DTensors too (a router's score-correction
    bias added to its DTensor logits, DeepSeek-V3).
    """

    def __init__(self, input_layout: Placement = Replicate(), buffers: bool = False):
        super().__init__()
        self.input_layout = input_layout
        self.buffers = buffers

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                module.register_parameter(name, replicate_param(param, device_mesh))
        for name, buf in list(module.named_buffers(recurse=False)) if self.buffers else ():
            if buf is not None and buf.is_floating_point() and not isinstance(buf, DTensor):
                module._buffers[name] = DTensor.from_local(buf, device_mesh, [Replicate()], run_check=False)
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


class VocabParallelEmbedding(ParallelStyle):
    """The embedding sharded on the vocabulary (``Shard(0)``), computed as Megatron does: each tp
    rank looks up the ids its rows hold, zeros the others, and the lookups are summed over tp
    (``Partial`` → ``output_layout``: all-reduce, or reduce-scatter to ``Shard(1)`` under sequence
    parallel). Its weight gradient is computed for the rank's rows only. torch's
    ``RowwiseParallel`` embedding gives the same forward but a full (vocab × hidden) ``Replicate``
    weight gradient on every tp rank — (tp−1)/tp of it wasted, 3.8 GB per rank for a 128k × 8192
    fp32 embedding at tp 8 (found by ``ndparallel simulate``).

    The module's class is swapped for a subclass (as FSDP2's ``fully_shard`` does) in which
    ``nn.Embedding.forward`` is this lookup: a family's own subclass still runs its forward around
    it (Gemma's scaled embedding multiplies the looked-up rows); parameter names, checkpoints and
    the module tree are unchanged."""

    def __init__(self, output_layout: Placement = Replicate()):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding applies to nn.Embedding, not {type(module).__name__}")
        weight = module.weight
        if not isinstance(weight, DTensor):  # as torch's RowwiseParallel shards it (meta tensors too)
            data = distribute_tensor(weight.data, device_mesh, [Shard(0)], src_data_rank=0)
            module.register_parameter("weight", nn.Parameter(data, requires_grad=weight.requires_grad))
        module._ndp_vocab_parallel = (device_mesh, self.output_layout)
        module.__class__ = _vocab_parallel_class(type(module))
        return module


_VOCAB_PARALLEL_CLASSES: dict[type, type] = {}


class _VocabParallelLookup(nn.Embedding):
    """``nn.Embedding.forward`` replaced, placed right above ``nn.Embedding`` in the swapped class's
    method resolution order."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _vocab_parallel_lookup(self, input)


def _vocab_parallel_class(base: type) -> type:
    if base not in _VOCAB_PARALLEL_CLASSES:
        bases = (_VocabParallelLookup,) if base is nn.Embedding else (base, _VocabParallelLookup)
        _VOCAB_PARALLEL_CLASSES[base] = type(f"VocabParallel{base.__name__}", bases, {})
    return _VOCAB_PARALLEL_CLASSES[base]


def _vocab_parallel_lookup(self, input: torch.Tensor) -> torch.Tensor:
    mesh, layout = self._ndp_vocab_parallel
    weight = self.weight
    local = weight.to_local()  # its gradient comes back as this rank's rows (Shard(0))
    per = -(-weight.shape[0] // mesh.size())  # DTensor's Shard(0): the first ranks take the extra row
    start = mesh.get_local_rank() * per
    ids = input.to_local() if isinstance(input, DTensor) else input
    outside = (ids < start) | (ids >= start + local.shape[0])
    pad = self.padding_idx
    pad = pad - start if pad is not None and start <= pad < start + local.shape[0] else None
    out = torch.nn.functional.embedding(torch.where(outside, 0, ids - start), local, pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [layout]).to_local()


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
                return args, {
                    **kwargs,
                    "hidden_states": self._to_replicate(kwargs["hidden_states"], device_mesh),
                }
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


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over ``group`` (each rank's was partial)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class MlaKvAProjParallel(ReplicateParallel):
    """MLA's shared K/V down-projection (DeepSeek V2/V3, transformers' ``mla_kv_a_proj``):
    replicated, but the last ``rope_dim`` outputs (the rotary key part) skip the column-sharded
    ``kv_b_proj`` and meet only this rank's heads, so their gradient is partial on each rank: it
    is summed over tp here (the rest comes back whole through ``kv_b_proj``'s input gradient)."""

    def __init__(self, rope_dim: int):
        super().__init__(Replicate())
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        group, rope = device_mesh.get_group(), self.rope_dim

        def sum_rope_grad(_mod, _args, output):
            passed, rotary = output.split([output.shape[-1] - rope, rope], dim=-1)
            return torch.cat([passed, _SumGradOverGroup.apply(rotary, group)], dim=-1)

        module.register_forward_hook(sum_rope_grad)  # after the DTensor output became local
        return module


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
        return VocabParallelEmbedding(output_layout=resid)
    if style == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=resid)
    if style == "replicated_with_grad_allreduce":
        return ReplicateParallel(Shard(-2))
    if style in RESIDUAL_STYLES:
        return ReplicateParallel(resid)
    raise TPPlanError(
        f"tp style {style!r} is not supported by ndparallel; supported: {', '.join(STYLES)} "
        "(or a torch ParallelStyle object in TPOptions.plan)"
    )

"""Expert parallel: the experts of each mixture-of-experts layer split over the ``ep`` ranks; every
(token, expert) pair travels to the rank holding its expert by an all-to-all and its output comes
back by a second one (the token dispatch and combine of torchtitan and of transformers'
``AllToAllEP``); each rank runs its local experts as one grouped GEMM (transformers' own
``grouped_mm_experts_forward``: ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``
where the device has it, transformers' per-expert fallback elsewhere).

Exact and padding-free: the split sizes are the true counts (one host read per layer), no token is
dropped and no capacity is padded, so every layout computes what one device computes.

Plugging in: the model's own experts module stays (its parameters keep their names and global
shapes, so checkpoints and exports see the model's canonical FQNs); it is given a subclass whose
forward routes the tokens — the way FSDP2's ``fully_shard`` gives a module a subclass. No
transformers class is changed. The router and the rest of the MoE block run as written.

Tokens: ranks of one ``tp`` group hold the same tokens unless sequence parallel splits them. Without
sequence parallel each tp rank takes its share of the rows before dispatching (a local slice) and
the outputs are all-gathered after the combine, so no token is computed twice (transformers'
``AllToAllEP`` does the same); under sequence parallel the MoE block sees the rank's own sequence
shard and nothing is sliced. Experts are never tensor-parallel (``etp = 1``).

Weights: under ``ep`` > 1 each expert parameter becomes a ``Shard(0)`` DTensor on the ``ep`` mesh
(this rank's experts); FSDP2 then shards it over ``efsdp`` (``parallel/fsdp.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ndparallel.models.moe import experts_modules, grouped_gemm_ready

_ROUTE_ATTR = "_ndp_expert_route"


@dataclass
class ExpertRoute:
    """How one experts module reaches its experts (set by ``apply_expert_parallel``)."""

    num_experts: int
    """Experts of the layer (all ranks)."""
    ep_mesh: DeviceMesh | None
    """The ``ep`` mesh (None: every rank holds every expert)."""
    tp_mesh: DeviceMesh | None
    """The ``tp`` mesh when tp ranks share their tokens (no sequence parallel): rows are sliced."""

    @property
    def ep_size(self) -> int:
        return self.ep_mesh.size() if self.ep_mesh is not None else 1

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size


def is_expert_parallel(module: nn.Module) -> bool:
    """Whether ``apply_expert_parallel`` took over this experts module."""
    return getattr(module, _ROUTE_ATTR, None) is not None


def check_expert_parallel(model: nn.Module, ep_size: int) -> None:
    """Refuse what expert parallel cannot run, naming the fix (before anything is sharded)."""
    experts = experts_modules(model)
    if not experts:
        raise ValueError(
            f"expert_parallel_size={ep_size}: {type(model).__name__} has no mixture-of-experts "
            "layers (no experts module with 3-D expert weights); set expert_parallel_size: 1"
        )
    name, module = experts[0]
    if not grouped_gemm_ready(module):
        raise ValueError(
            f"{type(model).__name__}'s experts ({type(module).__name__}) do not run through "
            "transformers' experts implementations (use_experts_implementation), with which "
            "ndparallel splits experts off (expert parallel; under TP experts are not sharded): "
            "train this model without tensor_parallel_size / expert_parallel_size"
        )
    if module.num_experts % ep_size:
        raise ValueError(
            f"{type(model).__name__} has {module.num_experts} experts per layer, not divisible by "
            f"expert_parallel_size={ep_size}: use a divisor of {module.num_experts}"
        )


def apply_expert_parallel(
    model: nn.Module, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, sequence_parallel: bool = False
) -> list[nn.Module]:
    """Take over every experts module of ``model`` (see the module doc); returns them.

    ``ep_mesh``: the expert mesh's ``ep`` dim (None or size 1: no split); ``tp_mesh``: the ``tp``
    mesh when TP is on (rows are sliced over it unless ``sequence_parallel``)."""
    ep_mesh = ep_mesh if ep_mesh is not None and ep_mesh.size() > 1 else None
    check_expert_parallel(model, ep_mesh.size() if ep_mesh is not None else 1)
    share = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 and not sequence_parallel else None
    classes: dict[type, type] = {}
    out = []
    for _, module in experts_modules(model):
        route = ExpertRoute(module.num_experts, ep_mesh, share)
        if ep_mesh is not None:
            _shard_over_ep(module, ep_mesh)
        cls = type(module)
        if cls not in classes:
            classes[cls] = type(
                f"ExpertParallel{cls.__name__}", (cls,), {"forward": _expert_parallel_forward}
            )
        module.__class__ = classes[cls]
        setattr(module, _ROUTE_ATTR, route)
        out.append(module)
    return out


def _shard_over_ep(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Every parameter of the experts module (dim 0 = expert) as a ``Shard(0)`` DTensor on ``ep``."""
    for name, param in list(module.named_parameters(recurse=False)):
        if param.is_meta:
            local = param.data.chunk(ep_mesh.size(), dim=0)[ep_mesh.get_local_rank()]
            data = DTensor.from_local(
                torch.empty_like(local, device="meta"),
                ep_mesh,
                [Shard(0)],
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        else:  # rank 0 of the ep group scatters its experts: ranks agree even if initialised apart
            data = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=0)
        module.register_parameter(name, nn.Parameter(data, requires_grad=param.requires_grad))


class _LocalExperts:
    """This rank's experts as the grouped-GEMM forward reads them: the module's attributes with
    its parameters as local tensors and ``num_experts`` the local count."""

    def __init__(self, module: nn.Module, local_experts: int):
        self._module = module
        self.num_experts = local_experts
        self._is_expert_parallel = False  # local ids only: no off-rank sentinel ids to mask
        for name, param in module.named_parameters(recurse=False):
            setattr(self, name, param.to_local() if isinstance(param, DTensor) else param)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _local_experts_forward(
    module: nn.Module, route: ExpertRoute, tokens: torch.Tensor, local_ids: torch.Tensor
) -> torch.Tensor:
    """Each row through its (local) expert, unweighted: transformers' grouped-GEMM forward, top-1."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    ones = torch.ones(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
    return grouped_mm_experts_forward(
        _LocalExperts(module, route.local_experts), tokens, local_ids.unsqueeze(-1), ones
    )


def _expert_parallel_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's forward under expert parallel: same arguments and result as the
    model's own (``(T, H)`` tokens, ``(T, k)`` expert ids and routing weights → ``(T, H)``)."""
    route: ExpertRoute = getattr(self, _ROUTE_ATTR)
    hidden, index, weights = (
        t.to_local() if isinstance(t, DTensor) else t for t in (hidden_states, top_k_index, top_k_weights)
    )
    rows = hidden.shape[0]
    if route.tp_mesh is not None:  # tp peers hold the same rows: each takes its share
        hidden, index, weights = (_to_row_share(t, route.tp_mesh) for t in (hidden, index, weights))
    out = _dispatch_compute_combine(self, route, hidden, index, weights)
    if route.tp_mesh is not None:
        out = DTensor.from_local(
            out.contiguous(),
            route.tp_mesh,
            [Shard(0)],
            run_check=False,
            shape=(rows, out.shape[-1]),
            stride=(out.shape[-1], 1),
        ).full_tensor()
        if out._base is not None:  # a view (uneven slices): the caller may add to it in place
            out = out.clone()
    return out.to(hidden_states.dtype if not isinstance(hidden_states, DTensor) else hidden.dtype)


def _to_row_share(t: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """This tp rank's rows of a tensor every tp rank holds whole (``Replicate`` → ``Shard(0)``:
    a local slice; its backward all-gathers the row gradients, uneven or empty slices too)."""
    return (
        DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
        .redistribute(tp_mesh, [Shard(0)])
        .to_local()
    )


def _dispatch_compute_combine(
    module: nn.Module, route: ExpertRoute, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Sort the (token, slot) pairs by expert, send each group to its expert's rank, run the local
    experts, send the outputs back, weight them and sum each token's slots."""
    rows, k = index.shape
    experts = index.reshape(-1)
    order = torch.argsort(experts, stable=True)  # pairs grouped by expert, hence by owner rank
    sent = hidden[order // k]
    if route.ep_mesh is None:
        out = _local_experts_forward(module, route, sent, experts[order])
    else:
        counts = (
            torch.zeros(route.num_experts, dtype=torch.long, device=experts.device)
            .scatter_add_(0, experts, torch.ones_like(experts))
            .view(route.ep_size, route.local_experts)
        )  # no host sync
        out = _exchange(module, route, sent, counts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = out[inverse].view(rows, k, -1)
    return (per_slot * weights.unsqueeze(-1).to(per_slot.dtype)).sum(dim=1)


def _exchange(
    module: nn.Module, route: ExpertRoute, sent: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Dispatch ``sent`` (rows sorted by global expert; ``counts[r, e]`` rows for expert e of rank r)
    over ``ep``, run the local experts on what arrives, and return their outputs in ``sent``'s order."""
    group = route.ep_mesh.get_group()
    # counts per (source rank, local expert). Starting from our own counts: a backend that moves no
    # data (torch's fake process group, a simulated rank) then sends as many rows as it receives.
    received = counts.clone()
    dist.all_to_all_single(received, counts, group=group)
    send_sizes, recv_sizes = torch.stack([counts.sum(dim=1), received.sum(dim=1)]).tolist()  # host read
    tokens = _AllToAll.apply(sent, recv_sizes, send_sizes, group)
    local_ids = torch.arange(route.local_experts, device=sent.device).repeat(route.ep_size)
    local_ids = local_ids.repeat_interleave(received.reshape(-1), output_size=sum(recv_sizes))
    out = _local_experts_forward(module, route, tokens, local_ids)
    return _AllToAll.apply(out, send_sizes, recv_sizes, group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes whose backward is the reverse exchange (synchronous
    c10d: the same call on gloo and NCCL; gradients made contiguous first)."""

    @staticmethod
    def forward(ctx, x, out_sizes: list[int], in_sizes: list[int], group):
        ctx.sizes, ctx.group = (in_sizes, out_sizes), group
        out = x.new_empty((sum(out_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_sizes, in_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_sizes, out_sizes = ctx.sizes
        back = grad.new_empty((sum(in_sizes), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_sizes, out_sizes, group=ctx.group)
        return back, None, None, None

"""Lean RMSNorm: HF's Llama-form RMSNorm with the same forward, a smaller saved set and a
token-tiled analytic backward. Turned on with the sequence-tiled MLP (``FSDPOptions``: the
long-context sequence tiling, ``parallel/parallelize.py``).

HF's norm (``x32 = x.float(); r = rsqrt(mean(x32²) + eps); y = w · (x32 · r).to(x.dtype)``) runs in
autograd op by op: it saves ``x32`` (fp32), ``r`` and the bf16 normalised ``x̂`` (``6·h + 4`` bytes
per token in bf16) and its backward holds five fp32 ``[T, h]`` tensors at once (``20·h``). The lean
norm is one ``torch.autograd.Function``: its forward runs exactly HF's ops in HF's order (the output
is bit-identical), and it saves only ``x`` (in its dtype) and ``r`` (fp32, one per token): ``2·h + 4``
bytes per token in bf16. Its backward is the analytic gradient, computed over tiles of tokens
(``tile_rule.tile_split``: the tiled MLP's rule and its configured tile count), so its fp32
temporaries are a few ``[tile, h]`` tensors::

    x̂ = x·r,  g_w = (g · w) cast as HF casts,  dx = r · (g_w − x̂ · mean(g_w · x̂)),  dw = Σ_tokens g · x̂

The weight multiply happens in HF's dtypes (``w`` times ``x̂`` cast to ``x``'s dtype); ``dw`` is
summed over tiles in fp32 and cast to the weight's dtype once. Gradients equal HF's up to rounding
(the same sums in another order; ``tests/test_lean_norm.py``).

Which norms: ``apply_lean_norms`` looks at every module owning one 1-D ``weight``, no other
parameter and no children, and decides **by behaviour**: it runs the class's own forward and the
lean one on a probe input (the weight's dtype and float32; rows where ``eps`` matters and a weight
that is not all ones) and swaps the instance's class (as the tiled MLP and FSDP2's
``fully_shard`` do: names, module tree and checkpoints unchanged) only where the outputs are
bit-equal. A norm of another form — Gemma's ``(1 + w)`` in fp32, a LayerNorm — keeps its own forward.

Under the layouts: FSDP2 gathers the weight as a plain tensor (or a DTensor on the tp mesh) before
the layer's forward and again before its backward, as for HF's norm (which saves the weight too).
Under TP the norm's input and weight are DTensors (``parallel/tp/styles.py: ReplicateParallel``):
the function runs on the local tensors (rows are independent) and gives the weight the gradient
DTensor autograd gives it — ``Partial`` over each mesh dim the input is sharded on (a row dim: the
sequence under SP, the heads of a per-head norm), else ``Replicate``. An input sharded on the
normalised dim, or ``Partial``, takes HF's forward. CP splits the tokens: nothing changes.
Activation checkpointing recomputes the forward (it saves ``x``, ``w``, ``r`` again); compile
traces the function (``techniques/compile.py`` compiles the children of each layer under tiling).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ndparallel.techniques.tile_rule import tile_spans

EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")
"""Where HF-style norms keep their epsilon; the probe confirms the one found is the one used."""


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's Llama RMSNorm, op for op (the same bits): ``(y, rstd)``."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(variance + eps)
    return weight * (x32 * rstd).to(input_dtype), rstd


class _LeanRMSNorm(torch.autograd.Function):
    """``hf_rms_norm`` saving ``x`` and ``rstd`` only; see the module doc."""

    @staticmethod
    def forward(ctx, x, weight, eps, num_tiles):
        y, rstd = hf_rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.num_tiles, ctx.out_dtype = num_tiles, y.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        h = x.shape[-1]
        xs, rs, gs = x.reshape(-1, h), rstd.reshape(-1, 1), grad.reshape(-1, h)
        dx = torch.empty_like(xs) if want_x else None
        dw = torch.zeros(h, dtype=torch.float32, device=x.device) if want_w else None
        for start, length in tile_spans(xs.shape[0], h, ctx.num_tiles):
            g = gs.narrow(0, start, length)
            x_hat = xs.narrow(0, start, length).to(torch.float32) * rs.narrow(0, start, length)
            if want_w:  # HF: w · x̂.to(x.dtype), summed over the tokens
                dw += (g * x_hat.to(x.dtype)).sum(0, dtype=torch.float32)
            if want_x:
                g_hat = (g * weight).to(x.dtype).to(torch.float32)
                dot = (g_hat * x_hat).mean(-1, keepdim=True)
                g_hat -= x_hat * dot
                g_hat *= rs.narrow(0, start, length)
                dx.narrow(0, start, length).copy_(g_hat)
        dx = dx.view(x.shape) if want_x else None
        dw = dw.to(weight.dtype).view(weight.shape) if want_w else None
        return dx, dw, None, None


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_tiles: int | None = None):
    """``hf_rms_norm``'s output through ``_LeanRMSNorm``; DTensors run on their local tensors.
    None where the lean norm cannot run it (a DTensor sharded on the normalised dim, or Partial)."""
    if not isinstance(x, DTensor) and not isinstance(weight, DTensor):
        return _LeanRMSNorm.apply(x, weight, eps, num_tiles)
    if not (isinstance(x, DTensor) and isinstance(weight, DTensor)):
        return None
    if x.device_mesh != weight.device_mesh or any(p != Replicate() for p in weight.placements):
        return None
    weight_grad = []
    for p in x.placements:
        if isinstance(p, Shard) and p.dim % x.dim() != x.dim() - 1:
            weight_grad.append(Partial())
        elif isinstance(p, Replicate):
            weight_grad.append(Replicate())
        else:
            return None
    y = _LeanRMSNorm.apply(
        x.to_local(grad_placements=x.placements), weight.to_local(grad_placements=weight_grad), eps, num_tiles
    )
    return DTensor.from_local(
        y, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


class LeanRMSNormMixin:
    """Mixed into an eligible norm instance's class by ``apply_lean_norms``."""

    _ndp_num_tiles: int | None = None
    _ndp_eps_attr: str = "variance_epsilon"

    def forward(self, hidden_states):
        y = lean_rms_norm(hidden_states, self.weight, getattr(self, self._ndp_eps_attr), self._ndp_num_tiles)
        return super().forward(hidden_states) if y is None else y


@functools.cache
def _lean_class(cls: type) -> type:
    return type(f"Lean{cls.__name__}", (LeanRMSNormMixin, cls), {})


def _eps_attribute(module: nn.Module) -> str | None:
    for name in EPS_ATTRIBUTES:
        if isinstance(getattr(module, name, None), float):
            return name
    return None


def _candidate(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    return (
        len(params) == 1
        and weight is not None
        and weight.dim() == 1
        and next(module.children(), None) is None
        and weight.dtype.is_floating_point
        and _eps_attribute(module) is not None
    )


def _probe_equal(module: nn.Module, eps_attr: str) -> bool:
    """The class's own forward and the lean one give the same bits on a probe input, in the
    weight's dtype and in float32 (on the CPU, on a stand-in sharing the module's attributes)."""
    cls, h = type(module), module.weight.shape[-1]
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 4, h, generator=gen) * torch.tensor([1.0, 1e-3, 30.0, 1.0]).view(1, 4, 1)
    weight = 1 + 0.5 * torch.randn(h, generator=gen)
    for dtype in dict.fromkeys((module.weight.dtype, torch.float32)):
        stand_in = cls.__new__(cls)
        stand_in.__dict__.update(module.__dict__)
        stand_in.__dict__["_parameters"] = {"weight": nn.Parameter(weight.to(dtype))}
        x = rows.to(dtype)
        try:
            with torch.no_grad():
                ref = cls.forward(stand_in, x)
                lean = _LeanRMSNorm.apply(x, stand_in.weight, getattr(module, eps_attr), None)
        except Exception:  # noqa: BLE001 — a forward that cannot run the probe is not HF's form
            return False
        if not isinstance(ref, torch.Tensor) or ref.dtype != lean.dtype or not torch.equal(ref, lean):
            return False
    return True


def lean_norm(module: nn.Module, num_tiles: int | None = None) -> bool:
    """Make ``module`` (in place) a lean norm if it has HF's Llama RMSNorm form; whether it does."""
    if not isinstance(module, LeanRMSNormMixin):
        if not _candidate(module):
            return False
        eps_attr = _eps_attribute(module)
        if not _probe_equal(module, eps_attr):
            return False
        module.__class__ = _lean_class(type(module))
        module._ndp_eps_attr = eps_attr
    module._ndp_num_tiles = num_tiles
    return True


def apply_lean_norms(model: nn.Module, num_tiles: int | None = None) -> list[nn.Module]:
    """Make every HF-Llama-form RMSNorm of ``model`` lean; returns them (others keep their forward)."""
    return [m for m in model.modules() if lean_norm(m, num_tiles)]


def is_lean(module: nn.Module) -> bool:
    return isinstance(module, LeanRMSNormMixin)

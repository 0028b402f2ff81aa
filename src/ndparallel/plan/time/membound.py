"""Bytes moved by the memory-bound ops of a training step (read + written, as the kernels do).

Counted op by op from the eager code that runs: HF's Llama layer (``LlamaRMSNorm`` upcasts to fp32,
squares, means, multiplies by ``rsqrt``, casts back, multiplies by the weight; RoPE's
``q·cos + rotate_half(q)·sin``; ``silu(gate)·up``; two residual adds), autograd's backward of
each, ``causal_lm_loss`` (fp32 upcast, log-softmax, NLL), FSDP2's copies and the optimizer.
``e`` = activation bytes (2 in bf16). Ops whose second operand is broadcast (RoPE's cos/sin, the
norm weight, the per-token ``rsqrt``) run through PyTorch's strided element-wise kernel, several
times slower than a contiguous one: they are kept apart (``broadcast``) and costed at
``Hardware.broadcast_efficiency`` of the element-wise bandwidth. Each coefficient below is bytes
per element of the tensor named in its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan import moe_cost
from ndparallel.plan.models import ModelSpec, fsdp_units
from ndparallel.plan.settings import Settings


@dataclass(frozen=True)
class Bytes:
    """Contiguous and broadcast bytes (read + written)."""

    stream: float = 0.0
    broadcast: float = 0.0

    def __add__(self, o: Bytes) -> Bytes:
        return Bytes(self.stream + o.stream, self.broadcast + o.broadcast)

    def __mul__(self, k: float) -> Bytes:
        return Bytes(self.stream * k, self.broadcast * k)


def _cast(e: int) -> int:
    """Bytes per element of a cast between the activation dtype and fp32 (none in fp32)."""
    return 0 if e == 4 else e + 4


def norm_bytes(e: int) -> tuple[Bytes, Bytes]:
    """(forward, backward) of one RMSNorm, per element of its input (``h``).

    Forward: upcast (e+4), ``pow`` (8), ``mean`` (4), downcast (4+e) | broadcast: ``x·rsqrt`` (8),
    ``weight·x`` (2e). Backward: casts (2·(e+4)), ``grad·x`` and its ``sum`` for the rsqrt grad
    (12+4), ``mean``'s expand/divide (8), ``pow`` backward ``grad·2·x`` (28), the two fp32
    input-grad paths added (12), ``grad·x`` + ``sum`` for the weight grad (4e) | broadcast:
    ``grad·weight`` (2e), ``grad·rsqrt`` (8)."""
    c = _cast(e)
    return (Bytes(2 * c + 12, 8 + 2 * e), Bytes(2 * c + 64 + 4 * e, 8 + 2 * e))


def layer_bytes_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> tuple[Bytes, Bytes]:
    """(forward, backward) bytes of one decoder layer per local token (no GEMMs, no attention).

    * 2 RMSNorms over ``h / t_sp`` (sequence parallel shards them);
    * 2 residual adds, forward ``3e·h`` each, and their gradient sums in backward ``3e·h`` each;
    * the input gradients of q/k/v (3 → 2 adds) and gate/up (2 → 1 add): ``3 · 3e·h``;
    * RoPE over q and k (``(a+k)·d / t`` elements): forward ``neg`` on half (e), ``cat`` (2e),
      ``add`` (3e) | broadcast ``·cos``, ``·sin`` (4e); backward ``neg`` (e), two slice
      backwards (zeros + copy: 4e), two gradient sums (6e) | broadcast ``·cos``, ``·sin`` (4e);
    * SwiGLU over ``f / t``: forward ``silu`` (2e), ``·up`` (3e); backward the product's two
      gradients (6e), ``silu`` backward (3e).
    """
    e, t = s.act_bytes, layout.tp
    h, f = model.hidden, model.intermediate / t
    t_sp = t if s.sequence_parallel else 1
    rope = (model.heads + model.kv_heads) * model.head_dim / t
    nf, nb = norm_bytes(e)
    fwd = nf * (2 * h / t_sp) + Bytes(2 * 3 * e * h) + Bytes(6 * e * rope, 4 * e * rope)
    fwd += Bytes(5 * e * f)
    bwd = nb * (2 * h / t_sp) + Bytes((2 + 3) * 3 * e * h) + Bytes(11 * e * rope, 4 * e * rope)
    bwd += Bytes(9 * e * f)
    if model.qk_norm:  # Qwen3's per-head q/k RMSNorms over (a+k)·d/t elements
        fwd += nf * rope
        bwd += nb * rope
    if model.is_moe:  # dispatch/combine copies, the experts' SwiGLU, the router (plan/moe_cost.py)
        mf, mb = moe_cost.elementwise_bytes_per_token(model, layout, s)
        fwd, bwd = fwd + Bytes(mf), bwd + Bytes(mb)
    return fwd, bwd


def loss_bytes_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> Bytes:
    """Forward + backward bytes of the LM-head output side per local token: per logit (``V/t``)
    the fp32 upcast (e+4), log-softmax (reads twice, writes once: 12), NLL backward's zero fill
    (4), log-softmax backward (reads grad and output twice, writes once: 16) and the grad's
    downcast (4+e) = 40 + 2e; plus the final RMSNorm over ``h``."""
    e = s.act_bytes
    vocab = -(-model.vocab // layout.tp)
    nf, nb = norm_bytes(e)
    t_sp = layout.tp if s.sequence_parallel else 1
    return Bytes((32 + 2 * _cast(e)) * vocab) + (nf + nb) * (model.hidden / t_sp)


def fsdp_copy_bytes(model: ModelSpec, layout: ParallelDims, s: Settings, local: float, shard: float) -> float:
    """FSDP2's own copies per optimizer step, given tp-local (``local``) and sharded (``shard``)
    parameter counts per unit. An all-gather casts the fp32 shard into the bf16 send buffer
    (shard·(4+e)) and copies the gathered buffer into the parameters (local·2e); a gradient
    reduction concatenates the bf16 gradients into an fp32 buffer (local·(e+4)) and, after the
    first micro-batch, adds into the sharded gradient (shard·12); accumulating unsharded, each
    micro-batch after the first adds its gradient into the fp32 unsharded one (local·(8+e)). On one rank the
    "collectives"
    are device copies too (local·2e per gather, local·8 per reduction): with more ranks they are
    the communication costed in ``comms.py``."""
    e = s.act_bytes
    one_rank = layout.fsdp == 1
    applied = layout.dp_replicate * layout.fsdp > 1 or s.mixed_precision != "fp32"
    if not applied:
        return 0.0
    gathers = s.gathers_per_step()
    per_gather = shard * (4 + e) + local * 2 * e + (local * 2 * e if one_rank else 0.0)
    reduces = s.reducing_microbatches
    per_reduce = local * (e + 4) + (local * 8 if one_rank else 0.0)
    if s.accumulates_unsharded:  # fp32 unsharded += this micro-batch's bf16 gradient (read 4 + e, write 4)
        accumulate = local * (8 + e) * (s.gradient_accumulation_steps - 1)
    else:  # the reduced shard added into the sharded gradient
        accumulate = shard * 12 * (s.reducing_microbatches - 1)
    return gathers * per_gather + reduces * per_reduce + accumulate


def unit_param_counts(model: ModelSpec, numels: dict) -> tuple[float, float]:
    """(tp-local, sharded) parameter elements of the whole model on one rank."""
    local = shard = 0.0
    for unit, (count, _) in fsdp_units(model).items():
        local += numels[unit][0] * count
        shard += numels[unit][1] * count
    return local, shard


OPTIMIZER_BYTES = {
    ("adamw", True): 28,
    ("adamw", False): 84,
    ("sgd", True): 12,
    ("sgd", False): 12,
    ("adamw_8bit", True): 18,
    ("adamw_8bit", False): 18,
    ("adamw_4bit", True): 17,
    ("adamw_4bit", False): 17,
    ("muon", True): 32,
    ("muon", False): 32,
}
"""Bytes per parameter of one optimizer step. Fused AdamW reads param, grad, exp_avg, exp_avg_sq
and writes three (28); torch's default foreach AdamW runs eight list ops (weight decay 8, lerp 12,
``·β₂`` 8, addcmul 16, sqrt 8, div 8, ``+ε`` 8, addcdiv 16 = 84). SGD without momentum: 12.
torchao's low-bit AdamW runs one compiled kernel per parameter: param and grad read, param written
(12), each moment's codes read and written (8-bit: 2 x 2 + scales ~ 6; 4-bit ~ 5). Muon (its
matrices): momentum ``mul_`` + ``add_`` (20), decay and update of the param (16 less the fused
read: ~12) ≈ 32; its Newton–Schulz GEMMs are compute, counted apart (``plan/muon_cost.py``)."""
CLIP_BYTES = 12
"""Gradient clipping per parameter: the norm reads the gradient (4), the scaling reads and
writes it (8)."""

"""Mixture-of-experts in the planner: the terms an MoE layer adds to the memory, compute and
communication models, for the runtime of ``parallel/ep/expert.py`` (docs/moe.md).

Every decoder layer is an MoE layer (Qwen3-MoE, Mixtral, gpt-oss, OLMoE): attention as in a dense
layer, a router (E × h), optional shared experts (a dense MLP of width ``s``, replicated over tp),
and E experts, each a gated MLP of width I (``gate_up`` 2I × h, ``down`` h × I); a token uses k
of them. Notation: T local tokens of a micro-batch (b·s/cp), t = tp, e activation bytes.

* Placement (ParallelDims): experts are never tensor-parallel; E/ep experts per rank, their
  weights FSDP-sharded over ``efsdp`` = dp_shard·cp·tp/ep (one FSDP unit per layer: ``experts``).
* Work per rank and MoE layer: each tp rank routes T/t of the tokens (its slice, or its sequence
  shard under SP), so balanced routing gives it T·k/t (token, expert) rows, over its E/ep experts:
  grouped GEMMs of m = T·k·ep/(t·E) rows per expert, 3 of them (gate_up, down, ×fwd/dgrad/wgrad).
* Communication per MoE layer and pass: an all-to-all of the dispatched rows (T·k/t·h·e bytes in
  per rank), one of the outputs back, and a tiny one of the split sizes (E·8 bytes, a host sync);
  backward mirrors the two big ones, the recompute under checkpointing repeats the forward ones.
  Without sequence parallel the tp ranks slice their shared rows and all-gather the outputs
  (T/t·h·e in, once forward, once for the input gradient in backward).
* Activations per local token and MoE layer (saved for backward): (k/t)·e·(3h + 4I) for the
  dispatched rows, the expert intermediates and the weighted outputs, plus 8·E for the router's
  fp32 probabilities and the logits the load-balancing loss keeps (+ the shared MLP's 4·e·s/t).
Load imbalance is not modelled: real routing sends more rows to some ranks than to others.
``model`` is a ``plan.models.ModelSpec``, ``layout`` a ``ParallelDims``, ``s`` the ``Settings``.
"""

from __future__ import annotations

import math


def expert_params(model) -> int:
    """Parameters of one layer's experts (all E)."""
    return model.num_experts * 3 * model.hidden * model.moe_intermediate


def active_matmul_params_per_layer(model) -> int:
    """Expert, router and shared-expert parameters one token multiplies with in one layer."""
    h = model.hidden
    return (
        model.top_k * 3 * h * model.moe_intermediate
        + model.num_experts * h
        + 3 * h * model.shared_intermediate
    )


def expert_unit_numels(model, layout) -> tuple[int, int]:
    """(this rank's experts unsharded, its FSDP shard) of ONE layer's expert unit, in elements:
    E/ep experts, sharded over efsdp on dim 0 (dim 1 when fewer local experts than efsdp ranks;
    either way the shard is the local count / efsdp, rounded up)."""
    local = expert_params(model) // layout.ep
    return local, math.ceil(local / layout.efsdp)


def routed_rows(model, layout, tokens: float) -> float:
    """(token, expert) rows one rank's experts compute per MoE layer (balanced routing)."""
    return tokens * model.top_k / layout.tp


def activation_bytes_per_token(model, layout, s) -> float:
    """What one MoE layer's experts, router and shared MLP keep for backward per local token."""
    e, t, h = s.act_bytes, layout.tp, model.hidden
    return (
        (model.top_k / t) * e * (3 * h + 4 * model.moe_intermediate)
        + 8 * model.num_experts
        + 4 * e * model.shared_intermediate / t
    )


def workspace_per_token(model, layout, s) -> float:
    """Gradients alive at once in the experts' backward per local token (gate, up, product)."""
    return 3 * s.act_bytes * model.moe_intermediate * model.top_k / layout.tp


def gemms(model, layout, s, tokens: int, gemm: type, recompute: bool) -> list:
    """The grouped GEMMs of one micro-batch's MoE layers (router and shared MLP included), as
    ``gemm`` (``plan.gemm.Gemm``) rows: fwd, dgrad, and wgrad unless LoRA freezes the base."""
    h, i, L = model.hidden, model.moe_intermediate, model.layers
    local = model.num_experts // layout.ep
    m = max(1, round(routed_rows(model, layout, tokens) / local))
    shapes = [
        ("experts gate_up", h, 2 * i, local * L),
        ("experts down", i, h, local * L),
        ("router", h, model.num_experts, L),
    ]
    if model.shared_intermediate:
        shapes.append(("shared expert gate/up/down", h, model.shared_intermediate, 3 * L))
    out = []
    for name, k_in, n_out, count in shapes:
        rows = tokens if name == "router" or name.startswith("shared") else m
        again = count if recompute else 0
        out += [
            gemm(f"{name} fwd", rows, n_out, k_in, count + again),
            gemm(f"{name} dgrad", rows, k_in, n_out, count),
        ]
        if not s.lora_r:
            out.append(gemm(f"{name} wgrad", n_out, k_in, rows, count))
    return out


def elementwise_bytes_per_token(model, layout, s) -> tuple[float, float]:
    """(forward, backward) bytes per local token of the dispatch and combine copies (gather by
    expert, the two exchanged buffers, the un-permute, the weighting: ~5 passes over k·h values
    forward, as many backward), SwiGLU over k·I, and the router's softmax/top-k over E."""
    e, k, t = s.act_bytes, model.top_k, layout.tp
    rows = k / t
    fwd = rows * (5 * 2 * e * model.hidden + 5 * e * model.moe_intermediate) + 12 * model.num_experts
    bwd = rows * (5 * 2 * e * model.hidden + 9 * e * model.moe_intermediate) + 12 * model.num_experts
    return fwd, bwd


def collectives(model, layout, s, tokens: int, ga: int, collective: type) -> list:
    """The expert-parallel exchanges of one optimizer step (see the module doc), as ``collective``
    (``plan.comms.Collective``) rows."""
    L, e = model.layers, s.act_bytes
    passes = 2 if s.activation_checkpointing else 1
    out = []
    if layout.ep > 1:
        rows = routed_rows(model, layout, tokens)
        size = int(rows * model.hidden * e)
        out += [
            collective(
                "all_to_all",
                "ep",
                size,
                2 * (passes + 1) * L * ga,
                "EP all-to-all dispatch + combine (fwd, bwd)",
            ),
            collective(
                "all_to_all",
                "ep",
                8 * model.num_experts,
                passes * L * ga,
                "EP split sizes (int64, host sync)",
            ),
        ]
    if layout.tp > 1 and not s.sequence_parallel:
        size = int(tokens / layout.tp * model.hidden * e)
        out.append(
            collective(
                "all_gather",
                "tp",
                size,
                (passes + 1) * L * ga,
                "MoE rows: outputs gathered over tp (fwd), input grads (bwd)",
            )
        )
    return out

"""The planner's account of ``optimizer: muon`` (``optim/muon.py``).

States: Muon keeps one fp32 momentum buffer (4 B/param) for the hidden matrices (the ``layer`` and
``experts`` FSDP units), AdamW two (8 B/param) for the embedding / LM-head / final-norm units; the
layers' norms (2·hidden of ~12·hidden² per layer) are counted at Muon's 4 B, below 0.1 % off.
Step temporaries: each sharded matrix is gathered WHOLE (one at a time): its fp32 copy and
Newton–Schulz's bf16 working set (the input, X·Xᵀ, its square, the product, the next X: ~5 × 2 B
per element for a square matrix) ≈ 16 B per element of the largest hidden matrix at the peak; expert weights
are sharded on the expert dim, so a rank orthogonalises its own experts' matrices (its local shard).
Compute: 5 iterations of 2 m²n + 2 m³ + 2 m²n FLOPs per m×n matrix (m ≤ n), on every rank of the
matrix's shard group (redundant: round-robin over ranks is a later optimisation).
"""

from __future__ import annotations

from ndparallel.plan.time.links import collective_time, group_is_intra_node

ADAMW_UNITS = ("root", "embed", "final")
"""FSDP units whose parameters Muon leaves to AdamW (embeddings, LM head, final norm)."""
GATHERED_BYTES = 16.0
"""Bytes per element of the gathered matrix during its Newton–Schulz (fp32 copy + bf16 working set)."""


def adamw_extra_state_bytes(numels: dict, units: dict, col: int) -> float:
    """AdamW's second moment (4 B) on the units Muon leaves to AdamW: added to 4 B/param everywhere."""
    return 4.0 * sum(numels[u][col] * count for u, (count, _) in units.items() if u in ADAMW_UNITS)


def step_temporaries(model, layout) -> float:
    """Bytes the Muon step allocates at once: the largest hidden matrix gathered whole (a layer's
    matrices; an expert weight: this rank's shard, whole expert matrices)."""
    largest = 0.0
    for p in model.param_specs():
        if len(p.shape) < 2 or p.unit not in ("layer", "experts"):
            continue
        largest = max(largest, p.numel / _expert_share(layout) if p.unit == "experts" else p.numel)
    return GATHERED_BYTES * largest


def _expert_share(layout) -> int:
    """Ranks an expert weight's experts are spread over (E/ep per rank, sharded over efsdp on dim 0)."""
    return layout.ep * layout.efsdp


def newton_schulz_seconds(model, layout, hw, steps: int = 5) -> float:
    """Seconds of one Muon step's orthogonalisations on one rank: every layer matrix whole (each
    rank of its shard group repeats it), this rank's share of the expert matrices; bf16 GEMMs at
    ``matmul_efficiency``."""
    total = 0.0
    for p in model.param_specs():
        if len(p.shape) < 2 or p.unit not in ("layer", "experts"):
            continue
        batch = p.shape[0] if len(p.shape) == 3 else 1
        m, n = sorted(p.shape[-2:])
        share = _expert_share(layout) if p.unit == "experts" else 1
        total += p.count * batch / share * steps * (4 * m * m * n + 2 * m**3)
    return total / (hw.peak_flops * hw.matmul_efficiency)


def gather_seconds(model, layout, hw, gpus_per_node: int) -> float:
    """Seconds of the step's gathers of the hidden matrices (fp32, not hidden behind compute): each
    layer matrix all-gathered over the FSDP ranks, then over the TP ranks when TP shards it."""

    fsdp, tp = layout.fsdp, layout.tp
    total = 0.0
    for p in model.param_specs():
        if len(p.shape) < 2 or p.unit != "layer":
            continue
        tp_n = tp if p.tp_dim is not None else 1
        total += p.count * collective_time(
            "all_gather",
            4.0 * p.numel / tp_n / fsdp,
            fsdp,
            hw,
            group_is_intra_node(layout, "dp_shard_cp", gpus_per_node),
        )
        total += p.count * collective_time(
            "all_gather", 4.0 * p.numel / tp_n, tp_n, hw, group_is_intra_node(layout, "tp", gpus_per_node)
        )
    return total

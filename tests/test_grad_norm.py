"""The global gradient norm (``techniques/grad_norm.py``) on a mix of meshes and placements is the
norm of the full gradients, each counted once, computed by one all-reduce and bit-identical on
every rank: sharded and replicated dimensions of a 3-D mesh, uneven and empty shards, a second mesh (as
the experts' is), a mesh over half the ranks copied over the other half, plain tensors, and
pipeline stages holding different parameters. The layouts' own norms against one process are the
equivalence tests' (``test_compositions``, ``test_pipeline_equivalence``, ``test_moe_equivalence``)."""

from __future__ import annotations

import torch

from ndparallel.testing import run_on_ranks

SHAPES = [(6, 4), (5, 3), (8,), (4, 4), (7, 2)]
"""One full gradient per entry (5 rows over 2 ranks: uneven shards; 4 rows over 8: empty ones)."""


def _full(i: int, shape, stage: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * stage + i)
    return torch.randn(shape, generator=g)


def _grads(stages: int, partial: bool = False):
    """(gradients as this rank holds them, the full gradients they are pieces of, its stage): a
    (dp_replicate 2, dp_shard 2, tp 2) world, or (pp 2, dp_shard 2, tp 2) with each stage's own.
    ``partial``: also a gradient still Partial over tp (its tp ranks hold 0.3 and 0.7 of it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    outer = "pp" if stages > 1 else "dp_replicate"
    root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=(outer, "dp_shard", "tp"))
    stage = root.get_local_rank(outer) if stages > 1 else 0
    mesh = root["dp_shard", "tp"] if stages > 1 else root
    flat = mesh._flatten("flat")  # one 1-D mesh over every rank of the stage, as the experts' is
    r, s0, s1 = Replicate(), Shard(0), Shard(1)
    replicas = [r] if stages == 1 else []  # HSDP's replicas
    placements = [
        [*replicas, s0, s1],  # a TP-sharded linear
        [*replicas, s0, r],  # a norm weight, replicated over tp
        None,  # a plain tensor on every rank of the stage
        "flat",
        [*replicas, r, s0],  # replicated over dp_shard
    ]
    local, full = [], []
    for i, (shape, place) in enumerate(zip(SHAPES, placements)):
        t = _full(i, shape, stage)
        full.append(t)
        if place is None:
            local.append(t.clone())
        elif place == "flat":
            local.append(distribute_tensor(t, flat, [s0]))
        else:
            local.append(distribute_tensor(t, mesh, place))
    if stages == 1:  # a mesh over half the world, copied over the other half (dp_replicate)
        t = _full(len(SHAPES), (6, 2))
        full.append(t)
        local.append(distribute_tensor(t, root["dp_shard", "tp"], [s0, s1]))
    if partial:
        t = _full(len(SHAPES) + 1, (4, 3))
        full.append(t)
        piece = distribute_tensor(t, mesh, [*replicas, s0, r]).to_local()
        share = 0.3 if mesh.get_local_rank("tp") == 0 else 0.7
        local.append(DTensor.from_local(piece * share, mesh, [*replicas, s0, Partial()], run_check=False))
    return local, full, stage


CASES = [(1, 2.0), (2, 2.0), (1, float("inf")), (2, 1.0), (1, "partial"), (1, "every piece counted")]
"""(pipeline stages, norm type); "partial": the 2-norm with a Partial gradient too (summed first:
one more collective); the last: a negative control whose ranks count every piece they hold,
copies included (it must miss the full norm)."""


def _norms_on_rank():
    """Per case: (this rank's norm, collectives it took, every stage's full gradients)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    import ndparallel.techniques.grad_norm as grad_norm

    out = []
    for stages, norm_type in CASES:
        local, full, stage = _grads(stages, partial=norm_type == "partial")
        norm_type = 2.0 if norm_type == "partial" else norm_type
        params = []
        for g in local:
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g
            params.append(p)
        share = grad_norm._share
        if norm_type == "every piece counted":
            grad_norm._share, norm_type = (lambda g, holders: 1.0), 2.0
        try:
            with CommDebugMode() as comm:
                norm = grad_norm.total_grad_norm(params, norm_type, stages=stages)
        finally:
            grad_norm._share = share
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, (stage, [t.double() for t in full]))
        out.append((float(norm), comm.get_total_counts(), dict(everything)))
    return out


def test_norm_of_pieces_is_the_full_norm_in_one_all_reduce():
    """Every case on the same 8 ranks; a gradient left Partial is summed first (one more call)."""
    by_rank = run_on_ranks(_norms_on_rank, 8)
    for case, results in zip(CASES, zip(*by_rank)):
        norms = [n for n, _, _ in results]
        assert len(set(norms)) == 1, (case, norms)  # bit-identical on every rank: one all-reduce's result
        assert {counts for _, counts, _ in results} == {2 if case[1] == "partial" else 1}, case
        full = [t for ts in results[0][2].values() for t in ts]
        p = 2.0 if isinstance(case[1], str) else case[1]
        if p == float("inf"):
            expected = max(t.abs().max().item() for t in full)
        else:
            expected = sum(t.abs().pow(p).sum().item() for t in full) ** (1 / p)
        # fp32 sums of the rounded terms: each addition off by at most one ulp (2^-24 relative)
        bound = sum(t.numel() for t in full) * 2**-24 * expected
        if case[1] == "every piece counted":
            assert abs(norms[0] - expected) > 100 * bound, (case, norms[0], expected)
        else:
            assert abs(norms[0] - expected) <= bound, (case, norms[0], expected)

"""Mesh shape, names and exact rank groups for many layouts (world sizes 1-16)."""

import itertools

import pytest

from ndparallel import ParallelismConfig
from ndparallel.testing import run_on_ranks

LAYOUTS = [  # (pp, dp_replicate, dp_shard, cp, tp)
    (1, 1, 1, 1, 1),
    (1, 2, 1, 1, 1),
    (1, 1, 2, 1, 1),
    (1, 1, 1, 1, 2),
    (1, 1, 1, 2, 1),
    (1, 1, 4, 1, 1),
    (1, 2, 2, 1, 1),
    (1, 1, 2, 1, 2),
    (1, 1, 2, 2, 1),
    (1, 1, 1, 2, 2),
    (1, 2, 1, 1, 2),
    (1, 2, 2, 1, 2),
    (1, 1, 2, 2, 2),
    (1, 3, 1, 1, 2),
    (2, 1, 1, 1, 1),
    (2, 1, 2, 1, 2),
    (2, 2, 1, 2, 1),  # pipeline stages outermost
]
NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def _expected_groups(sizes):
    """Independent reference: rank = row-major index over (pp, dp_replicate, dp_shard, cp, tp)."""
    coords = list(itertools.product(*(range(s) for s in sizes)))
    views = {
        "pp": (0,),
        "dp_replicate": (1,),
        "dp_shard": (2,),
        "cp": (3,),
        "tp": (4,),
        "dp": (1, 2),
        "dp_shard_cp": (2, 3),
        "dp_cp": (1, 2, 3),
    }
    out = {}
    for rank, c in enumerate(coords):
        out[rank] = {}
        for view, dims in views.items():
            out[rank][view] = sorted(
                r for r, c2 in enumerate(coords) if all(c2[d] == c[d] for d in range(5) if d not in dims)
            )
        out[rank]["coords"] = dict(zip(NAMES, c))
    return out


def _mesh_report():
    import torch.distributed as dist

    from ndparallel.layout.mesh import coordinates, group_ranks

    pc = ParallelismConfig(dp_shard_size=-1, **_mesh_report.kwargs)
    mesh = pc.build_device_mesh("cpu")
    views = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp")
    return {
        "shape": tuple(mesh.mesh.shape),
        "names": mesh.mesh_dim_names,
        "groups": {v: group_ranks(mesh, v) for v in views},
        "coords": coordinates(mesh),
        "rank": dist.get_rank(),
    }


def _run_layout(sizes):
    p, r, s, c, t = sizes

    def fn():
        _mesh_report.kwargs = dict(pp_size=p, dp_replicate_size=r, cp_size=c, tp_size=t)
        return _mesh_report()

    return run_on_ranks(fn, p * r * s * c * t, timeout_s=120)


def _check(sizes, reports):
    expected = _expected_groups(sizes)
    for rank, rep in enumerate(reports):
        assert rep["rank"] == rank
        assert rep["shape"] == sizes
        assert rep["names"] == NAMES
        for view, ranks in rep["groups"].items():
            assert ranks == expected[rank][view], (sizes, rank, view)
        for dim, idx in expected[rank]["coords"].items():
            assert rep["coords"][dim] == idx


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "x".join(map(str, s)))
def test_mesh_groups(sizes):
    _check(sizes, _run_layout(sizes))


@pytest.mark.slow
def test_mesh_groups_full_4d_16_ranks():
    sizes = (1, 2, 2, 2, 2)
    _check(sizes, _run_layout(sizes))

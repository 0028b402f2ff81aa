"""CommProfiler: exact per-rank bytes of hand-computable collectives, FSDP2/HSDP/DP training steps
computed from the model's own parameters, and agreement with the planner's prediction."""

import math

import pytest
import torch
import torch.distributed as dist

from ndparallel.runtime.comm_profile import CommProfiler, CommRow
from ndparallel.testing import run_on_ranks


def _mesh(**sizes):
    from ndparallel import ParallelismConfig

    return ParallelismConfig(**sizes).build_device_mesh("cpu")


# ------------------------------------------------------------------ primitives
def _primitives():
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ndparallel.layout.mesh import submesh

    mesh = _mesh(dp_shard_size=2)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    shard = submesh(mesh, "dp_shard")
    with CommProfiler(mesh) as prof:
        dist.all_reduce(torch.ones(3, 5), group=shard.get_group())  # 60 B
        dist.all_reduce(torch.ones(2, dtype=torch.float64))  # world: 16 B
        out = torch.empty(8, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, torch.ones(4, dtype=torch.bfloat16))  # shard in: 8 B
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(6))  # full in: 24 B
        funcol.all_reduce(torch.ones(7), "sum", shard.get_group()).wait()  # 28 B
        # DTensor: Shard(0) -> Replicate is one funcol all-gather of the 2x4 local shard.
        dt = distribute_tensor(torch.arange(16.0).reshape(4, 4), shard, [Shard(0)])
        dt.redistribute(shard, [Replicate()]).to_local()  # 32 B
        if rank == 0:
            dist.send(torch.ones(5), 1)  # 20 B
        else:
            dist.recv(torch.empty(5), 0)
        ops = [dist.P2POp(dist.isend, torch.ones(3), peer), dist.P2POp(dist.irecv, torch.empty(3), peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()  # 12 B each way
        prof.step()
        dist.barrier()
    return prof.summary(), prof.summary(1), prof.aliases(), prof.label("dp_shard_cp")


def test_primitive_bytes_and_dims():
    results = run_on_ranks(_primitives, 2)
    for rank, (rows, second, aliases, label) in enumerate(results):
        sent = {"send": 2, "recv": 1} if rank == 0 else {"send": 1, "recv": 2}
        expected = [
            CommRow("dp_shard", "all_gather", 2, 8 + 32),
            CommRow("dp_shard", "all_reduce", 3, 60 + 16 + 28),
            CommRow("dp_shard", "recv", sent["recv"], 12 + 20 * (sent["recv"] - 1)),
            CommRow("dp_shard", "reduce_scatter", 1, 24),
            CommRow("dp_shard", "scatter", 1, 32),  # distribute_tensor: this rank's 2x4 chunk
            CommRow("dp_shard", "send", sent["send"], 12 + 20 * (sent["send"] - 1)),
        ]
        # On 2 ranks dp_shard, dp, dp_shard_cp, dp_cp and the world are one group, reported once.
        assert rows == expected, (rank, rows)
        assert second == [CommRow("dp_shard", "barrier", 1, 0)]
        assert aliases == {"dp_shard": ("dp_shard_cp", "dp", "dp_cp")}
        assert label == "dp_shard"


def _distinct_groups():
    from ndparallel.layout.mesh import submesh

    mesh = _mesh(dp_shard_size=2, tp_size=2)
    with CommProfiler(mesh) as prof:
        for dim in ("tp", "dp_shard", "dp_shard_cp", "dp"):
            dist.all_reduce(torch.ones(1), group=submesh(mesh, dim).get_group())
        dist.all_reduce(torch.ones(1))  # the whole world: not a mesh dim of this layout
    return [(r.dim, r.op, r.count) for r in prof.summary()]


def test_each_dim_attributed_to_its_group():
    rows = run_on_ranks(_distinct_groups, 4)[0]
    # dp_shard, dp_shard_cp, dp have the same 2 ranks here; the 4-rank world is no mesh dim.
    dims = {d for d, _, _ in rows}
    assert {"tp", "dp_shard", "world"} <= dims
    assert sum(c for _, _, c in rows) == 5


# --------------------------------------------------------------- FSDP2 step
def _fsdp_step(layout, mixed_precision="no", steps=2):
    """Two plain training steps (forward, backward, AdamW) through the Accelerator; returns the
    profiler's per-step calls, label map and the full parameter shapes per FSDP unit."""
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.presets import preset_config

    acc = Accelerator(ParallelismConfig(**layout), mixed_precision=mixed_precision)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    units = {
        "layer": [tuple(p.shape) for p in model.model.layers[0].parameters()],
        "embed": [tuple(p.shape) for p in model.model.embed_tokens.parameters()],
        "final": [tuple(p.shape) for p in (*model.model.norm.parameters(), model.lm_head.weight)],
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(acc.process_index))
    with CommProfiler(acc.torch_device_mesh) as prof:
        for _ in range(steps):
            acc.backward(model(input_ids=x, labels=x).loss)
            opt.step()
            opt.zero_grad()
            prof.step()
    labels = {d: prof.label(d) for d in ("dp_shard_cp", "dp_replicate", "tp", "cp")}
    return [prof.calls(i) for i in range(steps)], labels, units


def _shard_numel(shape, n):
    """FSDP2 shards dim 0, padded to a multiple of n."""
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def _expected_fsdp(units, n, replicate, param_bytes, shard_dim, rep_dim):
    """Independent expectation: per unit, all-gather of the padded shard (fwd, + bwd when
    resharded; final norm+lm_head is kept gathered), fp32 reduce-scatter of the padded full
    gradient, then (HSDP) the fp32 all-reduce of the reduced shard over dp_replicate."""
    out = {}
    gathers = {"layer": 2, "embed": 2, "final": 1}
    count = {"layer": 2, "embed": 1, "final": 1}
    for unit, shapes in units.items():
        shard = sum(_shard_numel(s, n) for s in shapes)
        full = sum(math.prod(s) for s in shapes)
        if n > 1:
            key = (shard_dim, "all_gather", shard * param_bytes)
            out[key] = out.get(key, 0) + gathers[unit] * count[unit]
            key = (shard_dim, "reduce_scatter", shard * n * 4)
            out[key] = out.get(key, 0) + count[unit]
        if replicate > 1:
            key = (rep_dim, "all_reduce", (shard if n > 1 else full) * 4)
            out[key] = out.get(key, 0) + count[unit]
    return out


@pytest.mark.parametrize(
    "name, layout, world, mp",
    [
        ("fsdp2", {"dp_shard_size": 2}, 2, "no"),
        ("fsdp2-bf16", {"dp_shard_size": 2}, 2, "bf16"),
        ("hsdp2x2", {"dp_replicate_size": 2, "dp_shard_size": 2}, 4, "no"),
    ],
)
def test_fsdp_step_bytes_exact(name, layout, world, mp):
    results = run_on_ranks(_fsdp_step, world, layout, mp)
    n = layout.get("dp_shard_size", 1)
    rep = layout.get("dp_replicate_size", 1)
    for per_step, labels, units in results:
        expected = _expected_fsdp(
            units, n, rep, 2 if mp == "bf16" else 4, labels["dp_shard_cp"], labels["dp_replicate"]
        )
        assert per_step[0] == per_step[1], "two identical steps must communicate the same"
        assert per_step[0] == expected, name
    # All-gather bytes per step = (2 × layers + 2 × embedding + final) shard bytes; the tiny
    # model's dims are even, so a shard is exactly 1/n of the unit.
    per_step, labels, units = results[0]
    if n == 2 and mp == "no":
        ag = sum(c * b for (d, op, b), c in per_step[0].items() if op == "all_gather")
        unit_bytes = {u: 4 * sum(math.prod(s) for s in shapes) for u, shapes in units.items()}
        assert ag == (2 * 2 * unit_bytes["layer"] + 2 * unit_bytes["embed"] + unit_bytes["final"]) // n


# ---------------------------------------------------------- vs the planner
@pytest.mark.parametrize(
    "layout, world, mp",
    [
        ({"dp_shard_size": 2}, 2, "fp32"),
        ({"dp_shard_size": 2}, 2, "bf16"),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4, "fp32"),
    ],
)
def test_equals_planner_prediction(layout, world, mp):
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.time.comms import aggregate, predict_collectives

    per_step, labels, _ = run_on_ranks(_fsdp_step, world, layout, "bf16" if mp == "bf16" else "no")[0]
    plan_layout = ParallelDims(
        dp_replicate=layout.get("dp_replicate_size", 1), dp_shard=layout.get("dp_shard_size", 1)
    )
    predicted = aggregate(
        predict_collectives(
            PRESETS["tiny"], plan_layout, sequence_len=32, micro_batch_size=2, mixed_precision=mp
        )
    )
    predicted = {(labels.get(d, d), kind, b): c for (kind, d, b), c in predicted.items()}
    assert per_step[0] == predicted


def _ddp_step():
    per_step, labels, units = _fsdp_step({"dp_replicate_size": 2})
    return per_step[0], labels


def test_ddp_against_planner():
    """Pure DP runs fully_shard on (dp_replicate=2, dp_shard_cp=1): FSDP2 skips the size-1 shard
    group, so the step is exactly the planner's all-reduce of each unit's full fp32 gradient."""
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.time.comms import aggregate, predict_collectives

    calls, labels = run_on_ranks(_ddp_step, 2)[0]
    predicted = aggregate(
        predict_collectives(
            PRESETS["tiny"],
            ParallelDims(dp_replicate=2),
            sequence_len=32,
            micro_batch_size=2,
            mixed_precision="fp32",
        )
    )
    assert calls == {(labels.get(d, d), kind, b): c for (kind, d, b), c in predicted.items()}

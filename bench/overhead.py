"""ndparallel's training step vs a hand-written plain-PyTorch loop making the same FSDP2 calls on
the same model, data and layout, timed alternately in one run (goal: ratio <= 1.05).

Both models are built from the same seed; each iteration runs one ndparallel step and one plain
step (order alternating), each between barriers; reported: median(ndparallel)/median(plain), the
median of the paired per-iteration ratios and the ratio of the minima (the machine is shared).
The plain loop: ``fully_shard`` per decoder layer, embedding, (norm + lm_head), root, on its own
1-D mesh, SUM reduction with divide factor 1, global token count by one all-reduce, token-sum
cross-entropy, ``torch.nn.utils.clip_grad_norm_``, AdamW.

    python bench/overhead.py --world 2 --steps 20 --seq 256 [--loss logits]

ndparallel's default loss is the chunked one (no full logits), which is less work than the plain
loop's; ``--loss logits`` makes both loops do the same math (the pure bookkeeping overhead).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402,F401
from _common import local_micro_batch, nd_step, print_table, write_json  # noqa: E402

from ndparallel.testing import run_on_ranks  # noqa: E402


def _plain_model(setup, world):
    import torch.distributed as dist  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ndparallel.tools.equivalence import build_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("plain_dp",))
    model = build_model(setup)
    kw = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model.model.embed_tokens, **kw)
    fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def _plain_step(model, opt, mb, group):
    import torch.distributed as dist
    import torch.nn.functional as F

    labels = mb["shift_labels"]
    n = (labels != -100).sum()
    dist.all_reduce(n, group=group)
    logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
    loss = (
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        / n
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _run(world, steps, seq, rows, warmup, chunked=True):
    import torch.distributed as dist

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.presets import preset_config
    from ndparallel.techniques.technique_options import LossOptions
    from ndparallel.tools.equivalence import (
        TrainSetup,
        build_model,
        make_global_batches,
        setup_optimizer,
    )

    setup = TrainSetup(
        preset_config("quickstart-llama"), steps=steps + warmup, global_micro_batch=rows, seq_len=seq
    )
    acc = Accelerator(ParallelismConfig(dp_shard_size=world), loss_options=LossOptions(chunked=chunked))
    nd_model = build_model(setup)
    nd_opt = setup_optimizer(setup, nd_model.parameters())
    nd_model, nd_opt = acc.prepare(nd_model, nd_opt)
    plain = _plain_model(setup, world)
    plain_opt = setup_optimizer(setup, plain.parameters())
    times = {"ndparallel": [], "plain": []}
    losses = {"ndparallel": [], "plain": []}
    for i, micro in enumerate(make_global_batches(setup)):
        mb = local_micro_batch(acc, micro[0])
        order = ("ndparallel", "plain") if i % 2 == 0 else ("plain", "ndparallel")
        for who in order:
            dist.barrier()
            t0 = time.perf_counter()
            if who == "ndparallel":
                loss = nd_step(acc, nd_model, nd_opt, mb)
            else:
                loss = _plain_step(plain, plain_opt, mb, dist.group.WORLD)
            dist.barrier()
            if i >= warmup:
                times[who].append(time.perf_counter() - t0)
            losses[who].append(float(loss))
    return {"times": times, "losses": losses}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4, help="global micro-batch rows")
    ap.add_argument(
        "--loss",
        choices=("chunked", "logits"),
        default="chunked",
        help="ndparallel's loss: chunked (its default) or the logits (the plain loop's math)",
    )
    args = ap.parse_args(argv)
    r = run_on_ranks(
        _run,
        args.world,
        args.world,
        args.steps,
        args.seq,
        args.rows,
        args.warmup,
        args.loss == "chunked",
        timeout_s=900,
    )[0]
    nd, pl = statistics.median(r["times"]["ndparallel"]), statistics.median(r["times"]["plain"])
    # Paired: each ndparallel step against the plain step next to it (robust to load drifts).
    paired = statistics.median(a / b for a, b in zip(r["times"]["ndparallel"], r["times"]["plain"]))
    loss_diff = max(abs(a - b) for a, b in zip(r["losses"]["ndparallel"], r["losses"]["plain"]))
    print_table(
        f"step time, FSDP {args.world}, quickstart-llama, seq {args.seq}, {args.loss} loss, "
        f"{args.rows} rows, {args.steps} alternated steps",
        ["loop", "median ms", "min ms", "ratio"],
        [
            ("plain PyTorch", pl * 1e3, min(r["times"]["plain"]) * 1e3, 1.0),
            ("ndparallel", nd * 1e3, min(r["times"]["ndparallel"]) * 1e3, nd / pl),
        ],
    )
    print(
        f"median of paired step ratios: {paired:.3f}; ratio of minima: "
        f"{min(r['times']['ndparallel']) / min(r['times']['plain']):.3f}"
    )
    print(
        f"max |loss difference| over the steps: {loss_diff:.2e} (same model and data; "
        f"{'the same math' if args.loss == 'logits' else 'chunked vs full-logits loss: fp32 rounding'})"
    )
    path = write_json(
        "overhead" if args.loss == "chunked" else "overhead_logits",
        {
            "settings": vars(args),
            "median_s": {"ndparallel": nd, "plain": pl},
            "ratio": nd / pl,
            "paired_ratio": paired,
            "max_loss_diff": loss_diff,
            **r,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Bytes per training step per rank for each layout, measured with ``CommProfiler``, against the
analytic floor of that layout.

Convention (``ndparallel.runtime.comm_profile``): bytes one rank passes *into* each collective (the shard
for all-gather, the full tensor for reduce-scatter/all-reduce, the buffer for send). The floor
uses the same convention and counts only what the layout cannot avoid (fp32, P parameters,
A = tokens per rank × hidden × 4 B, kv = 2 × tokens per rank × kv_heads × head_dim × 4 B):

* DP r:       all-reduce of the gradients over dp_replicate: 4P
* FSDP n:     all-gather of each parameter once (4P/n) + reduce-scatter of the gradients (4P)
* HSDP r×n:   FSDP n + all-reduce of the reduced shard over dp_replicate (4P/n)
* TP t:       Megatron: 2 all-reduces per layer forward + 2 backward, embedding output (fwd) and
              LM-head input gradient (bwd): (4L + 2) × A
* SP t:       each of those all-reduces becomes all-gather (A/t in) + reduce-scatter (A in)
* CP c ring:  FSDP over cp + per layer K/V sent to the c−1 other ranks and dK/dV returned from
              them: 2 (c−1) kv sends
* CP c allgather: FSDP over cp + per layer one all-gather of K/V (kv in) and one reduce-scatter
              of dK/dV (c·kv in)
* CP c ulysses: FSDP over cp + per layer Q, K, V (K/V heads raised to c when fewer) and the
              output all-to-all'd forward and their gradients backward, + int32 positions gathered

Received bytes (recv) are the mirror of sends and are left out of the totals. Everything
measured above the floor is listed per (dim, op) as excess, to be explained
(docs/benchmarks.md). Run: ``python bench/communication.py [--seq 64]``.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402,F401  (imported once before forking the ranks)
from _common import layout_world, local_micro_batch, nd_step, print_table, write_json  # noqa: E402

from ndparallel.runtime.comm_profile import CommProfiler  # noqa: E402
from ndparallel.testing import run_on_ranks  # noqa: E402


def layouts():
    """name -> (ParallelismConfig kwargs, Accelerator option kwargs)."""
    from ndparallel.parallel.options import FSDPOptions

    out = {
        "DP 2": ({"dp_replicate_size": 2}, {}),
        "FSDP 2": ({"dp_shard_size": 2}, {}),
        "FSDP 2 no-reshard": (
            {"dp_shard_size": 2},
            {"fsdp_options": FSDPOptions(reshard_after_forward=False)},
        ),
        "FSDP 4": ({"dp_shard_size": 4}, {}),
        "HSDP 2x2": ({"dp_replicate_size": 2, "dp_shard_size": 2}, {}),
    }
    try:
        from ndparallel.parallel.options import TPOptions
        from ndparallel.parallel.tp import tensor  # noqa: F401

        out["TP 2"] = ({"tp_size": 2}, {"tp_options": TPOptions()})
        out["SP 2 (+loss parallel)"] = (
            {"tp_size": 2},
            {"tp_options": TPOptions(sequence_parallel=True, loss_parallel=True)},
        )
    except ImportError:
        pass
    try:
        from ndparallel.parallel.cp import context  # noqa: F401
        from ndparallel.parallel.options import CPOptions

        out["CP 2 ring"] = ({"cp_size": 2}, {"cp_options": CPOptions(comm_strategy="ring")})
        out["CP 2 allgather"] = ({"cp_size": 2}, {"cp_options": CPOptions(comm_strategy="allgather")})
        out["CP 2 ulysses"] = ({"cp_size": 2}, {"cp_options": CPOptions(comm_strategy="ulysses")})
        out["CP 4 ring"] = ({"cp_size": 4}, {"cp_options": CPOptions(comm_strategy="ring")})
        out["CP 4 allgather"] = ({"cp_size": 4}, {"cp_options": CPOptions(comm_strategy="allgather")})
        out["CP 4 ulysses"] = ({"cp_size": 4}, {"cp_options": CPOptions(comm_strategy="ulysses")})
    except ImportError:
        pass
    return out


def _measure(layout, options, seq, rows, steps=2):
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.presets import preset_config
    from ndparallel.tools.equivalence import (
        TrainSetup,
        build_model,
        make_global_batches,
        setup_optimizer,
    )

    setup = TrainSetup(preset_config("tiny-llama"), steps=steps, global_micro_batch=rows, seq_len=seq)
    acc = Accelerator(ParallelismConfig(**layout), **options)
    model = build_model(setup)
    n_params = sum(p.numel() for p in model.parameters())
    opt = setup_optimizer(setup, model.parameters())
    model, opt = acc.prepare(model, opt)
    with CommProfiler(acc.torch_device_mesh) as prof:
        for micro in make_global_batches(setup):
            nd_step(acc, model, opt, local_micro_batch(acc, micro[0]))
            prof.step()
    labels = {d: prof.label(d) for d in ("dp_replicate", "dp_shard_cp", "tp", "cp")}
    return {"calls": prof.calls(steps - 1), "labels": labels, "n_params": n_params, "aliases": prof.aliases()}


def floor(name, layout, cfg, seq, rows, n_params):
    """(planner dim, op) -> floor bytes per rank per step (see module docstring)."""
    r, n = layout.get("dp_replicate_size", 1), layout.get("dp_shard_size", 1)
    c, t = layout.get("cp_size", 1), layout.get("tp_size", 1)
    dp = r * n
    tokens = rows // dp * seq // c
    P, L = n_params, cfg.num_hidden_layers
    out: dict = defaultdict(int)
    fsdp = n * c
    if fsdp > 1:
        out[("dp_shard_cp", "all_gather")] += 4 * P // (fsdp * t)
        out[("dp_shard_cp", "reduce_scatter")] += 4 * P // t
    if r > 1:
        out[("dp_replicate", "all_reduce")] += 4 * P // (fsdp * t)
    A = tokens * cfg.hidden_size * 4
    if t > 1 and name.startswith("SP"):
        out[("tp", "all_gather")] += (4 * L + 2) * A // t
        out[("tp", "reduce_scatter")] += (4 * L + 2) * A
    elif t > 1:
        out[("tp", "all_reduce")] += (4 * L + 2) * A
    d = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * tokens * cfg.num_key_value_heads * d * 4
    if c > 1 and "ring" in name:
        out[("cp", "send")] += 2 * (c - 1) * kv * L
    elif c > 1 and "ulysses" in name:  # Q,K,V and output there and back (K/V heads raised to c)
        qkv = tokens * (cfg.num_attention_heads + 2 * max(cfg.num_key_value_heads, c)) * d * 4
        out[("cp", "all_to_all")] += 2 * (qkv + tokens * cfg.num_attention_heads * d * 4) * L
        out[("cp", "all_gather")] += tokens * 4 * L  # int32 position ids (document masks)
    elif c > 1:
        out[("cp", "all_gather")] += kv * L
        out[("cp", "reduce_scatter")] += c * kv * L
    return dict(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4, help="global micro-batch rows")
    ap.add_argument("--only", default=None, help="comma-separated layout names")
    args = ap.parse_args(argv)
    from ndparallel.models.presets import preset_config

    cfg = preset_config("tiny-llama")
    table, results = [], {}
    for name, (layout, options) in layouts().items():
        if args.only and name not in args.only.split(","):
            continue
        try:
            per_rank = run_on_ranks(
                _measure, layout_world(layout), layout, options, args.seq, args.rows, timeout_s=300
            )
        except Exception as exc:  # a strategy under construction must not stop the others
            print(f"{name}: failed: {str(exc).splitlines()[0:3]}")
            results[name] = {"error": str(exc)[:2000]}
            continue
        m = per_rank[0]
        labels = m["labels"]
        measured: dict = defaultdict(int)
        recv = 0
        for (dim, op, b), k in m["calls"].items():
            if op == "recv":  # the mirror of a send: counted once, on the sending side
                recv += b * k
            else:
                measured[(dim, op)] += b * k
        fl: dict = defaultdict(int)  # dims sharing a group (cp = dp_shard_cp at dp_shard 1) add up
        for (d, op), b in floor(name, layout, cfg, args.seq, args.rows, m["n_params"]).items():
            fl[(labels.get(d, d), op)] += b
        total, total_floor = sum(measured.values()), sum(fl.values())
        excess = {
            f"{d}/{op}": measured.get((d, op), 0) - fl.get((d, op), 0)
            for d, op in set(measured) | set(fl)
            if measured.get((d, op), 0) != fl.get((d, op), 0)
        }
        excess = dict(sorted(excess.items(), key=lambda kv: -abs(kv[1])))
        per_rank_total = [
            sum(b * k for (_, op, b), k in r["calls"].items() if op != "recv") for r in per_rank
        ]
        results[name] = {
            "layout": layout,
            "bytes_per_step_rank0": total,
            "floor": total_floor,
            "recv_bytes": recv,
            "ratio": total / total_floor if total_floor else None,
            "bytes_per_rank": per_rank_total,
            "measured": {f"{d}/{op}": b for (d, op), b in sorted(measured.items())},
            "floor_items": {f"{d}/{op}": b for (d, op), b in sorted(fl.items())},
            "excess": excess,
            "aliases": m["aliases"],
        }
        top = ", ".join(f"{k} {v:+,}" for k, v in list(excess.items())[:3])
        table.append(
            (
                name,
                total,
                total_floor,
                total / total_floor if total_floor else float("nan"),
                max(per_rank_total),
                top or "-",
            )
        )
    print_table(
        f"bytes per step per rank (tiny-llama fp32, seq {args.seq}, {args.rows} rows/step)",
        ["layout", "measured B", "floor B", "ratio", "max rank B", "largest excess (B)"],
        table,
    )
    path = write_json("communication", {"settings": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

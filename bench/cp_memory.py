"""Context-parallel benchmark: attention activation memory per rank (cp = 1, 2, 4; cp=1 also with
HF's sdpa) at a fixed sequence length, and ring vs allgather step time.

Memory is measured exactly, not sampled: every tensor the forward saves for backward is counted
once per storage through ``torch.autograd.graph.saved_tensors_hooks`` — inside the attention
function only ("attention") and over the whole forward ("all activations"). Step time is the
median of fwd + bwd + grad all-reduce over the timed steps (on a 2-core CPU, 4 ranks share 2 cores,
so times above cp=2 measure contention as much as the algorithm).

    python bench/cp_memory.py --seq 1024 --cps 1,2,4 --steps 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers  # noqa: F401  (imported once before forking the ranks)

from ndparallel.testing import run_on_ranks


class _SavedBytes:
    """Bytes of distinct storages saved for backward while active."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def __enter__(self):
        def pack(t):
            s = t.untyped_storage()
            self.storages[s.data_ptr()] = s.nbytes()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _rank(seq: int, strategy: str, steps: int, preset: str, batch: int):
    import torch.distributed as dist
    from transformers import AttentionInterface, AutoModelForCausalLM

    from ndparallel import ParallelismConfig
    from ndparallel.models.presets import preset_config
    from ndparallel.parallel.cp.context import context_parallel_buffers, make_attention_fn
    from ndparallel.parallel.options import CPOptions

    cp = dist.get_world_size()
    mesh = ParallelismConfig(cp_size=cp).build_device_mesh("cpu")["cp"]
    group = mesh.get_group()
    torch.manual_seed(0)
    config = preset_config(preset)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Our attention (``cp=1``: the same op without communication) or HF's sdpa as a baseline,
    # wrapped to count what the attention alone saves for backward.
    if strategy == "sdpa":
        inner = AttentionInterface().get_interface("sdpa", None)
    else:
        inner = make_attention_fn(mesh, CPOptions(comm_strategy=strategy))
    attn_meter, whole = _SavedBytes(), _SavedBytes()

    def measured(*args, **kwargs):
        with attn_meter:  # innermost hooks win: report the attention's tensors to both meters
            out = inner(*args, **kwargs)
        whole.storages.update(attn_meter.storages)
        return out

    name = f"bench_cp_{strategy}_pg{group.group_name}"
    AttentionInterface.register(name, measured)
    model.set_attn_implementation(name)

    g = torch.Generator().manual_seed(1)
    times, attn_bytes, all_bytes = [], 0, 0
    for step in range(steps + 1):
        ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g)
        b = {
            "input_ids": ids[:, :-1].clone(),
            "shift_labels": ids[:, 1:].clone(),
            "position_ids": torch.arange(seq).expand(batch, seq).clone(),
        }
        dist.barrier()
        t0 = time.perf_counter()
        with context_parallel_buffers(mesh, list(b.values()), [1, 1, 1]):
            attn_meter.storages.clear()
            whole.storages.clear()
            with whole:
                logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), b["shift_labels"].flatten(), reduction="sum"
                ) / (batch * seq)
            loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
        model.zero_grad(set_to_none=True)
        if step > 0:  # the first step is warm-up
            times.append(time.perf_counter() - t0)
        attn_bytes, all_bytes = attn_meter.total, whole.total
    return {"attn_bytes": attn_bytes, "all_bytes": all_bytes, "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--preset", default="tiny-llama")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cp_memory.json"))
    args = ap.parse_args()
    rows = []
    for cp in (int(c) for c in args.cps.split(",")):
        for strategy in ["ring", "allgather"] if cp > 1 else ["sdpa", "ring"]:
            res = run_on_ranks(
                _rank, cp, args.seq, strategy, args.steps, args.preset, args.batch, timeout_s=600
            )
            rows.append(
                {
                    "cp": cp,
                    "strategy": strategy,
                    "seq": args.seq,
                    "attn_MiB_per_rank": max(r["attn_bytes"] for r in res) / 2**20,
                    "act_MiB_per_rank": max(r["all_bytes"] for r in res) / 2**20,
                    "step_ms": 1e3 * max(r["step_s"] for r in res),
                }
            )
    base = next(r for r in rows if r["cp"] == 1 and r["strategy"] == "ring")["attn_MiB_per_rank"]
    print(
        f"{'cp':>3} {'strategy':>10} {'attn MiB/rank':>14} {'vs cp1':>7} {'all act MiB/rank':>17} "
        f"{'step ms':>8}"
    )
    for r in rows:
        print(
            f"{r['cp']:>3} {r['strategy']:>10} {r['attn_MiB_per_rank']:>14.2f} "
            f"{r['attn_MiB_per_rank'] / base:>7.3f} {r['act_MiB_per_rank']:>17.2f} {r['step_ms']:>8.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "preset": args.preset,
        "batch": args.batch,
        "steps": args.steps,
        "torch": torch.__version__,
        "threads_per_rank": 1,
        "note": "CPU gloo; ranks share the machine's cores",
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Memory benchmark of FSDP sharding and of ``acc.load_model``'s sharded loading.

(a) Training state per rank: parameter + gradient + AdamW-state bytes held by one rank (local
    shards, after one step) against total / N, for FSDP 1, 2, 4 on a small Llama.
(b) Host memory while loading: a Llama of a few hundred MB (fp32) is saved to a temp dir; each rank
    then measures its RSS increase during the load: baseline = VmRSS after imports and process-group
    start, peak = VmHWM after the load, with the high-water mark reset first
    (``/proc/self/clear_refs`` ← 5), so it is the exact kernel peak, not a sample. Compared: plain
    ``from_pretrained`` in one process, and ``acc.load_model`` under FSDP 1, 2, 4.
    mmap'ed safetensors pages a rank reads count in its RSS, as they should.

(c) LoRA (r 16 on every linear, PEFT): per rank, the frozen base shard and the train state
    (adapter parameters + gradients + AdamW states) against adapter-only / N, for FSDP 1, 2, 4 —
    next to the full fine-tune's train state of (a).

(d) Host memory against dataset size (the memory-mapped token store): ``bench/data_memory.py``.

Every measurement runs in freshly forked ranks (``run_on_ranks``); the checkpoint is written by a
child too, so no rank inherits memory the parent freed.

    python bench/memory.py                  # table + bench/results/memory.json
    python bench/memory.py --hidden 1024 --layers 12   # a bigger model
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import transformers  # noqa: F401  (imported once before forking the ranks)

try:
    import peft  # noqa: F401  (for (c); imported once before forking the ranks)
except ImportError:
    peft = None

from ndparallel.testing import run_on_ranks

MB = 2**20


def _llama_config(hidden: int, layers: int, vocab: int, intermediate: int):
    from ndparallel.models.presets import preset_config

    heads = max(1, hidden // 64)
    return preset_config(
        "tiny-llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=vocab,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
    )


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


# -------------------------------------------------------------------------------- (a) training
def _train_state(config, fsdp: int) -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=fsdp))
    model = acc.load_model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    params = list(model.parameters())
    total_numel = sum(p.numel() for p in params)  # DTensor.numel() is the global size
    return dict(
        params=sum(_local_bytes(p) for p in params),
        grads=sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        optim=sum(
            _local_bytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ),
        total_param_bytes=total_numel * 4,
    )


def bench_training_state(config, sizes) -> list[dict]:
    rows = []
    for n in sizes:
        per_rank = run_on_ranks(_train_state, n, config, n)
        worst = max(per_rank, key=lambda r: r["params"] + r["grads"] + r["optim"])
        total = worst["total_param_bytes"] * 4  # fp32 params + grads + AdamW exp_avg, exp_avg_sq
        held = worst["params"] + worst["grads"] + worst["optim"]
        rows.append(
            dict(
                fsdp=n,
                bytes_per_rank=held,
                total_over_n=total / n,
                ratio=held / (total / n),
                params=worst["params"],
                grads=worst["grads"],
                optim=worst["optim"],
                total=total,
            )
        )
    return rows


# ------------------------------------------------------------------------------------ (c) LoRA
def _lora_state(config, fsdp: int, r: int) -> dict:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.adapters import lora_config

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=fsdp))
    model = acc.load_model(config, adapter=lora_config(r=r, alpha=2 * r, target_linear=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return dict(
        base=sum(_local_bytes(p) for p in params if not p.requires_grad),
        adapter=sum(_local_bytes(p) for p in trainable),
        grads=sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        optim=sum(
            _local_bytes(v)
            for s in opt.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ),
        adapter_numel=sum(p.numel() for p in trainable),
        frozen_grads=sum(p.grad is not None for p in params if not p.requires_grad),
    )


def bench_lora_state(config, sizes, r: int = 16) -> list[dict]:
    rows = []
    for n in sizes:
        per_rank = run_on_ranks(_lora_state, n, config, n, r)
        worst = max(per_rank, key=lambda x: x["adapter"] + x["grads"] + x["optim"])
        held = worst["adapter"] + worst["grads"] + worst["optim"]
        adapter_only = worst["adapter_numel"] * (4 + 4 + 8) / n  # fp32 param + grad + AdamW m, v
        rows.append(
            dict(
                fsdp=n,
                base_per_rank=worst["base"],
                train_state_per_rank=held,
                adapter_only_over_n=adapter_only,
                ratio=held / adapter_only,
                adapter_params=worst["adapter_numel"],
                grads=worst["grads"],
                optim=worst["optim"],
                frozen_with_grad=worst["frozen_grads"],
            )
        )
    return rows


# --------------------------------------------------------------------------------- (b) loading
def _save_checkpoint(config, path: str) -> int:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _load_rss(path: str, how: str, fsdp: int) -> dict:
    import gc
    import time

    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=fsdp)) if how != "hf" else None
    # The baseline is taken after every import both paths need (~70 MB of modules otherwise).
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import ndparallel.models.loading  # noqa: F401

    gc.collect()
    base_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
    t = time.perf_counter()
    if how == "hf":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = acc.load_model(path)
    seconds = time.perf_counter() - t
    load_peak_kb = _status_kb("VmHWM")
    # from_pretrained may leave weights as untouched mmap views of the file; read every parameter
    # so both paths are compared with the model actually in memory.
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).sum()
    peak_kb = _status_kb("VmHWM")
    local = sum(_local_bytes(p) for p in model.parameters())
    return dict(
        increase=(peak_kb - base_kb) * 1024,
        load_only=(load_peak_kb - base_kb) * 1024,
        local_param_bytes=local,
        seconds=seconds,
    )


def bench_loading(config, sizes) -> tuple[int, list[dict]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_bytes = run_on_ranks(_save_checkpoint, 1, config, tmp)[0]
        cases = [("from_pretrained (1 process)", "hf", 1)] + [
            (f"load_model FSDP {n}", "nd", n) for n in sizes
        ]
        for label, how, n in cases:
            per_rank = run_on_ranks(_load_rss, n, tmp, how, n, timeout_s=600)
            worst = max(r["increase"] for r in per_rank)
            rows.append(
                dict(
                    layout=label,
                    ranks=n,
                    peak_increase_max=worst,
                    peak_increase_per_rank=[r["increase"] for r in per_rank],
                    ratio=worst / model_bytes,
                    load_only_max=max(r["load_only"] for r in per_rank),
                    local_param_bytes=per_rank[0]["local_param_bytes"],
                    seconds=max(r["seconds"] for r in per_rank),
                )
            )
    return model_bytes, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--sizes", default="1,2,4", help="FSDP degrees")
    ap.add_argument("--no-loading", action="store_true", help="skip (b), the host-memory load test")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    small = _llama_config(256, 4, 8192, 688)
    train_rows = bench_training_state(small, sizes)
    print("(a) parameter + gradient + AdamW bytes per rank (fp32, small Llama, worst rank)")
    print(f"{'FSDP':>5} {'held MB':>9} {'total/N MB':>11} {'ratio':>6}")
    for r in train_rows:
        print(
            f"{r['fsdp']:>5} {r['bytes_per_rank'] / MB:>9.2f} {r['total_over_n'] / MB:>11.2f} "
            f"{r['ratio']:>6.3f}"
        )

    lora_rows = bench_lora_state(small, sizes) if peft is not None else []
    print(
        "\n(c) LoRA r=16 on every linear (PEFT), fp32, small Llama, worst rank: the train state is the "
        "adapters'"
    )
    print(
        f"{'FSDP':>5} {'frozen base MB':>15} {'train state MB':>15} {'adapter-only/N MB':>18} "
        f"{'ratio':>6} {'full FT state MB':>17}"
    )
    for r, full in zip(lora_rows, train_rows):
        print(
            f"{r['fsdp']:>5} {r['base_per_rank'] / MB:>15.2f} {r['train_state_per_rank'] / MB:>15.3f} "
            f"{r['adapter_only_over_n'] / MB:>18.3f} {r['ratio']:>6.3f} {full['bytes_per_rank'] / MB:>17.2f}"
        )

    big = _llama_config(args.hidden, args.layers, args.vocab, args.intermediate)
    model_bytes, load_rows = (0, []) if args.no_loading else bench_loading(big, sizes)
    if load_rows:
        print(
            f"\n(b) host peak RSS increase per rank while loading a {model_bytes / MB:.0f} MB fp32 "
            f"Llama (worst rank; goal for FSDP 4: <= 0.35 x model)"
        )
        print("  peak = VmHWM - VmRSS before the load, after the load and a read of every parameter;")
        print("  'load only' = the same before that read (from_pretrained may leave params as mmap views)")
        print(
            f"{'layout':<28} {'peak MB':>8} {'x model':>8} {'load only MB':>13} "
            f"{'local params MB':>16} {'load s':>7}"
        )
        for r in load_rows:
            print(
                f"{r['layout']:<28} {r['peak_increase_max'] / MB:>8.1f} {r['ratio']:>8.3f} "
                f"{r['load_only_max'] / MB:>13.1f} {r['local_param_bytes'] / MB:>16.1f} "
                f"{r['seconds']:>7.2f}"
            )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    loading = dict(model=big.to_dict(), model_bytes=model_bytes, rows=load_rows)
    if args.no_loading and out.is_file():  # keep the last measured (b)
        loading = json.loads(out.read_text()).get("loading", loading)
    out.write_text(
        json.dumps(
            dict(
                training_state=dict(model=small.to_dict(), rows=train_rows),
                lora_state=dict(model=small.to_dict(), r=16, rows=lora_rows),
                loading=loading,
                torch=torch.__version__,
            ),
            indent=1,
            default=str,
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

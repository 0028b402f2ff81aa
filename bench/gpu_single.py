"""Single-GPU bf16 training of a ~1.2B Llama-style model (Llama-3.2-1B shape, random init):
tokens/s and MFU, ndparallel vs a plain-PyTorch loop making the same FSDP2 calls (1-rank mesh,
bf16 params, fp32 reduce), alternated in one run. Prints that it skipped when CUDA is absent.

MFU = (6 N + 12 L h s) × tokens/s / peak bf16 dense FLOP/s (N: matmul parameters incl. LM head).

    python bench/gpu_single.py --seq 2048 --batch 4 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def llama_1b_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                      vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    from _common import print_table, write_json

    if not torch.cuda.is_available():
        print("gpu_single: skipped (no CUDA device)")
        write_json("gpu_single", {"skipped": "no CUDA device"})
        return
    import os

    import torch.distributed as dist
    import torch.nn.functional as F
    from _common import nd_step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cfg = llama_1b_config()
    acc = Accelerator(ParallelismConfig(), mixed_precision="bf16", device="cuda")
    dev = acc.device

    def build():
        torch.manual_seed(0)
        with torch.device(dev):
            return AutoModelForCausalLM.from_config(cfg).float()

    nd_model = build()
    n_matmul = sum(p.numel() for n, p in nd_model.named_parameters() if p.dim() == 2
                   and "embed" not in n) + cfg.vocab_size * cfg.hidden_size
    nd_opt = torch.optim.AdamW(nd_model.parameters(), lr=1e-4, fused=True)
    nd_model, nd_opt = acc.prepare(nd_model, nd_opt)

    plain = build()
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("plain",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in plain.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(plain, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)

    def plain_step(mb):
        labels = mb["shift_labels"]
        n = (labels != -100).sum()
        logits = plain(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        plain_opt.step()
        plain_opt.zero_grad()

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    mb = {"input_ids": tokens[:, :-1].to(dev), "shift_labels": tokens[:, 1:].to(dev),
          "position_ids": torch.arange(args.seq).expand(args.batch, -1).to(dev)}
    times = {"ndparallel": [], "plain": []}
    for i in range(args.steps + args.warmup):
        for who in (("ndparallel", "plain") if i % 2 == 0 else ("plain", "ndparallel")):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            nd_step(acc, nd_model, nd_opt, mb) if who == "ndparallel" else plain_step(mb)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times[who].append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name)
    flops_per_token = 6 * n_matmul + 12 * cfg.num_hidden_layers * cfg.hidden_size * args.seq
    rows, out = [], {}
    for who, ts in times.items():
        tps = args.batch * args.seq / statistics.median(ts)
        mfu = flops_per_token * tps / peak if peak else None
        out[who] = {"step_s": statistics.median(ts), "tokens_per_s": tps, "mfu": mfu}
        rows.append((who, statistics.median(ts) * 1e3, tps, mfu if mfu is not None else "n/a"))
    ratio = out["ndparallel"]["step_s"] / out["plain"]["step_s"]
    rows.append(("ratio nd/plain", ratio, "", ""))
    print_table(f"{name}: ~{n_matmul / 1e9:.2f}B matmul params, bf16, seq {args.seq}, batch {args.batch}",
                ["loop", "step ms", "tokens/s", "MFU"], rows)
    print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    write_json("gpu_single", {"settings": vars(args), "device": name, "results": out, "ratio": ratio,
                              "n_matmul_params": n_matmul})
    acc.end_training() if dist.is_initialized() else None


if __name__ == "__main__":
    main()

"""Bytes a decoder layer keeps for backward per token under TP + sequence parallel, measured.

Rank 0 of a fake TP world (``runtime/fake_world.py``: collectives move no data, every tensor's
shape and every kernel is real) runs one bf16 forward + backward of a Llama-shaped model;
``tools/kept_bytes.py`` records the storages layer 0's ops create and counts those still alive at
the end of the forward — what is kept for backward, including what activation checkpointing holds
by reference (saved-tensor hooks do not see that). For each tp, three ways: block inputs saved
gathered (before ``parallel/tp/sp_saves.py``), saved as sequence shards (the default), and shards
+ ``ac_policy: selective`` (``techniques/selective_ac.py``), beside the planner's figure for each
and Megatron's ``34·h/t`` (Korthikanti et al. 2022: SP + selective recompute, GPT-shaped layer);
and selective + activation offloading (``techniques/offload.py``): what stays on the device and
what goes to host memory.
RoPE's cos/sin (model-level, shared by all layers) are not a layer's; tensors with two
sequence-length dims (a math attention path's scores; a flash kernel keeps none) are shown apart.

    python bench/sp_activation_memory.py                      # CPU, tp 1,2,4,8
    python bench/sp_activation_memory.py --device cuda        # one GPU (bench/gpu_all.sh step sp_memory)
    python bench/sp_activation_memory.py --tiny               # the suite's smoke form
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import print_table, write_json  # noqa: E402

from ndparallel.testing import run_on_ranks  # noqa: E402


def _measure(tp: int, mode: str, shape: dict, batch: int, seq: int, device: str) -> dict:
    """Bytes per token layer 0 keeps, ``mode`` 'gathered' | 'shards' | 'selective' (shards + AC) |
    'selective_offload' (+ activation offloading: ``per_token`` what stays on the device,
    ``host_per_token`` what went to the host; every saved tensor counts, ``min_bytes=1``: at real
    sizes none is under the runtime's 1 KiB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ndparallel.layout.config import ParallelismConfig
    from ndparallel.parallel.options import TPOptions
    from ndparallel.parallel.tp.tensor import apply_tensor_parallel
    from ndparallel.runtime.distributed import shutdown
    from ndparallel.runtime.fake_world import start_fake_world
    from ndparallel.techniques.offload import apply_activation_offloading
    from ndparallel.techniques.selective_ac import apply_selective_checkpointing
    from ndparallel.tools.kept_bytes import KeptBytes

    shutdown()  # the runner's one-rank group: this child is rank 0 of a fake tp world instead
    start_fake_world(tp, 0)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
        mesh = ParallelismConfig(tp_size=tp).build_device_mesh(device)["tp"]
        if tp > 1:
            options = TPOptions(
                sequence_parallel=True, loss_parallel=False, sequence_parallel_saved_shards=mode != "gathered"
            )
            apply_tensor_parallel(model, mesh, options)
        if mode.startswith("selective"):
            apply_selective_checkpointing(model)
        off = None
        if mode == "selective_offload":
            off = apply_activation_offloading(model, device, selective=True, min_bytes=1, max_host_bytes=None)
        kept = KeptBytes()
        kept.square_dim = seq
        layer = model.model.layers[0]
        host = []  # the offloader's host bytes before and after layer 0's forward
        layer.register_forward_pre_hook(lambda *_: (kept.__enter__(), host.append(_host(off))) and None)
        layer.register_forward_hook(
            lambda *_: (kept.__exit__(None, None, None), host.append(_host(off))) and None
        )
        ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=device)
        pos = torch.arange(seq, device=device).expand(batch, -1)
        out = model(input_ids=ids, position_ids=pos).logits
        copies = off.host_copies() if off is not None else []
        total, scores = kept.alive(exclude=list(model.parameters()) + copies)
        (out.to_local() if hasattr(out, "to_local") else out).float().sum().backward()
        tokens = batch * seq
        return {
            "per_token": total / tokens,
            "attention_s2_per_token": scores / tokens,
            "host_per_token": (host[1] - host[0]) / tokens,
        }
    finally:
        shutdown()


def _host(offloader) -> int:
    return offloader.stats.host_bytes if offloader is not None else 0


def _measure_all(jobs: list[tuple]) -> list[dict]:
    """Every (tp, shards, ...) measurement in this one child: one process start for the whole table."""
    return [_measure(*job) for job in jobs]


MODES = ("gathered", "shards", "selective", "selective_offload")
"""What each tp runs: the block inputs saved gathered (before sp_saves), as sequence shards (the
default), shards + ``ac_policy: selective`` (``techniques/selective_ac.py``), and that + activation
offloading (what stays on the device; the host bytes in their own column)."""


def _planned(shape: dict, tp: int, mode: str, seq: int) -> float:
    return _planned_split(shape, tp, mode, seq)[0]


def _planned_split(shape: dict, tp: int, mode: str, seq: int) -> tuple[float, float]:
    """The planner's (device, host) bytes per token of layer 0 in ``mode``; with offloading the
    host also holds RoPE's cos and sin (``2·e·d``), sent by the first layer."""
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.memory.activations import (
        layer_activation_bytes_per_token,
        offload_split_per_token,
        selective_saved_per_token,
    )
    from ndparallel.plan.models import from_hf_config
    from ndparallel.plan.settings import Settings

    spec = from_hf_config({"model_type": "llama", **shape})
    s = Settings(
        sequence_len=seq, sequence_parallel=tp > 1, sequence_parallel_saved_shards=mode != "gathered"
    )
    if mode.startswith("selective"):
        s = Settings(
            sequence_len=seq, sequence_parallel=tp > 1, activation_checkpointing=True, ac_policy="selective"
        )
    if mode == "selective_offload":
        device, host = offload_split_per_token(spec, ParallelDims(tp=tp), s.but(activation_offloading=True))
        return device, host + 2 * s.act_bytes * spec.head_dim
    if mode == "selective":
        return selective_saved_per_token(spec, ParallelDims(tp=tp), s), 0.0
    return layer_activation_bytes_per_token(spec, ParallelDims(tp=tp), s), 0.0


def _shape(args) -> tuple[dict, int, list[int]]:
    h, seq, tps = args.hidden, args.seq, [int(t) for t in args.tps.split(",")]
    if args.tiny:
        h, seq, tps = 128, 32, [1, 2]
    if seq == h:
        raise SystemExit("--seq must differ from --hidden (two seq-length dims mark attention's s² tensors)")
    if h % 64 or h // 64 % max(tps):
        raise SystemExit(f"--hidden must be a multiple of 64 × the largest tp ({max(tps)})")
    heads, d = (4, 16) if args.tiny else (h // 64, 64)
    shape = dict(
        hidden_size=h,
        intermediate_size=int(3.5 * h),  # Llama-3's 14336 / 4096
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=max(max(tps), heads // 4),  # GQA, at least one K/V head per tp rank
        head_dim=d,
        vocab_size=1024,
        max_position_embeddings=max(seq, 128),
    )
    return shape, seq, tps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tps", default="1,2,4,8")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="hidden 128, seq 32, tp 1,2 (the suite's smoke form)")
    args = ap.parse_args(argv)
    shape, seq, tps = _shape(args)
    h, batch = shape["hidden_size"], 1
    jobs = [(tp, m, shape, batch, seq, args.device) for tp in tps for m in MODES if tp > 1 or m != "gathered"]
    measured = dict(zip([(j[0], j[1]) for j in jobs], run_on_ranks(_measure_all, 1, jobs)[0]))
    rows, results = [], []
    for tp in tps:
        got = {m: measured.get((tp, m), measured[(tp, "shards")]) for m in MODES}  # tp 1: no gather
        row = {"tp": tp, "megatron_34h_over_t": 34 * h / tp}
        for m in MODES:
            row[f"{m}_per_token"] = got[m]["per_token"]
            row[f"{m}_attention_s2_per_token"] = got[m]["attention_s2_per_token"]
            row[f"planner_{m}_per_token"] = _planned(shape, tp, m, seq)
        row["selective_offload_host_per_token"] = got["selective_offload"]["host_per_token"]
        planned_host = _planned_split(shape, tp, "selective_offload", seq)[1]
        row["planner_selective_offload_host_per_token"] = planned_host
        results.append(row)
        cells = [f"{row[f'{m}_per_token']:,.0f} ({row[f'planner_{m}_per_token']:,.0f})" for m in MODES]
        s2 = max(row[f"{m}_attention_s2_per_token"] for m in MODES)
        host = (
            f"{row['selective_offload_host_per_token']:,.0f} "
            f"({row['planner_selective_offload_host_per_token']:,.0f})"
        )
        rows.append([tp, *cells, host, f"{row['megatron_34h_over_t']:,.0f}", f"{s2:,.0f}"])
    print_table(
        f"bytes kept per token, decoder layer 0, measured (planner) (h={h}, f={shape['intermediate_size']}, "
        f"seq {seq}, bf16, {args.device})",
        [
            "tp",
            "SP, gathered inputs",
            "SP shards",
            "SP shards + selective AC",
            "+ offloading: device",
            "host",
            "34·h/t",
            "of it s²",
        ],
        rows,
    )
    path = write_json(
        "sp_activation_memory",
        {"device": args.device, "shape": shape, "seq": seq, "batch": batch, "rows": results},
    )
    last = results[-1]
    print(
        f"HEADLINE: tp {last['tp']}: {last['selective_per_token']:,.0f} B/token/layer kept with SP shards + "
        f"selective AC (shards {last['shards_per_token']:,.0f}, gathered {last['gathered_per_token']:,.0f}; "
        f"34·h/t {last['megatron_34h_over_t']:,.0f}); {path.name}"
    )


if __name__ == "__main__":
    main()

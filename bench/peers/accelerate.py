"""Hugging Face Accelerate itself next to ndparallel's drop-in: one training script written against
Accelerate's API, run twice on CPU ranks — with ``accelerate`` imported, then with ``ndparallel`` —
and their per-step losses, tokens/s and peak memory compared.

    python bench/peers/accelerate.py [--layouts fsdp4 hsdp2x2 fsdp2xtp2] [--steps 4]

The script (``train`` below) is the canonical Accelerate loop: ``Accelerator(fsdp_plugin=
FullyShardedDataParallelPlugin(fsdp_version=2, ...))`` or ``parallelism_config=``, a tiny Llama
from ``from_pretrained``, ``prepare(model, optimizer)``, ``model(input_ids, labels=...).loss``,
``accelerator.backward``, ``clip_grad_norm_``, AdamW. Each rank trains its own slice of the same
seeded global batch. Launched with ``torch.distributed.run`` (4 gloo ranks). Printed: the losses of
both (bit-identical is the claim for FSDP 4), tokens/s (steps after the first) and peak RSS per rank
(``ru_maxrss``: the process, libraries included), and the ratios ndparallel / Accelerate. A layout
Accelerate refuses is reported with its own error. bench/reference/peers_accelerate.md holds the dated table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# this file is named after the package it compares with: keep its folder off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

WORLD, SEQ, BATCH, LR = 4, 256, 2, 1e-3
LAYOUTS = {
    "fsdp4": {"dp_shard_size": 4},
    "hsdp2x2": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "fsdp2xtp2": {"dp_shard_size": 2, "tp_size": 2},
}


def make_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)


FORCE_FSDP_ON_CPU = os.environ.get("PEERS_ACCELERATE_AS_IS") != "1"
"""Accelerate enables FSDP only on accelerator device types (``AcceleratorState``: ``MULTI_CPU`` is
not in its list), so on CPU ranks it silently trains with DDP instead. The bench sets the two fields
that branch of Accelerate sets (``distributed_type = FSDP``, ``fsdp_plugin``) and nothing else, so
that ``prepare`` runs Accelerate's own FSDP2 code; ``PEERS_ACCELERATE_AS_IS=1`` runs it as shipped."""


def _fsdp_on_cpu(accelerator, plugin) -> None:
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def train(lib: str, layout: str, model_dir: str, steps: int) -> dict:
    """The Accelerate script; ``lib`` is the package its names are imported from."""
    import importlib

    import torch
    from transformers import AutoModelForCausalLM

    Accelerator = importlib.import_module(lib).Accelerator
    utils = importlib.import_module(f"{lib}.utils")
    sizes = LAYOUTS[layout]
    if layout == "fsdp4":
        plugin = utils.FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            reshard_after_forward=True,
        )
        accelerator = Accelerator(fsdp_plugin=plugin)
        if lib == "accelerate" and FORCE_FSDP_ON_CPU:
            _fsdp_on_cpu(accelerator, plugin)
    else:
        pc = importlib.import_module(f"{lib}.parallelism_config").ParallelismConfig(**sizes)
        plugin = utils.FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
        accelerator = Accelerator(parallelism_config=pc, fsdp_plugin=plugin)
        if lib == "accelerate" and FORCE_FSDP_ON_CPU:
            _fsdp_on_cpu(accelerator, plugin)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = {"device_mesh": mesh} if sizes.get("tp_size", 1) > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    dp = sizes.get("dp_replicate_size", 1) * sizes.get("dp_shard_size", 1)
    dp_rank = accelerator.process_index // (WORLD // dp)
    g = torch.Generator().manual_seed(1234)
    losses, times = [], []
    for _ in range(steps):
        batch = torch.randint(0, 2048, (dp * BATCH, SEQ), generator=g)[
            dp_rank * BATCH : (dp_rank + 1) * BATCH
        ]
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = accelerator.reduce(loss.detach(), "mean")
        times.append(time.perf_counter() - start)
        losses.append(float(mean))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB
    peaks = accelerator.gather(torch.tensor([peak])).tolist()
    tokens = dp * BATCH * SEQ * (steps - 1)
    return {
        "losses": losses,
        "losses_hex": [float.hex(x) for x in losses],
        "tokens_per_s": tokens / sum(times[1:]),
        "peak_rss_mib": max(peaks),
        "wrapped": type(model).__name__,
    }


def worker(lib: str, layout: str, model_dir: str, steps: int, out: str) -> None:
    result = train(lib, layout, model_dir, steps)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(result))


def launch(lib: str, layout: str, model_dir: Path, steps: int, work: Path) -> dict:
    out = work / f"{lib}-{layout}.json"
    env = {**os.environ, "NDPARALLEL_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={WORLD}",
        "--standalone",
        __file__,
        "--worker",
        lib,
        layout,
        str(model_dir),
        str(steps),
        str(out),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not out.exists():
        (work / f"{lib}-{layout}.log").write_text(proc.stderr)
        lines = proc.stderr.splitlines()
        errors = [x for x in lines if re.search(r"^\[rank0\]: \w*(Error|Exception): ", x)] or [
            x for x in lines if re.search(r"\b\w*(Error|Exception): ", x)
        ]
        return {"error": (errors[-1] if errors else proc.stderr[-400:]).strip()[:400]}
    return json.loads(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", nargs=5)
    args = parser.parse_args(argv)
    if args.worker:
        lib, layout, model_dir, steps, out = args.worker
        worker(lib, layout, model_dir, int(steps), out)
        return 0
    import accelerate
    import torch

    work = Path(tempfile.mkdtemp(prefix="peers-accelerate-"))
    make_model(work / "model")
    print(f"accelerate {accelerate.__version__}, torch {torch.__version__}, {WORLD} CPU ranks (gloo)")
    results = {}
    for layout in args.layouts:
        theirs = launch("accelerate", layout, work / "model", args.steps, work)
        ours = launch("ndparallel", layout, work / "model", args.steps, work)
        results[layout] = {"accelerate": theirs, "ndparallel": ours}
        print(f"\n{layout}:", flush=True)
        for name, r in (("accelerate", theirs), ("ndparallel", ours)):
            if "error" in r:
                print(f"  {name:10s} refused / failed: {r['error']}")
            else:
                losses = [f"{x:.6f}" for x in r["losses"]]
                print(
                    f"  {name:10s} losses {losses}  {r['tokens_per_s']:.0f} tok/s  "
                    f"peak RSS {r['peak_rss_mib']:.0f} MiB  ({r['wrapped']})"
                )
        if "error" not in theirs and "error" not in ours:
            same = theirs["losses_hex"] == ours["losses_hex"]
            print(
                f"  losses bit-identical: {same}; tokens/s ratio (ndparallel / accelerate) "
                f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}; peak RSS ratio "
                f"{ours['peak_rss_mib'] / theirs['peak_rss_mib']:.2f}"
            )
    print("\n" + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

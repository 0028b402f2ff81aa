"""Peak memory of one training step vs sequence length on CPU, with each long-context option off/on.

    python bench/long_context.py --out /tmp/lc              # the default lengths, ~2 min on 2 cores
    python bench/long_context.py --seqs 1024,2048 --out DIR # shorter

A small Llama (hidden 128, MLP 512, 4 layers, 4 heads / 2 K/V heads, vocab 256, fp32) trains one
step through ``forward_backward`` (the trainer's step: chunked loss, global token count) in a
fresh forked process per row. *Peak* = the largest sum of tensor storages created during the
step and alive at once (``plan_validation.LiveBytes``: what ``torch.cuda.max_memory_allocated``
adds over the step on a GPU); the offloader's host copies are made outside the tracker and
reported apart (*host*). Each configuration's *slope* is the least-squares bytes per token over
the lengths, next to the planner's slope for the same model and settings (``estimate_memory``:
its peak allocated minus the states present before the step).

A second table is the document attention's scratch alone (``document_causal_attention`` forward +
backward of packed rows, 8 documents per row): blocks written in place (now) vs the fp32
whole-sequence accumulators the merge path uses (what every call used before), in bf16.

Writes ``long_context.json`` into ``--out`` (default: a directory under the system temp dir).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402,F401
from _common import machine, print_table  # noqa: E402
from plan_validation import LiveBytes  # noqa: E402

from ndparallel.testing import run_on_ranks  # noqa: E402

MODEL = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=1 << 20,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
CONFIGS = {  # name: ActivationOptions kwargs
    "plain": {},
    "checkpointing": dict(activation_checkpointing=True),
    "tiled MLP": dict(tiled_mlp=True),
    "ckpt + tiled": dict(activation_checkpointing=True, tiled_mlp=True),
    "ckpt + offload": dict(activation_checkpointing=True, activation_offloading=True),
    "ckpt + tiled + offload": dict(activation_checkpointing=True, tiled_mlp=True, activation_offloading=True),
}


def _untracked_host_copies(offloader) -> None:
    """Make the offloader's host copies outside the dispatch tracker (host memory, not device)."""
    from torch.utils._python_dispatch import _disable_current_modes

    inner = offloader.transfers

    class Untracked:
        device_type = inner.device_type

        def to_host(self, x):
            with _disable_current_modes():
                return inner.to_host(x)

        def to_device(self, host, device):
            return inner.to_device(host, device)

        def wait(self, event):
            inner.wait(event)

    offloader.transfers = Untracked()


def _step(options: dict, seq: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.engine import forward_backward
    from ndparallel.parallel.options import ActivationOptions
    from ndparallel.techniques.offload import offloader_of

    acc = Accelerator(ParallelismConfig(), activation_options=ActivationOptions(**options))
    torch.manual_seed(0)
    model = acc.prepare(AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODEL)))
    model.train()
    off = offloader_of(model)
    if off is not None:
        off.max_host_bytes = None
        _untracked_host_copies(off)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (1, seq + 1), generator=g)
    batch = {
        "input_ids": tokens[:, :-1].contiguous(),
        "shift_labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq).unsqueeze(0),
    }
    t0 = time.perf_counter()
    with LiveBytes() as tracker:
        forward_backward(acc.engine, model, [batch])
    return {
        "peak": tracker.peak,
        "host": off.stats.peak_host_bytes if off else 0,
        "seconds": time.perf_counter() - t0,
    }


def _predicted(options: dict, seq: int) -> float:
    """The planner: peak allocated minus the states present before the step (params, optimizer)."""
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.hardware import get_preset
    from ndparallel.plan.memory.peak import estimate_memory
    from ndparallel.plan.models import from_hf_config
    from ndparallel.plan.settings import Settings

    spec = from_hf_config(MODEL, "bench")
    s = Settings(
        sequence_len=seq,
        mixed_precision="fp32",
        optimizer="sgd",
        chunked_loss=True,
        activation_checkpointing=options.get("activation_checkpointing", False),
        tiled_mlp=options.get("tiled_mlp", False),
        activation_offloading=options.get("activation_offloading", False),
    )
    m = estimate_memory(spec, ParallelDims(), s, get_preset("h100-80gb"))
    return m.allocated - m.params - m.optimizer


def _slope(xs, ys) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _attention_scratch(seq: int, in_place: bool) -> int:
    """Peak bytes created by one document attention forward + backward (bf16, 8 heads / 2 K/V,
    d 64, 8 documents), the output and the inputs' gradients included."""
    from unittest import mock

    from ndparallel.parallel.cp import attention_blocks
    from ndparallel.parallel.document_attention import document_causal_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, seq, 64, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, seq, 64, generator=g).bfloat16().requires_grad_() for _ in range(2))
    pos = torch.arange(seq) % (seq // 8)
    dout = torch.randn(1, 8, seq, 64, generator=g).bfloat16()
    squares_only = mock.patch.object(attention_blocks, "_squares_only", lambda groups: in_place)
    with squares_only, LiveBytes() as tracker:
        document_causal_attention(q, k, v, pos.unsqueeze(0)).backward(dout)
    return tracker.peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192", help="sequence lengths")
    ap.add_argument("--attention-seqs", default="4096,16384", help="lengths of the attention-scratch table")
    ap.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument(
        "--out",
        default=str(Path(tempfile.gettempdir()) / "ndparallel-bench"),
        help="directory for long_context.json (default: under the system temp dir)",
    )
    args = ap.parse_args(argv)
    seqs = [int(x) for x in args.seqs.split(",")]
    names = args.only.split(",") if args.only else list(CONFIGS)
    rows, results = [], {}
    for name in names:
        got = [run_on_ranks(_step, 1, CONFIGS[name], s, timeout_s=1800)[0] for s in seqs]
        pred = [_predicted(CONFIGS[name], s) for s in seqs]
        slope, pslope = _slope(seqs, [g["peak"] for g in got]), _slope(seqs, pred)
        host_slope = _slope(seqs, [g["host"] for g in got])
        results[name] = {
            "options": CONFIGS[name],
            "seq": seqs,
            "runs": got,
            "predicted": pred,
            "slope_bytes_per_token": slope,
            "predicted_slope": pslope,
            "host_slope_bytes_per_token": host_slope,
        }
        rows.append(
            [
                name,
                *(f"{g['peak'] / 2**20:.1f}" for g in got),
                f"{slope:,.0f}",
                f"{pslope:,.0f}",
                f"{host_slope:,.0f}",
                f"{got[-1]['seconds']:.2f}",
            ]
        )
    print_table(
        f"Peak memory of one step (MiB) vs sequence length; {MODEL['num_hidden_layers']} layers, "
        f"h {MODEL['hidden_size']}, f {MODEL['intermediate_size']}, fp32",
        [
            "config",
            *(f"{s:,}" for s in seqs),
            "B/token",
            "planner B/token",
            "host B/token",
            f"s at {seqs[-1]:,}",
        ],
        rows,
    )
    attn = []
    for s in (int(x) for x in args.attention_seqs.split(",")):
        before, after = (run_on_ranks(_attention_scratch, 1, s, flag)[0] for flag in (False, True))
        attn.append({"seq": s, "merged_fp32": before, "in_place": after})
    print_table(
        "Document attention forward + backward, peak MiB (8 heads / 2 K/V, d 64, bf16, 8 documents)",
        ["seq", "fp32 accumulators (merge path)", "blocks in place"],
        [[f"{a['seq']:,}", f"{a['merged_fp32'] / 2**20:.1f}", f"{a['in_place'] / 2**20:.1f}"] for a in attn],
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "long_context.json"
    path.write_text(
        json.dumps(
            {"machine": machine(), "model": MODEL, "configs": results, "attention_scratch": attn},
            indent=2,
            default=str,
        )
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

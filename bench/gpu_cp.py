"""CP attention kernels on one device: exact against fp64 SDPA, and how fast against torch's flash SDPA.

    python bench/gpu_cp.py                 # CUDA if visible (≈1 min on an H200), else CPU (small sizes)
    python bench/gpu_cp.py --device cpu    # the same logic, small sizes, seconds
    python bench/gpu_cp.py --tiny          # CPU, smallest sizes (bench/gpu_all.sh --cpu-smoke)

1. Exactness (out, dQ, dK, dV; max error relative to the largest reference value) of
   * the ring's blocks at cp=4 emulated on this device: every rank's chunk pairs, merged by LSE in
     fp32, backward given the final out/LSE — the kernel calls of ``_RingAttention`` without the
     transfers;
   * the real autograd ops on a 1-rank group (ring, allgather, ulysses) and the one-device
     document attention (``document_causal_attention``, also ulysses' local step);
   for fp32 / bf16 / fp16, MHA and GQA, with and without packed documents, against fp64 SDPA with
   a dense mask. ``torch err`` is torch's own SDPA in the same dtype against the same reference.
2. Speed (fwd+bwd, median) against torch's flash SDPA on the same work: one dense block, one causal
   square, a whole row as the ring's blocks, packed documents; plus peak scratch memory.

Prints two tables and writes ``gpu_cp.json`` (``bench/results/`` or ``$BENCH_RESULTS_DIR``); exit 1
if a case is not exact.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import print_table, write_json  # noqa: E402

from ndparallel.parallel.cp.attention_blocks import (  # noqa: E402
    DocLayout,
    accumulators,
    backward_span,
    document_starts,
    forward_span,
)
from ndparallel.parallel.cp.attention_kernels import BlockKernel, merge_, resolve_kernel  # noqa: E402
from ndparallel.parallel.cp.parallel_attention import context_parallel_attention  # noqa: E402
from ndparallel.parallel.cp.sharding import (  # noqa: E402
    cp_positions,
    reorder_cp_chunks,
    shard_for_cp,
)
from ndparallel.parallel.document_attention import document_causal_attention  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def packed_positions(b: int, s: int, docs: int) -> torch.Tensor:
    """Rows of ``docs`` documents of unequal lengths (row r shifted so rows differ)."""
    out = torch.empty(b, s, dtype=torch.int64)
    for r in range(b):
        cuts = sorted(
            {(s * (i + 1)) // docs + (r * 37 + i * 11) % max(1, s // (4 * docs)) for i in range(docs - 1)}
        )
        for a, e in zip([0, *cuts], [*cuts, s]):
            out[r, a:e] = torch.arange(e - a)
    return out


def dense_mask(pos: torch.Tensor | None, s: int, device) -> torch.Tensor:
    i = torch.arange(s, device=device).view(s, 1)
    j = torch.arange(s, device=device).view(1, s)
    if pos is None:
        return (j <= i)[None, None]
    start = torch.minimum(
        (torch.arange(s, device=device) - pos.to(device)).clamp(min=0), torch.arange(s, device=device)
    )
    return ((j <= i) & (j >= start.view(-1, s, 1))).unsqueeze(1)


def reference(q, k, v, dout, mask, dtype=torch.float64):
    g = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask
    )
    out.backward(dout.to(dtype))
    return out.detach(), q.grad, k.grad, v.grad


def ring_emulated(q, k, v, pos, dout, cp: int, kernel: BlockKernel):
    """Every rank's blocks of a load-balanced ring of ``cp`` ranks, run here one after another."""
    b, _, s, _ = q.shape
    n = s // (2 * cp)
    outs, dqs = [], []
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    ch = lambda t, i: t[:, :, i * n : (i + 1) * n]  # noqa: E731
    for r in range(cp):
        ids = (r, 2 * cp - 1 - r)
        lp = None if pos is None else shard_for_cp(pos, 1, r, cp)
        docs = DocLayout(document_starts(lp, cp_positions(s, r, cp), b), ids, n, b, q.device)
        ql, dl = shard_for_cp(q, 2, r, cp), shard_for_cp(dout, 2, r, cp)
        acc_out, acc_lse = accumulators(ql)
        for qi in range(2):
            fresh = True
            for c in range(2 * cp):
                if groups := docs.groups(qi, c * n, n):
                    fresh = forward_span(
                        kernel,
                        ch(ql, qi),
                        ch(k, c),
                        ch(v, c),
                        ch(acc_out, qi),
                        ch(acc_lse, qi),
                        groups,
                        fresh,
                    )
        out = acc_out.to(q.dtype)
        dq = torch.zeros(ql.shape, dtype=torch.float32, device=q.device)
        for qi in range(2):
            for c in range(2 * cp):
                if groups := docs.groups(qi, c * n, n):
                    backward_span(
                        kernel,
                        ch(ql, qi),
                        ch(k, c),
                        ch(v, c),
                        ch(out, qi),
                        ch(dl, qi),
                        ch(acc_lse, qi),
                        ch(dq, qi),
                        ch(dk, c),
                        ch(dv, c),
                        groups,
                    )
        outs.append(out)
        dqs.append(dq)
    nat = lambda xs: reorder_cp_chunks(torch.cat(xs, 2), 2, cp)  # noqa: E731
    return nat(outs), nat(dqs), dk, dv


def autograd_run(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def rel_errors(got, ref):
    return [((g.double() - r.double()).abs().max() / r.double().abs().max()).item() for g, r in zip(got, ref)]


def _runs(qkvd, pos, p, kernel, group) -> dict:
    """The attention runs ``check`` compares, each a call returning (out, dq, dk, dv)."""

    def op(strategy):
        def fn(a, b_, c):
            return context_parallel_attention(a, b_, c, group, strategy=strategy, position_ids=p)

        return lambda: autograd_run(fn, *qkvd)

    runs = {
        "ring cp=4 (emulated)": lambda: ring_emulated(*qkvd[:3], pos, qkvd[3], 4, kernel),
        "document attention": lambda: autograd_run(
            lambda a, b_, c: document_causal_attention(a, b_, c, pos), *qkvd
        ),
    }
    return runs | {f"{s} op (1 rank)": op(s) for s in ("ring", "allgather", "ulysses")}


def check(device, dtypes, shape, group):
    b, h, s, d = shape
    rows = []
    for hk in (h, h // 4):
        for docs in (False, True):
            g = torch.Generator(device="cpu").manual_seed(hk + 7 * docs)
            q, dout = (torch.randn(b, h, s, d, generator=g).to(device) for _ in range(2))
            k, v = (torch.randn(b, hk, s, d, generator=g).to(device) for _ in range(2))
            pos = packed_positions(b, s, 5).to(device) if docs else None
            mask = dense_mask(pos, s, device)
            ref = reference(q, k, v, dout, mask)
            for dt in dtypes:
                qd, kd, vd, dd = (t.to(dt) for t in (q, k, v, dout))
                name = resolve_kernel("auto", qd)
                torch_err = max(rel_errors(reference(qd, kd, vd, dd, mask, dt), ref))
                p = pos if pos is not None else torch.arange(s, device=device).expand(b, s)
                runs = _runs((qd, kd, vd, dd), pos, p, BlockKernel(name, d**-0.5), group)
                for what, run in runs.items():
                    errs = rel_errors(run(), ref)
                    bad = any(e != e for e in errs) or max(errs) > TOL[dt]
                    rows.append(
                        {
                            "what": what,
                            "dtype": str(dt).replace("torch.", ""),
                            "kernel": name,
                            "heads": f"{h}/{hk}",
                            "documents": docs,
                            "errors": errs,
                            "torch_err": torch_err,
                            "ok": not bad,
                        }
                    )
    return rows


def timed(fn, device, reps):
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def peak_scratch(fn, device):
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def torch_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(torch.ones_like(out))


def ours_block(q, k, v, causal, kernel):
    out, lse = kernel.fwd(q, k, v, causal)
    acc_out, acc_lse = accumulators(q)
    merge_(acc_out, acc_lse, out, lse)
    final = acc_out.to(q.dtype)
    kernel.bwd(torch.ones_like(final), q, k, v, final, acc_lse, causal)


def speed(device, dtype, shape, reps):
    b, h, hk, s, d = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, h, s, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, hk, s, d, generator=g).to(device, dtype) for _ in range(2))
    kernel = BlockKernel(resolve_kernel("auto", q), d**-0.5)
    n = s // 8
    qc, kc, vc = q[:, :, :n], k[:, :, :n], v[:, :, :n]
    docs = 16
    pos = packed_positions(b, s, docs).to(device)
    spans = [(a, a + int(p)) for a, p in _doc_lengths(pos[0])]
    cases = [
        (
            f"dense block {n}x{n}",
            lambda: ours_block(qc, kc, vc, False, kernel),
            lambda: torch_flash(qc, kc, vc, False),
        ),
        (
            f"causal square {n}",
            lambda: ours_block(qc, kc, vc, True, kernel),
            lambda: torch_flash(qc, kc, vc, True),
        ),
        (
            f"row {s} as ring cp=4 blocks",
            lambda: ring_emulated(q, k, v, None, q, 4, kernel),
            lambda: torch_flash(q, k, v, True),
        ),
        (
            f"row {s}, {docs} documents",
            lambda: autograd_run(
                lambda a, b_, c: document_causal_attention(a, b_, c, pos[:1].expand(b, -1)), q, k, v, q
            ),
            lambda: [torch_flash(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], True) for a, e in spans],
        ),
    ]
    rows = []
    for what, ours, ref in cases:
        t_o, t_r = timed(ours, device, reps), timed(ref, device, reps)
        rows.append(
            {
                "what": what,
                "ours_ms": t_o,
                "torch_flash_ms": t_r,
                "ratio": t_o / t_r,
                "ours_scratch_gib": peak_scratch(ours, device),
                "torch_scratch_gib": peak_scratch(ref, device),
            }
        )
    return rows


def _doc_lengths(pos_row):
    starts = (pos_row == 0).nonzero().flatten().tolist() + [len(pos_row)]
    return [(a, e - a) for a, e in zip(starts[:-1], starts[1:])]


def model_check(device, dtype):
    """A small Llama through transformers' AttentionInterface: a packed row of 3 documents with
    ``apply_document_attention`` vs each document run alone with transformers' sdpa (same
    weights): max error of the logits and of the loss gradient, relative to the largest value."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ndparallel.parallel.document_attention import apply_document_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
        use_cache=False,
        attn_implementation="sdpa",
    )
    ref_model = LlamaForCausalLM(cfg).to(device, dtype)
    model = LlamaForCausalLM(cfg).to(device, dtype)
    model.load_state_dict(ref_model.state_dict())
    apply_document_attention(model)
    s = 384
    ids = torch.randint(0, 512, (1, s), device=device)
    pos = packed_positions(1, s, 3).to(device)
    logits = model(input_ids=ids, position_ids=pos).logits
    logits.float().logsumexp(-1).sum().backward()
    ref = []
    for a, length in _doc_lengths(pos[0].cpu()):
        out = ref_model(
            input_ids=ids[:, a : a + length], position_ids=torch.arange(length, device=device)[None]
        ).logits
        ref.append(out)
        out.float().logsumexp(-1).sum().backward()
    ref = torch.cat(ref, 1)
    g, rg = (
        model.model.layers[0].self_attn.q_proj.weight.grad,
        ref_model.model.layers[0].self_attn.q_proj.weight.grad,
    )
    return {
        "logits_err": ((logits - ref).abs().max() / ref.abs().max()).item(),
        "grad_err": ((g - rg).abs().max() / rg.abs().max()).item(),
        "dtype": str(dtype),
    }


def one_rank_group(device):
    """A one-process group (an in-memory store: no port to collide with another run's)."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else None,
    )
    return dist.group.WORLD


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="CPU, smallest sizes, 2 reps: the same code in seconds (bench/gpu_all.sh --cpu-smoke)",
    )
    args = ap.parse_args(argv)
    if args.tiny:
        args.device, args.reps = "cpu", 2
    dev = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else (args.device if args.device != "auto" else "cpu")
    )
    cuda = dev.type == "cuda"
    group = one_rank_group(dev)
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if cuda else [])
    shape = (2, 8, 2048, 64) if cuda else (1, 4, 64, 16) if args.tiny else (2, 4, 128, 16)
    checks = check(dev, dtypes, shape, group)
    print_table(
        f"CP attention exactness on {dev} (max |err| / max |ref| vs fp64 SDPA)",
        ["what", "dtype", "kernel", "heads", "docs", "out", "dq", "dk", "dv", "torch err", "ok"],
        [
            (
                r["what"],
                r["dtype"],
                r["kernel"],
                r["heads"],
                str(r["documents"]),
                *r["errors"],
                r["torch_err"],
                "ok" if r["ok"] else "FAIL",
            )
            for r in checks
        ],
    )
    shape = (1, 32, 8, 32768, 128) if cuda else (1, 4, 2, 256, 16) if args.tiny else (1, 4, 2, 512, 16)
    speeds = []
    for dt in [torch.bfloat16] if cuda else [torch.float32]:
        speeds += speed(dev, dt, shape, args.reps)
    print_table(
        f"fwd+bwd ms on {dev}, {dt}, B×H/Hk×S×D = {shape} (median of {args.reps})",
        ["what", "ours ms", "torch flash ms", "ratio", "ours scratch GiB", "torch scratch GiB"],
        [
            (
                r["what"],
                r["ours_ms"],
                r["torch_flash_ms"],
                r["ratio"],
                r["ours_scratch_gib"],
                r["torch_scratch_gib"],
            )
            for r in speeds
        ],
    )
    model = model_check(dev, torch.bfloat16 if cuda else torch.float32)
    model_ok = model["logits_err"] <= TOL[torch.bfloat16] and model["grad_err"] <= 5e-2
    print(
        f"model check (packed row vs documents alone, {model['dtype']}): logits {model['logits_err']:.2e}, "
        f"q_proj grad {model['grad_err']:.2e} {'ok' if model_ok else 'FAIL'}"
    )
    ok = all(r["ok"] for r in checks) and model_ok
    path = write_json(
        "gpu_cp",
        {
            "device": str(dev),
            "ok": ok,
            "checks": checks,
            "speed": speeds,
            "speed_shape": shape,
            "model_check": model,
        },
    )
    n_ok = sum(r["ok"] for r in checks)
    print(f"{'PASS' if ok else 'FAIL'}: {n_ok}/{len(checks)} exact; wrote {path}")
    ring = next((r for r in speeds if "ring" in r["what"]), None)
    print(
        f"HEADLINE: {n_ok}/{len(checks)} exact, model check {'ok' if model_ok else 'FAIL'}"
        + (f"; {ring['what']}: {ring['ratio']:.2f}x torch flash" if ring else "")
    )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

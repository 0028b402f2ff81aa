"""The same Accelerate-style loop run by Hugging Face Accelerate's own ``Accelerator`` and by
ndparallel's, on one device, fp32 and bf16: gradient accumulation, a prepared LR scheduler, a
tracker (TensorBoard when installed), ``get_state_dict`` + ``save_pretrained`` and a reload. Prints
the per-step losses side by side and the largest relative difference. Step 2 of ``bench/gpu_all.sh``.

    PYTHONPATH=src python bench/gpu_accelerate_compat.py     # CUDA when visible, else CPU (seconds)

Accelerate's state is one per process and cannot change its mixed precision once set, so each
precision runs in a child process of its own (``--precision no|bf16``), Accelerate first (before
ndparallel starts a process group). PASS: fp32 losses agree to ``FP32_RTOL``, bf16 to ``BF16_RTOL``
(Accelerate autocasts fp32 weights, ndparallel keeps bf16 compute weights over fp32 masters: the
difference is bf16 rounding, far below this), same final learning rate and reloaded parameter count,
and a TensorBoard event file from each when TensorBoard is installed (required on CUDA).
(On CPU ranks Accelerate refuses ND layouts, so one device is where the two can meet.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from _warm_python import child_python  # sys.executable; the warm one under --cpu-smoke

STEPS, GA, SEQ, BATCH = 4, 2, 128, 4
FP32_RTOL = 1e-5
BF16_RTOL = 5e-2
TINY_ENV = "GPU_COMPAT_TINY"
"""Set by ``--tiny`` (and so inherited by the children): a smaller model and sequence for the CPU
smoke run of ``bench/gpu_all.sh``, the same loop."""


def _tiny() -> bool:
    return os.environ.get(TINY_ENV) == "1"


def _config():
    from transformers import LlamaConfig

    if _tiny():
        return LlamaConfig(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
            use_cache=False,
        )
    return LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        use_cache=False,
    )


def _batches(vocab: int):
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS * GA):
        tokens = torch.randint(0, vocab, (BATCH, (32 if _tiny() else SEQ) + 1), generator=g)
        out.append(
            {
                "input_ids": tokens[:, :-1].contiguous(),
                "labels": tokens[:, :-1].contiguous(),
                "shift_labels": tokens[:, 1:].contiguous(),
            }
        )
    return out


def tracker() -> str | None:
    """``tensorboard`` where it is installed (both Accelerators then must write event files)."""
    return "tensorboard" if importlib.util.find_spec("tensorboard") else None


def run(which: str, mixed_precision: str, logdir: str):
    """The loop with ``which`` Accelerator: (losses per optimizer step, final lr, reloaded params)."""
    import torch
    from transformers import AutoModelForCausalLM

    if which == "accelerate":
        from accelerate import Accelerator
    else:
        from ndparallel import Accelerator
    acc = Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=GA,
        log_with=tracker(),
        project_dir=logdir,
    )
    acc.init_trackers("compat")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    model, opt, sched = acc.prepare(model, opt, sched)
    losses, micro = [], []
    for batch in _batches(1024):
        batch = {k: v.to(acc.device) for k, v in batch.items()}
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        micro.append(loss.item())
        if acc.sync_gradients:
            losses.append(sum(micro) / len(micro))
            acc.log({"loss": losses[-1]}, step=len(losses))
            micro = []
    out = os.path.join(logdir, "model")
    acc.unwrap_model(model).save_pretrained(out, state_dict=acc.get_state_dict(model))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    acc.end_training()
    return losses, sched.get_last_lr()[0], sum(p.numel() for p in reloaded.parameters())


def one_precision(mp: str) -> dict:
    """Both Accelerators in this process (Accelerate first), one precision."""
    import torch

    out = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "tracker": tracker(),
    }
    for which in ("accelerate", "ndparallel"):
        with tempfile.TemporaryDirectory() as d:
            losses, lr, params = run(which, mp, d)
            events = [f for _, _, fs in os.walk(d) for f in fs if f.startswith("events.out.tfevents")]
        out[which] = {"losses": losses, "lr": lr, "params": params, "tensorboard_files": len(events)}
    return out


def compare(mp: str, res: dict) -> list[str]:
    a, n = res["accelerate"], res["ndparallel"]
    for s, (x, y) in enumerate(zip(a["losses"], n["losses"])):
        print(f"{mp:9} {s:>4} {x:>12.6f} {y:>12.6f} {abs(x - y) / abs(x):>10.2e}")
    worst = max(abs(x - y) / abs(x) for x, y in zip(a["losses"], n["losses"]))
    tol = FP32_RTOL if mp == "no" else BF16_RTOL
    res["worst_rel_diff"] = worst
    print(
        f"{mp:9} final lr accelerate {a['lr']:.6g} ndparallel {n['lr']:.6g}; reloaded params "
        f"{a['params']} / {n['params']}; tensorboard files {a['tensorboard_files']} / "
        f"{n['tensorboard_files']}"
    )
    fails = []
    if len(a["losses"]) != STEPS or len(n["losses"]) != STEPS:
        fails.append(f"{mp}: {len(a['losses'])} / {len(n['losses'])} optimizer steps, expected {STEPS}")
    if not worst <= tol:
        fails.append(f"{mp}: losses differ by {worst:.2e} relative (tolerance {tol:g})")
    if a["lr"] != n["lr"] or a["params"] != n["params"]:
        fails.append(f"{mp}: final lr or reloaded parameter count differ")
    if res["tracker"] and not (a["tensorboard_files"] and n["tensorboard_files"]):
        fails.append(f"{mp}: no TensorBoard event file from one of them")
    return fails


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--precision",
        choices=("no", "bf16"),
        help="run one precision in this process "
        "and print its result as JSON (what the parent does per precision)",
    )
    ap.add_argument("--tiny", action="store_true", help="a smaller model (the CPU smoke run)")
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ[TINY_ENV] = "1"
    if args.precision:
        print("RESULT " + json.dumps(one_precision(args.precision)))
        return 0
    results, fails = {}, []  # the parent imports no torch: the children do the work
    for mp in ("no", "bf16"):
        child = subprocess.run([child_python(), __file__, "--precision", mp], capture_output=True, text=True)
        lines = [x for x in child.stdout.splitlines() if x.startswith("RESULT ")]
        if child.returncode or not lines:
            print(child.stdout[-3000:], child.stderr[-6000:], sep="\n")
            fails.append(f"{mp}: the child process failed (exit {child.returncode})")
            continue
        results[mp] = json.loads(lines[-1][len("RESULT ") :])
    for mp, r in results.items():
        print(f"{mp}: on {r['device']}, torch {r['torch']}")
    on_gpu = any(r["device"] != "cpu" for r in results.values())
    if on_gpu and any(r["tracker"] is None for r in results.values()):
        fails.append(
            "tensorboard is not installed on this GPU machine (carry its wheel: bench/gpu_wheels.sh)"
        )
    print(f"{'precision':9} {'step':>4} {'accelerate':>12} {'ndparallel':>12} {'rel diff':>10}")
    for mp, res in results.items():
        fails += compare(mp, res)
    for f in fails:
        print(f"FAIL {f}")
    worst = {mp: f"{r['worst_rel_diff']:.1e}" for mp, r in results.items()}
    tb = "with TensorBoard" if all(r["tracker"] for r in results.values()) else "TensorBoard not installed"
    print(
        f"HEADLINE: max rel loss diff fp32 {worst.get('no', '-')} (tol {FP32_RTOL:g}), bf16 "
        f"{worst.get('bf16', '-')} (tol {BF16_RTOL:g}); {tb}"
        + (f"; {len(fails)} failure(s)" if fails else "")
    )
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())

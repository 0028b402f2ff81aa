"""GPU check (one CUDA device): the same Accelerate-style loop run by Hugging Face Accelerate's own
``Accelerator`` and by ndparallel's, one process, fp32 and bf16, with gradient accumulation, an LR
scheduler and a TensorBoard tracker; prints per-step losses side by side and the largest relative
difference, then saves through ``save_pretrained`` / ``get_state_dict`` and reloads.

    PYTHONPATH=src python bench/gpu_accelerate_compat.py        # needs CUDA and accelerate

(On CPU ranks Accelerate refuses ND layouts, so this single-device run is where the two can meet.)
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

STEPS, GA, SEQ, BATCH = 4, 2, 128, 4


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                       tie_word_embeddings=False, use_cache=False)


def _batches(vocab: int):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS * GA):
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
        out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, :-1].contiguous(),
                    "shift_labels": tokens[:, 1:].contiguous()})
    return out


def run(which: str, mixed_precision: str, logdir: str):
    if which == "accelerate":
        from accelerate import Accelerator
    else:
        from ndparallel import Accelerator
    acc = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=GA,
                      log_with="tensorboard", project_dir=logdir)
    acc.init_trackers("compat")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    model, opt, sched = acc.prepare(model, opt, sched)
    losses, micro = [], []
    for i, batch in enumerate(_batches(1024)):
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


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'precision':9} {'step':>4} {'accelerate':>12} {'ndparallel':>12} {'rel diff':>10}")
    worst = {}
    for mp in ("no", "bf16"):
        res = {}
        for which in ("accelerate", "ndparallel"):
            with tempfile.TemporaryDirectory() as d:
                res[which] = run(which, mp, d)
                tb = [f for _, _, fs in os.walk(d) for f in fs if f.startswith("events.out.tfevents")]
                assert tb, f"{which}: no TensorBoard event file"
        (la, lr_a, na), (ln, lr_n, nn_) = res["accelerate"], res["ndparallel"]
        for s, (a, b) in enumerate(zip(la, ln)):
            print(f"{mp:9} {s:>4} {a:>12.6f} {b:>12.6f} {abs(a - b) / abs(a):>10.2e}")
        worst[mp] = max(abs(a - b) / abs(a) for a, b in zip(la, ln))
        print(f"{mp:9} final lr accelerate {lr_a:.6g} ndparallel {lr_n:.6g}; reloaded params {na} / {nn_}")
        assert lr_a == lr_n and na == nn_
    ok = worst["no"] <= 1e-5
    print(f"fp32 max rel diff {worst['no']:.2e} ({'PASS' if ok else 'FAIL'} at 1e-5); "
          f"bf16 {worst['bf16']:.2e} (informational: autocast vs bf16 parameters)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

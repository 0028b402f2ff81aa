"""Low-bit AdamW (torchao) under Axolotl's names: the same optimizer states and updates on FSDP2 as on
one process, checkpoints that resume on another layout with the 8-bit states intact.

torchao compiles one update kernel per parameter shape and state kind (~10 s each on these CPUs), so
the compiled equivalence uses a two-layer model with three shapes; the negative control and the
resume test (tiny Llama) run the same update eagerly (``torch.compiler.set_stance("force_eager")``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from ndparallel.testing import run_on_ranks

pytest.importorskip("torchao")
sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ckpt_train  # noqa: E402

STEPS, LR = 3, 1e-2


def _train(stock: bool = False, eager: bool = False) -> dict:
    """3 AdamW-8bit steps of a 64 -> 64 -> 128 MLP (FSDP2 over the world when > 1 rank); returns the
    losses, the full parameters and each parameter's state kind."""
    import torch.distributed as dist

    from ndparallel.optim.build import build_optimizer

    if eager:
        torch.compiler.set_stance("force_eager")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 128, bias=False))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    if stock:  # torchao's class as it is: it decides per local shard
        import torchao.optim

        optimizer = torchao.optim.AdamW8bit(model.parameters(), lr=LR, weight_decay=0.0)
    else:
        optimizer = build_optimizer(model.parameters(), "adamw_8bit", lr=LR)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 64, generator=g)
        rows = slice(dist.get_rank() * 8 // world, (dist.get_rank() + 1) * 8 // world)
        loss = model(x[rows]).pow(2).sum() / 8
        loss.backward()
        with torch._functorch.config.patch(enable_autograd_cache=False):  # see optim_lowbit's step
            optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = {
        names[id(p)]: type(getattr(s["exp_avg"], "_local_tensor", s["exp_avg"])).__name__
        for p, s in optimizer.state.items()
    }
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return {"losses": losses, "params": params, "kinds": kinds}


def test_fsdp2_equals_one_process_states_quantised_per_parameter():
    """Losses as tight as every layout's (1e-5 rel); parameters at AdamW's 1e-3 (an fp32-rounding
    difference in a gradient can move an 8-bit code by one step, which AdamW's normalisation
    amplifies; measured on the tiny Llama: 4e-5 at lr 1e-2, fp32 AdamW 7e-6). The 64x64 weight is
    quantised on both (4096 values; 2048 per FSDP shard), the bias is not (64)."""
    one = run_on_ranks(_train, 1, timeout_s=400)[0]
    fsdp = run_on_ranks(_train, 2, timeout_s=400)[0]
    assert (
        one["kinds"]
        == fsdp["kinds"]
        == {"0.weight": "OptimState8bit", "0.bias": "Tensor", "2.weight": "OptimState8bit"}
    )
    assert max(abs(a - b) / abs(a) for a, b in zip(one["losses"], fsdp["losses"])) <= 1e-5
    assert max((one["params"][k] - fsdp["params"][k]).abs().max().item() for k in one["params"]) <= 1e-3
    assert one["losses"][-1] < one["losses"][0]
    stock = run_on_ranks(_train, 2, stock=True, eager=True, timeout_s=400)[0]
    assert stock["kinds"]["0.weight"] == "Tensor"  # negative control: torchao's rule sees the shard


def _eager_ckpt_train(*args, **kwargs):
    torch.compiler.set_stance("force_eager")
    return ckpt_train.train(*args, **kwargs)


def test_checkpoint_resumes_on_another_layout(tmp_path):
    """FSDP 2 saves after step 2 (8-bit states in DCP), one rank resumes to step 4: the losses of
    steps 3-4 equal an uninterrupted one-rank run's (the restored states are the saved ones)."""

    ref = run_on_ranks(
        _eager_ckpt_train, 1, {}, str(tmp_path / "ref"), optimizer="adamw_8bit", timeout_s=400
    )[0]
    run_on_ranks(
        _eager_ckpt_train,
        2,
        {"dp_shard_size": 2},
        str(tmp_path / "run"),
        save_every=1,
        stop_after=2,
        optimizer="adamw_8bit",
        timeout_s=400,
    )
    run_on_ranks(
        _eager_ckpt_train,
        2,
        {"dp_shard_size": 2},
        str(tmp_path / "fp32"),
        save_every=2,
        stop_after=2,
        optimizer="adamw",
        timeout_s=400,
    )

    def size(run):
        return sum(p.stat().st_size for p in (tmp_path / run / "checkpoint-2").glob("*.distcp"))

    # 8-bit states on disk: ~0.49 MB less than fp32 AdamW's 1.51 MB (98K of 107K parameters quantised)
    assert size("run") < size("fp32") - 0.3e6, (size("run"), size("fp32"))
    resumed = run_on_ranks(
        _eager_ckpt_train, 1, {}, str(tmp_path / "run"), resume=True, optimizer="adamw_8bit", timeout_s=400
    )[0]
    assert sorted(resumed["losses"]) == [3, 4]
    for step in (3, 4):
        assert abs(resumed["losses"][step] - ref["losses"][step]) <= 1e-5 * abs(ref["losses"][step]), (
            resumed,
            ref,
        )


def test_embeddings_keep_fp32_states():
    """Given the model, the token embedding's states stay fp32 (transformers' Trainer does so for
    bitsandbytes' 8-bit optimizers): unused rows have zero gradients, and a quantised second moment
    rounding to 0 under a non-zero first one makes m / (sqrt(v) + eps) explode (rows moved by 0.6 in
    3 steps under TP 2 without this, 0.012 with it; fp32 AdamW: 0.002)."""
    from transformers import AutoModelForCausalLM

    from ndparallel.models.presets import preset_config
    from ndparallel.optim.build import build_optimizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    optimizer = build_optimizer(model, "adamw_8bit", lr=1e-2)
    batch = torch.randint(0, 256, (2, 16))
    model(input_ids=batch, labels=batch).loss.backward()
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()
    kind = {n: type(optimizer.state[p]["exp_avg"]).__name__ for n, p in model.named_parameters()}
    assert kind["model.embed_tokens.weight"] == "Tensor"  # 16384 values, fp32 states
    assert kind["lm_head.weight"] == "OptimState8bit"  # a linear of the same size: 8-bit

"""The training loops ``bench/gpu_single.py`` puts side by side on one device, all on the same
model (seeded random init, fp32 master weights, bf16 compute), the same batch and the same
optimizer (AdamW, no weight decay, fused on CUDA, gradients clipped at 1.0):

* ``make_accelerate``: Hugging Face Accelerate's loop, ``Accelerator(mixed_precision="bf16")``,
  the model's own loss (``labels`` + ``shift_labels``, so it scores the very tokens the others do);
* ``make_plain_fsdp2``: a hand-written FSDP2 loop (``fully_shard`` per decoder layer and the root,
  bf16 parameters / fp32 reductions, ``cross_entropy`` of the logits) on a one-rank mesh;
* ``make_nd``: ndparallel's ``Accelerator`` and the very step ``ndparallel train`` runs, with or
  without the chunked loss, regional compile and float8.

Each returns a ``Loop``: ``step(mb)`` runs one optimizer step and returns the loss (a device
tensor, not read back), ``close()`` drops the model, optimizer and compiled graphs so that the
next loop's peak memory is its own.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

CLIP = 1.0


@dataclass
class Loop:
    step: Callable[[dict], torch.Tensor]
    close: Callable[[], None]


def build_model(cfg, device: torch.device) -> torch.nn.Module:
    """The same random model for every loop: seed 0, fp32 parameters, on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg).float()


def adamw(params, lr: float, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=(device.type == "cuda") or None)


def free(device: torch.device, compiled: bool = False) -> None:
    gc.collect()
    if compiled:
        torch._dynamo.reset()  # the next loop compiles its own graphs, within the recompile limit
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_accelerate(cfg, device: torch.device, lr: float) -> Loop:
    """Hugging Face Accelerate's plain loop (run it before anything starts a process group: with
    none, Accelerate is a single process, as a user's script would be)."""
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu")
    model = build_model(cfg, device)
    model, opt = acc.prepare(model, adamw(model.parameters(), lr, device))

    def step(mb):
        out = model(
            input_ids=mb["input_ids"],
            position_ids=mb["position_ids"],
            labels=mb["shift_labels"],
            shift_labels=mb["shift_labels"],
        )
        acc.backward(out.loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    def close():
        nonlocal acc, model, opt
        acc.free_memory()
        acc = model = opt = None
        free(device)

    return Loop(step, close)


def one_rank_group(device: torch.device) -> None:
    """A one-process group as a plain script would start it (ndparallel reuses it later)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def make_plain_fsdp2(cfg, device: torch.device, lr: float) -> Loop:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    one_rank_group(device)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("plain",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build_model(cfg, device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    opt = adamw(model.parameters(), lr, device)

    def step(mb):
        labels = mb["shift_labels"]
        n = (labels != -100).sum()
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def close():
        nonlocal model, opt
        model = opt = None
        free(device)

    return Loop(step, close)


def make_nd(
    cfg,
    device: torch.device,
    lr: float,
    *,
    chunked: bool,
    compile_backend: str | None,
    fp8: bool,
    emulate_fp8: bool = False,
) -> Loop:
    from _common import nd_step

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.optim.build import build_optimizer
    from ndparallel.techniques.technique_options import CompileOptions, Float8Options, LossOptions

    f8 = Float8Options(enabled=fp8, emulate=emulate_fp8)
    acc = Accelerator(
        ParallelismConfig(),
        mixed_precision="bf16",
        device=device.type,
        loss_options=LossOptions(chunked=chunked),
        compile_options=CompileOptions(
            enabled=compile_backend is not None, backend=compile_backend or "inductor"
        ),
        float8_options=f8,
    )
    model = acc.prepare(build_model(cfg, device))
    opt = build_optimizer(model.parameters(), lr=lr)
    if fp8:
        from ndparallel.techniques.float8 import precompute_scales

    def step(mb):
        loss = nd_step(acc, model, opt, {k: v.clone() for k, v in mb.items()}, max_norm=CLIP)
        if fp8:
            precompute_scales(model, f8)
        return loss

    def close():
        nonlocal acc, model, opt
        acc = model = opt = None
        free(device, compiled=compile_backend is not None)

    return Loop(step, close)

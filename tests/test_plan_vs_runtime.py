"""The planner's predicted collectives equal, call for call and byte for byte, what steady-state
training steps of the tiny model issue at run time (counted by ``CommProfiler`` around the
Accelerator path of ``train_under_layout``), under TP (with and without sequence parallel and loss
parallel), CP (ring, all-gather and all-to-all, with and without activation checkpointing) and
FSDP×TP, FSDP×CP, TP×CP, in fp32 and bf16. The scalar collectives (global token count, gradient norm) are
predicted too (``predict_collectives(..., scalars=True)``): the gradient norm is one 4-byte
all-reduce over the world on every layout (``techniques/grad_norm.py``).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ndparallel.testing import run_on_ranks

SEQ, ROWS = 32, 2  # tokens per sequence, sequences per dp rank per micro-batch
STEPS = 2  # the last one is compared (the first also includes lazy initialisation)


def _run_case(layout: dict, mp: str, tp: dict, cp: dict, ckpt: bool):
    """``STEPS`` training steps as ``train_step`` runs them (the shared ``forward_backward``, the step
    loss's all-reduce, gradient norm, AdamW). Per step two
    profiler records: everything but the gradient norm, then the gradient norm alone."""
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.engine import forward_backward
    from ndparallel.models.presets import preset_config
    from ndparallel.parallel.options import ActivationOptions, CPOptions, TPOptions
    from ndparallel.runtime.comm_profile import CommProfiler
    from ndparallel.techniques.technique_options import LossOptions

    # The planner models the logits loss (gathered or loss-parallel); the chunked loss (default)
    # and loss parallel's default-on are pinned off here so each case runs what it names.
    acc = Accelerator(
        ParallelismConfig(**layout),
        mixed_precision=mp,
        activation_options=ActivationOptions(activation_checkpointing=ckpt),
        tp_options=TPOptions(**{"loss_parallel": False, **tp}),
        cp_options=CPOptions(**cp),
        loss_options=LossOptions(chunked=False),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    model.train()
    g = torch.Generator().manual_seed(acc.dp_rank)
    with CommProfiler(acc.torch_device_mesh) as prof:
        for _ in range(STEPS):
            tokens = torch.randint(0, 256, (ROWS, SEQ + 1), generator=g)
            ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            pos = torch.arange(SEQ).expand(ROWS, -1).clone()
            loss = forward_backward(
                acc.engine, model, [{"input_ids": ids, "shift_labels": labels, "position_ids": pos}]
            )
            acc.engine.reduce_step_loss(loss)  # as train_step does
            prof.step()
            acc.grad_norm(model.parameters())
            prof.step()
            opt.step()
            opt.zero_grad()
    labels = {
        d: prof.label(d)
        for d in ("dp_replicate", "dp_shard", "dp_shard_cp", "dp", "dp_cp", "cp", "tp", "world")
    }
    # Optimizer step of step i is recorded in record 2i+2 (with the next step's forward).
    return [prof.calls(i) for i in range(2 * STEPS)], prof.calls(2 * STEPS), labels


def _predict(layout: dict, mp: str, tp: dict, cp: dict, ckpt: bool, labels: dict):
    """(main, gradient norm) predictions keyed like the runtime: (label, op, bytes) -> calls;
    a planner ``send_recv`` is one ``send`` and one ``recv`` on each rank."""
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.time.comms import predict_collectives

    plan_layout = ParallelDims(
        dp_replicate=layout.get("dp_replicate_size", 1),
        dp_shard=layout.get("dp_shard_size", 1),
        cp=layout.get("cp_size", 1),
        tp=layout.get("tp_size", 1),
    )
    colls = predict_collectives(
        PRESETS["tiny"],
        plan_layout,
        sequence_len=SEQ,
        micro_batch_size=ROWS,
        activation_checkpointing=ckpt,
        mixed_precision="bf16" if mp == "bf16" else "fp32",
        sequence_parallel=tp.get("sequence_parallel", False),
        loss_parallel=tp.get("loss_parallel", False),
        cp_comm_strategy=cp.get("comm_strategy", "ring"),
        scalars=True,
    )
    main, norm = Counter(), Counter()
    for c in colls:
        target = norm if c.what.startswith("gradient norm") else main
        ops = ("send", "recv") if c.kind == "send_recv" else (c.kind,)
        for op in ops:
            target[(labels.get(c.mesh_dim, c.mesh_dim), op, c.bytes)] += c.count
    return dict(main), dict(norm)


def _check(case, result):
    layout, mp, tp, cp, ckpt = case
    records, tail, labels = result
    main_pred, norm_pred = _predict(*case, labels)
    # Last step: its forward/backward record, plus the optimizer step recorded after its norm
    # (AdamW on local shards communicates nothing), then its gradient norm.
    main = Counter(records[-2])
    main.update(tail)
    assert tail == {}, f"the optimizer step communicated: {tail}"
    assert records[0] == records[-2] and records[1] == records[-1], "steps differ"
    assert dict(main) == main_pred, _diff(dict(main), main_pred)
    assert records[-1] == norm_pred == {(labels["world"], "all_reduce", 4): 1}, (records[-1], norm_pred)


def _diff(run, pred):
    keys = sorted(set(run) | set(pred))
    return "\n".join(
        f"{k}: runtime {run.get(k)} planner {pred.get(k)}" for k in keys if run.get(k) != pred.get(k)
    )


TP = {"tp_size": 2}
CP = {"cp_size": 2}
SP = {"sequence_parallel": True}
LP = {"loss_parallel": True}
RING, AG, A2A = {"comm_strategy": "ring"}, {"comm_strategy": "allgather"}, {"comm_strategy": "ulysses"}
# One process group per case: two equal DeviceMeshes in one process share DTensor's sharding
# propagation cache, so a second run's embedding output can be reduced on the first run's group.
GROUPS = {
    # name: (world, [(layout, mixed precision, tp options, cp options, checkpointing)])
    "tp2": (2, [(TP, "no", {}, {}, False), (TP, "no", SP, {}, False), (TP, "bf16", {**SP, **LP}, {}, True)]),
    "cp2": (
        2,
        [
            (CP, "no", {}, RING, False),
            (CP, "bf16", {}, AG, True),
            (CP, "no", {}, A2A, False),
            (CP, "bf16", {}, A2A, True),
        ],
    ),
    "fsdp2xtp2": (4, [({"dp_shard_size": 2, **TP}, "bf16", {**SP, **LP}, {}, False)]),
    "fsdp2xcp2": (
        4,
        [
            ({"dp_shard_size": 2, **CP}, "bf16", {}, RING, True),
            ({"dp_shard_size": 2, **CP}, "bf16", {}, A2A, False),
        ],
    ),
    "tp2xcp2": (4, [({**TP, **CP}, "no", {}, A2A, False)]),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_planner_equals_runtime(group):
    world, cases = GROUPS[group]
    failures = []
    for case in cases:
        for rank, result in enumerate(run_on_ranks(_run_case, world, *case)):
            try:
                _check(case, result)
            except AssertionError as exc:
                failures.append(f"rank {rank} {case}:\n{exc}")
    assert not failures, "\n\n".join(failures[:4])


MEMORY_SHAPE = dict(
    hidden_size=128,
    intermediate_size=448,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
"""Four layers: offloading keeps two layer inputs on the device (in flight), so it moves some."""


@pytest.mark.parametrize(
    "options",
    [
        {"activation_checkpointing": True},
        {"activation_checkpointing": True, "activation_offloading": True},
        {"activation_checkpointing": True, "ac_policy": "selective"},
        {"activation_checkpointing": True, "ac_policy": "selective", "activation_offloading": True},
    ],
    ids=["full", "full-offloaded", "selective", "selective-offloaded"],
)
def test_planned_activation_memory_is_what_a_step_holds(options):
    """The planner's activation memory (saved sets, what a layer's backward recomputes or brings
    back from the host, its gradients) against one process's step under each checkpointing policy,
    with and without offloading (the runtime's ``apply_activation_memory``), fp32: the tensor bytes
    alive at the step's peak (``LiveBytes``; weight gradients dropped as they are made, as FSDP's
    reduce-scatter does) within 10 % of the planner's largest moment, and the offloaded host bytes
    equal to 1 %. The settings' memory terms at the scale of a GPU: ``bench/simulate_settings.py``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ndparallel.layout.dims import ParallelDims
    from ndparallel.parallel.options import ActivationOptions
    from ndparallel.parallel.parallelize import apply_activation_memory
    from ndparallel.plan.hardware import get_preset
    from ndparallel.plan.memory.peak import _activation_terms, estimate_memory
    from ndparallel.plan.models import from_hf_config
    from ndparallel.plan.settings import Settings
    from ndparallel.runtime.memory_probe import LiveBytes
    from ndparallel.techniques.offload import offloader_of

    rows, seq = 2, 64
    cfg = LlamaConfig(**MEMORY_SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    apply_activation_memory(model, ActivationOptions(**options), torch.device("cpu"))
    model.train()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    live = LiveBytes()
    with live:
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits.flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].flatten())
        del logits  # as the trainer's step: the loss keeps what it saved, no more
        loss.backward()

    spec, lay = from_hf_config(cfg.to_dict(), "memory"), ParallelDims()
    s = Settings(
        sequence_len=seq,
        micro_batch_size=rows,
        mixed_precision="fp32",
        chunked_loss=False,
        loss_parallel=False,
        sequence_parallel=False,
        **options,
    )
    planned = max(saved + logits for saved, logits in _activation_terms(spec, lay, s)[0])
    assert abs(planned / live.peak - 1) <= 0.10, (planned / 2**20, live.peak / 2**20)
    offloader = offloader_of(model)
    host = estimate_memory(spec, lay, s, get_preset("h100-80gb")).host_offload
    if offloader is None:
        assert host == 0
    else:
        assert host == pytest.approx(offloader.stats.peak_host_bytes, rel=0.01)

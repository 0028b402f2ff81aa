"""The planner's prediction for a simulated rank: the same model, layout and settings as the run
(read from the running trainer, so a default the runtime resolves — loss parallel, the chunked
loss, fused AdamW — is the one the planner is asked about), and the per-dimension comparison of
the collectives the rank issued with the ones the planner counts."""

from __future__ import annotations

from collections import defaultdict

from ndparallel.config.plan_settings import plan_settings
from ndparallel.models.adapters import base_model_of
from ndparallel.parallel.pp.schedule import reduces_once_per_step
from ndparallel.plan.calibrate.measure import calibrate
from ndparallel.plan.hardware import Hardware, get_preset, load_hardware_file, preset_for_device
from ndparallel.plan.models import from_hf_config
from ndparallel.plan.pipeline.pipeline_estimate import pp_rank
from ndparallel.plan.pipeline.schedule_model import rank_shape
from ndparallel.plan.search.estimate import rank_step
from ndparallel.plan.search.evaluation import estimate
from ndparallel.plan.time.comms import collectives_for, scalar_collectives
from ndparallel.techniques.lm_loss import use_chunked_loss

GiB = 2**30


def planner_settings(trainer, sequence_len: int):
    """The planner's ``Settings`` of the running trainer's step, its rows ``sequence_len`` wide."""

    cfg, engine, model = trainer.cfg, trainer.engine, trainer.model
    options = engine.options
    pipeline = engine.pipeline_of(model)
    stages = {}
    if pipeline:
        plan = pipeline.plan
        stages = {"pipeline_schedule": plan.schedule, "pipeline_virtual_stages": plan.virtual}
    if pipeline is not None and pipeline.holds_last:  # the loss is the last stage's cut model's
        model = pipeline.modules[pipeline.plan.n_stages - 1].lm
    return plan_settings(
        cfg,
        options,
        micro_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        loss_parallel=engine.loss_parallel(model),
        unsharded_grad_accumulation=reduces_once_per_step(
            options.fsdp.unsharded_grad_accumulation, engine.dims.pp_enabled
        ),
        chunked_loss=use_chunked_loss(base_model_of(model), options.loss),
        optimizer_fused=bool(trainer.optimizer.defaults.get("fused")),
        **stages,
    ).but(sequence_len=sequence_len)


def hardware_for(req, engine, spec, settings):
    """``--hardware-file``, else ``--gpu``, else this CUDA device's preset; on CPU a quick
    calibration of this machine at the model's own shapes (a few seconds)."""

    if req.hardware_file:
        return load_hardware_file(req.hardware_file)
    if req.gpu:
        return get_preset(req.gpu)
    if engine.device.type == "cuda":
        import torch

        name = torch.cuda.get_device_name(engine.device)
        hw = preset_for_device(name)
        if hw is None:
            raise ValueError(
                f"no planner preset for {name!r}: pass --gpu NAME or --hardware-file "
                "(ndparallel plan --calibrate writes one)"
            )
        return hw

    tokens = settings.micro_batch_size * settings.sequence_len // engine.dims.cp
    profile = calibrate(ranks=1, quick=True, device="cpu", model=spec, seq_len=tokens, micro_batch=1)
    return Hardware.from_dict(profile["hardware"])


def pipeline_problem(trainer, spec, settings) -> str | None:
    """Why the planner cannot model this pp rank (one line), or None: it models one pipeline
    micro-batch per accumulation step and the runtime's even split of the layers."""

    engine = trainer.engine
    plan, rank = engine.pipeline_of(trainer.model).plan, engine.rank_in("pp")
    m = engine.options.pipeline.microbatches
    if m is not None and m != settings.gradient_accumulation_steps:
        return (
            f"the planner models one pipeline micro-batch per accumulation step, not "
            f"pipeline_microbatches={m}: "
            "the measurement is shown alone"
        )
    layers = sum(len(plan.layers[s]) for s in plan.stages_of(rank))
    if rank_shape(spec, plan.pp, plan.virtual, plan.schedule, rank).layers != layers:
        return "the planner models the even split of the layers, not this one: the measurement is shown alone"
    return None


def rank_estimate(trainer, spec, settings, hw, gpus_per_node: int) -> tuple:
    """(memory, collectives, time, pipeline part) the planner predicts for this rank: under pipeline
    parallel this pp rank's stages (``pipeline_estimate.pp_rank``) — the collectives without the
    stage transfers, which the direct run does not issue."""

    dims = trainer.engine.dims
    if not dims.pp_enabled:
        est = estimate(spec, dims, settings, hw, gpus_per_node)
        colls = collectives_for(spec, dims, settings)
        return est.memory, colls + scalar_collectives(spec, dims, settings.mixed_precision), est.time, None
    rank = trainer.engine.rank_in("pp")
    shape, part, rank_settings = pp_rank(spec, dims, settings, rank)
    mem, colls, timeb = rank_step(part, dims, rank_settings, hw, gpus_per_node)
    stage = {(True, True): "first and last", (True, False): "first", (False, True): "last"}.get(
        (shape.first, shape.last), "middle"
    )
    part_report = {
        "pp_rank": rank,
        "stage": stage,
        "layers": shape.layers,
        "in_flight": rank_settings.pp_in_flight,
    }
    return mem, colls + scalar_collectives(part, dims, settings.mixed_precision), timeb, part_report


def predict(trainer, req, measured: dict, sequence_len: int) -> tuple[dict, list]:
    """The planner's memory and time for the run, its rows ``sequence_len`` wide (as the simulated
    steps ran them); returns (report part, predicted collectives)."""

    engine = trainer.engine
    spec = from_hf_config(trainer.hf_config.to_dict(), str(trainer.cfg.base_model))
    settings = planner_settings(trainer, sequence_len)
    why = pipeline_problem(trainer, spec, settings) if engine.dims.pp_enabled else None
    if why:
        return {"available": False, "why": why}, []
    hw = hardware_for(req, engine, spec, settings)
    mem, colls, t, stage = rank_estimate(trainer, spec, settings, hw, req.gpus_per_node)
    if engine.device.type == "cuda":  # what train logs: the allocator's peak (the CUDA context apart)
        peak = mem.allocated
    else:  # the CPU process's runtime plays the part of the CUDA context: measured before the model
        peak = mem.allocated + measured["runtime_rss_gib"] * GiB
    report = {
        "peak_memory_gib": peak / GiB,
        "tensor_peak_gib": mem.allocated / GiB,
        "peak_phase": mem.peak_phase,
        "device_total_gib": mem.total / GiB,  # with the runtime overhead: what must fit the device
        "offload_host_gib": mem.host_offload / GiB,  # pinned host memory of offloaded layer inputs
        "memory_gib": {
            k: getattr(mem, k) / GiB
            for k in ("params", "grads", "optimizer", "activations", "logits", "fsdp_buffers", "overhead")
        },
        "step_time_s": t.compute + t.optimizer,
        "step_time_with_comm_s": t.step,
        "exposed_comm_s": {"tp": t.tp_exposed, "cp": t.cp_exposed, "dp": t.dp_exposed},
        "hardware": hw.name,
        "settings": {
            "chunked_loss": settings.chunked_loss,
            "loss_parallel": settings.loss_parallel,
            "activation_checkpointing": settings.activation_checkpointing,
        },
        **({"pipeline": stage} if stage else {}),
    }
    report["error"] = {
        "peak_memory": _rel(report["peak_memory_gib"], measured["peak_memory_gib"]),
        "tensor_peak": _rel(report["tensor_peak_gib"], measured["tensor_peak_gib"]),
        "step_time": _rel(report["step_time_s"], measured["step_time_s"]),
    }
    return report, colls


def _rel(predicted: float, measured: float) -> float:
    """(predicted − measured) / measured."""
    return (predicted - measured) / measured if measured else float("nan")


def compare_collectives(profiler, planned: list, engine) -> tuple[dict, dict]:
    """Calls and bytes per mesh dim: what the profiled step issued, what the planner counts.
    Dims are reported under the profiler's label (a dim sharing its group with another, e.g.
    ``dp_shard_cp`` = ``dp_shard`` without CP, under one name); a planner ``send_recv`` is one
    send and one receive on each rank."""
    measured: dict = defaultdict(lambda: {"calls": 0, "bytes": 0})
    for (dim, _op, nbytes), calls in profiler.calls().items():
        measured[dim]["calls"] += calls
        measured[dim]["bytes"] += calls * nbytes
    predicted: dict = defaultdict(lambda: {"calls": 0, "bytes": 0})
    for c in planned:
        n = 2 if c.kind == "send_recv" else 1
        row = predicted[profiler.label(c.mesh_dim)]
        row["calls"] += n * c.count
        row["bytes"] += n * c.count * c.bytes
    return dict(measured), dict(predicted)

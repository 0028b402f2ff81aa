"""The ``PlanRequest`` the run flags give: their values by key (``run_values``: a training config's,
then the command line's) made into the request's ``Settings`` and searched settings, the model and
the hardware. The flags whose value is no ``Settings`` field as it is: the optimizer (a training
config's name), the adapter's three flags, and the searched ones' ``auto``."""

from __future__ import annotations

from dataclasses import fields

from ndparallel.plan import hardware as hwmod
from ndparallel.plan.adapters.lora_cost import SAVED_MODULES, saved_tables
from ndparallel.plan.cli.flag_checks import gpu_mem_bytes, host_mem_bytes
from ndparallel.plan.cli.parser import given
from ndparallel.plan.memory.qat_memory import qat_format_problem
from ndparallel.plan.models import load_model_spec
from ndparallel.plan.pipeline.schedule_model import canonical
from ndparallel.plan.search.request import DEFAULT_SETTINGS, SEARCHED, PlanRequest
from ndparallel.plan.settings import Settings, plan_optimizer

SETTINGS = {f.name for f in fields(Settings)} - set(SEARCHED) - {"optimizer", "lora_r"}
"""The run flags whose value is the ``Settings`` field of the same name, as it is."""


def run_values(args, base: dict | None = None) -> dict:
    """The run's values by key: ``base`` (a training config's: ``cli/plan_config.py``), then the
    flags the command line gave."""
    out = dict(base or {})
    if args.base_model:
        out["base_model"] = args.base_model
    return {**out, **given(args)}


def build_request(args, values: dict) -> PlanRequest:
    """The request of the parsed ``args`` (cluster, hardware, batch) and the run's ``values``."""
    if not values.get("base_model"):
        raise ValueError("--base-model is missing: give a preset (e.g. llama-3.1-8b) or a config.json")
    if not args.gpus:
        raise ValueError("--gpus is missing: give the number of GPUs (the world size)")
    own = {key: value for key, value in values.items() if key in SETTINGS}
    if values.get("qat"):
        problem = qat_format_problem(values["qat"])
        if problem:
            raise ValueError(problem)
    optimizer, fused = plan_optimizer(values.get("optimizer", DEFAULT_SETTINGS.optimizer))
    settings = DEFAULT_SETTINGS.but(**own, optimizer=optimizer, optimizer_fused=fused, **_adapter(values))
    global_batch = args.global_batch_size or values.get("global_batch_size")
    if args.global_batch_tokens:
        global_batch = args.global_batch_tokens // settings.sequence_len
    mb = str(values.get("micro_batch_size", "auto"))
    hardware = _hardware(args)
    host_mem = host_mem_bytes(args.host_mem) if args.host_mem else hardware.host_mem_per_node
    return PlanRequest(
        model=load_model_spec(values["base_model"]),
        hardware=hardware,
        gpus=args.gpus,
        gpus_per_node=min(args.gpus_per_node, args.gpus) if args.gpus_per_node else args.gpus,
        settings=settings,
        global_batch_size=global_batch,
        micro_batch_size=None if mb.lower() == "auto" else int(mb),
        activation_checkpointing=_switch(values.get("activation_checkpointing", "auto")),
        ac_policy=values.get("ac_policy"),
        activation_offloading=values.get("activation_offloading"),
        reshard_after_forward=values.get("reshard_after_forward"),
        tiled_mlp=values.get("tiled_mlp"),
        unsharded_grad_accumulation={"on": True, "off": False}.get(
            _switch(values.get("unsharded_grad_accumulation", "auto"))
        ),
        host_mem_bytes=host_mem,
        host_mem_preset=not args.host_mem and host_mem is not None,
        pipeline_parallel=not args.no_pipeline_parallel,
        pipeline_schedule=_schedule(values.get("pipeline_schedule", "auto")),
        pipeline_virtual_stages=values.get("pipeline_virtual_stages"),
    )


def _switch(value) -> str:
    """A searched switch's value: auto, on or off (true / false as on / off)."""
    text = str(value).lower()
    return {"true": "on", "false": "off"}.get(text, text)


def _adapter(values: dict) -> dict:
    """The adapter's settings (``lora_r``, ``load_in_4bit``, ``lora_saved``) that ``--adapter``, its
    rank (16 unless given) and ``--lora-modules-to-save`` give."""
    adapted = values.get("adapter", "none") in ("lora", "qlora")
    if values.get("lora_r") is not None and not adapted:
        raise ValueError("--lora-r needs --adapter lora (or qlora)")
    rank = (16 if values.get("lora_r") is None else values["lora_r"]) if adapted else 0
    saved = ()
    names = values.get("lora_modules_to_save")
    if names:
        if not adapted:
            raise ValueError("--lora-modules-to-save needs --adapter lora (or qlora)")
        text = names if isinstance(names, str) else ",".join(names)
        saved = saved_tables([n for n in text.split(",") if n])
        if not saved:
            raise ValueError(
                f"--lora-modules-to-save {text}: names no embedding or LM head "
                f"table the planner models ({', '.join(SAVED_MODULES)})"
            )
    if adapted and rank < 1:
        raise ValueError(f"--lora-r must be >= 1, got {rank}")
    return dict(lora_r=rank, load_in_4bit=values.get("adapter") == "qlora", lora_saved=saved)


def _schedule(name: str) -> str:
    try:
        return "auto" if name.lower() == "auto" else canonical(name)
    except ValueError as exc:
        raise ValueError(f"--pipeline-schedule {exc}") from None


def _hardware(args) -> hwmod.Hardware:
    hw = hwmod.load_hardware_file(args.hardware_file) if args.hardware_file else hwmod.get_preset(args.gpu)
    return hwmod.with_overrides(
        hw,
        mem_bytes=gpu_mem_bytes(args.gpu_mem) if args.gpu_mem else None,
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
        intra_node_bw=args.intra_node_bw * 1e9 if args.intra_node_bw else None,
        inter_node_bw=args.inter_node_bw * 1e9 if args.inter_node_bw else None,
        matmul_efficiency=args.matmul_efficiency,
        hbm_bw=args.hbm_bw * 1e9 if args.hbm_bw else None,
    )

"""Output of a plan: ranked rich table, JSON, one layout explained, the winner as a train config."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, fields

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.adapters.lora_cost import trainable_fraction, trainable_params
from ndparallel.plan.cli.explain_keys import layout_text
from ndparallel.plan.hardware import GiB
from ndparallel.plan.pipeline.schedule_model import pipeline_lines
from ndparallel.plan.search.estimate import Estimate
from ndparallel.plan.search.evaluation import HOST_BUDGET_FRACTION, host_mem_text
from ndparallel.plan.search.request import LayoutResult, PlanRequest, PlanResult
from ndparallel.plan.settings import Settings
from ndparallel.plan.time import links


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def _human_bytes(x: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            return f"{x / size:.1f} {unit}"
    return f"{int(x)} B"


def _ac(e: Estimate) -> str:
    return "on" if e.settings.activation_checkpointing else "off"


def _settings(e: Estimate) -> str:
    """The searched settings of an option beyond its micro-batch and schedule, in the YAML's words:
    the checkpointing policy (off, selective, full), offloaded, no reshard_after_forward, tiled MLP."""
    s = e.settings
    words = ["off" if s.recompute == "none" else s.ac_policy]
    words += ["offloaded"] if s.activation_offloading and s.activation_checkpointing else []
    words += ["no reshard"] if not s.reshard_after_forward else []
    words += ["tiled MLP"] if s.tiled_mlp else []
    return ", ".join(words)


def _schedule(e: Estimate) -> str:
    """A pp layout's pipeline schedule ('—' without pipeline parallel)."""
    if not e.layout.pp_enabled:
        return "—"
    s = e.settings
    return (
        s.pipeline_schedule
        + (f" v{s.pipeline_virtual_stages}" if s.pipeline_virtual_stages > 1 else "")
        + (", grads reduced once" if s.unsharded_grad_accumulation else "")
    )


def _strategy(e: Estimate) -> str:
    """The layout's name, with its pipeline schedule under pipeline parallel."""
    return e.layout.describe() + (f" · {_schedule(e)}" if e.layout.pp_enabled else "")


def _explain_arg(e: Estimate) -> str:
    """The ``--explain`` value naming this option's layout (and its pipeline schedule)."""
    s = e.settings
    pins = {"unsharded_grad_accumulation": "on"} if s.unsharded_grad_accumulation else {}
    if e.layout.pp_enabled:
        pins = {
            "pipeline_schedule": s.pipeline_schedule,
            "pipeline_virtual_stages": s.pipeline_virtual_stages,
            **pins,
        }
    return layout_text(e.layout, **pins)


def header(result: PlanResult) -> str:
    r = result.request
    s = r.settings
    hw = r.hardware
    gb = f"{r.global_batch_size} seqs" if r.global_batch_size else "~4M tokens (auto)"
    lora = ""
    if s.lora_r:
        lora = (
            f"; LoRA r={s.lora_r} on every linear: {trainable_params(r.model, s.lora_r) / 1e6:.1f}M "
            f"trainable ({trainable_fraction(r.model, s.lora_r):.2%}), base frozen"
            + (" in 4-bit NF4 (linears)" if s.load_in_4bit else "")
            + (
                f", trained copies of "
                f"{' and '.join({'embed': 'embed_tokens', 'head': 'lm_head'}[t] for t in s.lora_saved)}"
                if s.lora_saved
                else ""
            )
        )
    if s.qat:
        lora += f"; QAT {s.qat} (fake quantisers' saved tensors counted)"
    moe = (
        f", {r.model.active_params / 1e9:.2f}B active: {r.model.top_k} of {r.model.num_experts} experts"
        if r.model.is_moe
        else ""
    )
    return (
        f"{r.model.name} ({r.model.num_params / 1e9:.2f}B params{moe}) on {r.gpus} × {hw.name} "
        f"({r.gpus_per_node}/node, {_gib(hw.mem_bytes)} GiB, {hw.peak_flops / 1e12:.0f} "
        f"TFLOP/s bf16); seq {s.sequence_len}, global batch {gb}, {s.optimizer}, "
        f"{s.mixed_precision}, activation checkpointing {r.activation_checkpointing}{lora}"
        + (f"; offloading bounded by {host_mem_text(r)}" if r.host_mem_bytes else "")
    )


def print_table(result: PlanResult, console: Console, top: int = 10, show_rejected: bool = False) -> None:
    console.print(header(result))
    table = Table(title=f"Ranked layouts ({result.fit_count} fit, best {min(top, len(result.ranked))} shown)")
    rows = result.ranked[:top]
    pp = any(r.layout.pp_enabled for r in rows)
    for col in (
        "#",
        "pp:dr×ds×cp×tp" if pp else "dp_rep×dp_shard×cp×tp(+ep)",
        "strategy",
        *(("pp schedule",) if pp else ()),
        "mb",
        "ga",
        "AC, settings",
        "mem GiB",
        "step s",
        "tok/s/GPU",
        "MFU",
        "bottleneck",
    ):
        left = ("strategy", "pp schedule", "AC, settings", "bottleneck")
        table.add_column(col, justify="left" if col in left else "right")
    for i, r in enumerate(rows, 1):
        e = r.best
        sched = (_schedule(e),) if pp else ()
        table.add_row(
            str(i),
            r.layout.compact(),
            r.layout.describe(),
            *sched,
            str(e.settings.micro_batch_size),
            str(e.settings.gradient_accumulation_steps),
            _settings(e),
            _gib(e.memory.total),
            f"{e.time.step:.2f}",
            f"{e.tokens_per_s_per_gpu:,.0f}",
            f"{e.mfu:.1%}",
            e.bottleneck,
        )
    console.print(table)
    if not result.ranked:
        console.print(
            "[bold red]No layout fits.[/] Try more GPUs, activation checkpointing on, "
            "a shorter sequence or a smaller micro-batch."
        )
    by_code = Counter(r.rejections[0][0] for r in result.rejected)
    if by_code:
        console.print(
            f"Rejected {len(result.rejected)} layouts: "
            + ", ".join(f"{c} ×{n}" for c, n in by_code.most_common())
        )
    if show_rejected:
        rej = Table(title="Rejected layouts")
        rej.add_column("dp_rep×dp_shard×cp×tp")
        rej.add_column("why")
        for r in result.rejected:
            rej.add_row(r.layout.compact(), escape("; ".join(m for _, m in r.rejections)))
        console.print(rej)
    if result.ranked:
        best = result.ranked[0]
        console.print(f"Explain one: --explain {_explain_arg(best.best)}", soft_wrap=True)


def request_dict(req: PlanRequest) -> dict:
    """The request as one flat dict: its settings, then its own fields (model and hardware aside;
    the search's choices replace the settings' placeholders of the same name)."""
    own = {f.name: getattr(req, f.name) for f in fields(req)}
    for name in ("model", "hardware", "settings"):
        own.pop(name)
    return {**asdict(req.settings), **own}


def to_json(result: PlanResult) -> dict:
    req = result.request
    return {
        "model": req.model.to_dict(),
        "hardware": req.hardware.to_dict(),
        "request": request_dict(req),
        "ranked": [r.to_dict() for r in result.ranked],
        "rejected": [r.to_dict() for r in result.rejected],
    }


def explain_json(res: LayoutResult, result: PlanResult) -> dict:
    out = res.to_dict()
    out["options"] = [o.to_dict() for o in res.options]
    if res.best:
        out["collectives"] = _collective_rows(res.best, result)
    return out


def _collective_rows(e: Estimate, result: PlanResult) -> list[dict]:
    rows = []
    for c in e.collectives:
        sec, intra = links.cost(c, e.layout, result.request.hardware, result.request.gpus_per_node)
        rows.append(
            {
                "kind": c.kind,
                "mesh_dim": c.mesh_dim,
                "group_size": e.layout.size(c.mesh_dim),
                "bytes": c.bytes,
                "count": c.count,
                "what": c.what,
                "link": "intra-node" if intra else "inter-node",
                "seconds": sec,
                "overlap": c.overlap,
            }
        )
    return rows


def print_explain(res: LayoutResult, result: PlanResult, console: Console) -> None:
    console.print(header(result))
    lay = res.layout
    console.print(f"[bold]Layout {layout_text(lay)}[/] ({lay.world} ranks)")
    if not res.ok:
        console.print("[bold red]Rejected:[/]")
        for code, msg in res.rejections:
            console.print(escape(f"  [{code}] {msg}"))
        if not res.options:
            return
        e = min(res.options, key=lambda o: o.memory.total)
        console.print("Smallest-memory option, for reference:")
    else:
        e = res.best
        rank = (
            next(i for i, r in enumerate(result.ranked, 1) if r.layout == lay)
            if any(r.layout == lay for r in result.ranked)
            else None
        )
        where = f"rank {rank} of {len(result.ranked)}" if rank else "evaluated alone"
        console.print(
            f"{_strategy(e)} — {where}; best option micro_batch_size="
            f"{e.settings.micro_batch_size}, gradient_accumulation_steps="
            f"{e.settings.gradient_accumulation_steps}, activation_checkpointing {_ac(e)}"
            + (f" ({_settings(e)})" if e.settings.activation_checkpointing else f", {_settings(e)}")
        )
    if e.pipeline is not None:
        host_only = [code for code, _ in res.rejections] == ["host_oom"]
        for line in pipeline_lines(e, device_short=not host_only):
            console.print(line, soft_wrap=True)
    _print_memory(e, result.request, console, min(result.request.gpus_per_node, lay.world))
    _print_time(e, console)
    _print_collectives(e, result, console)
    _print_options(res, console)


def _print_memory(e: Estimate, req: PlanRequest, console: Console, per_node: int) -> None:
    """The memory table of ``e`` at its peak, against the GPU's capacity; offloading, the host
    memory of a GPU and of its node (``per_node`` GPUs) against the node's budget."""
    m, hw = e.memory, req.hardware
    mem = Table(title=f"Memory per GPU at the peak ({m.peak_phase})")
    mem.add_column("part")
    mem.add_column("GiB", justify="right")
    for name in (
        "params",
        "grads",
        "optimizer",
        "activations",
        "logits",
        "fsdp_buffers",
        "overhead",
        "total",
    ):
        mem.add_row(name, _gib(getattr(m, name)))
    mem.add_row("capacity", _gib(hw.mem_bytes))
    if m.host_offload:
        mem.add_row("host (pinned) memory: offloaded activations", _gib(m.host_offload))
        mem.add_row(f"  per node ({per_node} GPUs)", _gib(m.host_offload * per_node))
        if req.host_mem_bytes:
            source = ", the preset's" if req.host_mem_preset else ""
            budget = HOST_BUDGET_FRACTION * req.host_mem_bytes
            label = f"  node budget: {HOST_BUDGET_FRACTION:.0%} of {req.host_mem_bytes / GiB:.0f} GiB{source}"
            mem.add_row(label, _gib(budget))
    mem.add_row("peak allocated (torch.cuda.max_memory_allocated)", _gib(m.allocated))
    console.print(mem)
    console.print(
        "total = peak allocated + CUDA context/NCCL + fragmentation allowance; the "
        "caching allocator's reserved memory runs ~20-30 % above peak allocated (H200)."
    )


def _print_time(e: Estimate, console: Console) -> None:
    """The step time's parts, the compute by op class, the throughput."""
    t = e.time
    tim = Table(title="Step time (s)")
    tim.add_column("part")
    tim.add_column("seconds", justify="right")
    for name in (
        "compute",
        "tp_exposed",
        "cp_exposed",
        "dp_exposed",
        "ep_exposed",
        "optimizer",
        "offload_exposed",
        *(("pp_bubble", "pp_exposed") if e.pipeline is not None else ()),
        "step",
    ):
        tim.add_row(name, f"{getattr(t, name):.3f}")
    for dim, v in t.comm_total.items():
        link = "intra" if v["intra_node"] else "inter"
        tim.add_row(f"  {dim} traffic before overlap ({link}-node)", f"{v['seconds']:.3f}")
    console.print(tim)
    parts = Table(title="Compute by op class (one micro-batch; step extras per step), ms")
    parts.add_column("part")
    parts.add_column("ms", justify="right")
    for name, sec in t.compute_parts.items():
        parts.add_row(name, f"{sec * 1e3:.1f}")
    console.print(parts)
    console.print(
        f"tokens/s per GPU {e.tokens_per_s_per_gpu:,.0f}, MFU {e.mfu:.1%}, bottleneck: {e.bottleneck}"
    )


def _print_collectives(e: Estimate, result: PlanResult, console: Console) -> None:
    """Every collective one rank issues per step."""
    col = Table(title="Collectives per rank per step")
    for c in ("kind", "dim", "n", "link", "bytes/call", "calls", "seconds", "what"):
        col.add_column(c)
    for row in _collective_rows(e, result):
        col.add_row(
            row["kind"],
            row["mesh_dim"],
            str(row["group_size"]),
            row["link"],
            _human_bytes(row["bytes"]),
            str(row["count"]),
            f"{row['seconds']:.3f}",
            row["what"],
        )
    console.print(col)


def _print_options(res: LayoutResult, console: Console) -> None:
    """Every option the search compared for the layout (micro-batch, accumulation, checkpointing
    policy, offloading, resharding, tiling, schedule)."""
    if len(res.options) <= 1:
        return
    lay = res.layout
    opt = Table(title=f"Options of this layout ({len(res.options)} compared)")
    pp = lay.pp_enabled
    for c in (
        "mb",
        "ga",
        "AC, settings",
        *(("pp schedule",) if pp else ()),
        "mem GiB",
        "fits",
        "step s",
        "tok/s/GPU",
    ):
        opt.add_column(c, justify="right")
    for o in res.options:
        opt.add_row(
            str(o.settings.micro_batch_size),
            str(o.settings.gradient_accumulation_steps),
            _settings(o),
            *((_schedule(o),) if pp else ()),
            _gib(o.memory.total),
            "yes" if o.fits else "no",
            f"{o.time.step:.2f}",
            f"{o.tokens_per_s_per_gpu:,.0f}",
        )
    console.print(opt)


def train_config(e: Estimate, result: PlanResult) -> dict:
    """The estimate as a train config (``config_for`` its model, layout and settings)."""
    model = result.request.model
    return config_for(model.hf_id or model.name, e.layout, e.settings)


def config_for(base_model: str, layout: ParallelDims, s: Settings) -> dict:
    """A train config: the model, the layout's degrees, then the settings' keys
    (``Settings.yaml_keys``), the pipeline degree before its schedule."""
    cfg = {
        "base_model": base_model,
        "dp_replicate_size": layout.dp_replicate,
        "dp_shard_size": layout.dp_shard,
        "tensor_parallel_size": layout.tp,
        "context_parallel_size": layout.cp,
        **({"expert_parallel_size": layout.ep} if layout.ep > 1 else {}),
    }
    for key, value in s.yaml_keys(layout).items():
        cfg[key] = value
        if key == "optimizer" and layout.pp_enabled:  # the runtime's default: one pipeline micro-batch
            cfg["pipeline_parallel_size"] = layout.pp  # per accumulation step
    return cfg


def write_config(e: Estimate, result: PlanResult, path: str) -> None:
    cfg = train_config(e, result)
    note = (
        f"# Written by `ndparallel plan`: {e.layout.describe()}, predicted "
        f"{e.memory.total / GiB:.1f} GiB/GPU, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
        f"MFU {e.mfu:.1%}, on {result.request.gpus} × {result.request.hardware.name}\n"
    )
    with open(path, "w") as fh:
        fh.write(note)
        yaml.safe_dump(cfg, fh, sort_keys=False)

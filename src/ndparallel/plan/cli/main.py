"""``ndparallel plan`` arguments and entry point (wired into the main CLI by ``cli.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from rich.console import Console

from ndparallel.plan import hardware as hwmod
from ndparallel.plan.adapters.lora_cost import SAVED_MODULES, saved_tables
from ndparallel.plan.cli.flag_checks import check_args, gpu_mem_bytes, host_mem_bytes
from ndparallel.plan.cli.parser import add_plan_arguments, field_flags, parse_layout
from ndparallel.plan.cli.report import (
    explain_json,
    print_explain,
    print_table,
    to_json,
    write_config,
)
from ndparallel.plan.memory.qat_memory import qat_format_problem
from ndparallel.plan.models import load_model_spec
from ndparallel.plan.pipeline.schedule_model import canonical
from ndparallel.plan.search.evaluation import PlanRequest, evaluate_layout, plan
from ndparallel.plan.search.longest import CP_STRATEGIES, feature_summary, longest, print_longest
from ndparallel.plan.settings import Settings


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


def build_request(args) -> PlanRequest:
    if not args.model:
        raise ValueError("--model is missing: give a preset (e.g. llama-3.1-8b) or a config.json")
    if not args.gpus:
        raise ValueError("--gpus is missing: give the number of GPUs (the world size)")
    global_batch = args.global_batch_size
    if args.global_batch_tokens:
        global_batch = args.global_batch_tokens // args.seq_len
    mb = None if str(args.micro_batch).lower() == "auto" else int(args.micro_batch)
    adapter = _adapter_settings(args)
    if args.qat:
        problem = qat_format_problem(args.qat)
        if problem:
            raise ValueError(problem)
    settings = Settings(**flag_settings(args), **adapter)
    given = flag_settings(args, PlanRequest)  # the search's choices by their flags; those given as text:
    given.update(
        micro_batch=mb,
        unsharded_grad_accumulation={"on": True, "off": False}.get(args.unsharded_grad_accumulation),
        pipeline_schedule=_schedule(args.pipeline_schedule),
    )
    return PlanRequest(
        model=load_model_spec(args.model),
        hardware=_hardware(args),
        gpus=args.gpus,
        gpus_per_node=min(args.gpus_per_node, args.gpus) if args.gpus_per_node else args.gpus,
        settings=settings,
        global_batch=global_batch,
        checkpointing=args.activation_checkpointing,
        host_mem_bytes=host_mem_bytes(args.host_mem) if args.host_mem else None,
        pipeline=not args.no_pipeline_parallel,
        **given,
    )


BY_ADAPTER = tuple(f.name for f in fields(Settings) if "adapter" in f.metadata)
"""``Settings`` fields the adapter flags decide together (``build_request``), not one flag each
(``plan/field_marks.py``'s ``adapter``)."""


def _adapter_settings(args) -> dict:
    """The adapter's settings (``BY_ADAPTER``) that ``--adapter``, its rank (16 unless given) and
    ``--lora-modules-to-save`` give."""
    adapted = args.adapter in ("lora", "qlora")
    if args.lora_r is not None and not adapted:
        raise ValueError("--lora-r needs --adapter lora (or qlora)")
    rank = (16 if args.lora_r is None else args.lora_r) if adapted else 0
    saved = ()
    if args.lora_modules_to_save:
        if not adapted:
            raise ValueError("--lora-modules-to-save needs --adapter lora (or qlora)")
        names = [n for n in args.lora_modules_to_save.split(",") if n]
        saved = saved_tables(names)
        if not saved:
            raise ValueError(
                f"--lora-modules-to-save {args.lora_modules_to_save}: names no embedding or LM head "
                f"table the planner models ({', '.join(SAVED_MODULES)})"
            )
    if adapted and rank < 1:
        raise ValueError(f"--lora-r must be >= 1, got {rank}")
    return dict(lora_r=rank, quantized_base=args.adapter == "qlora", lora_saved=saved)


def flag_settings(args, cls: type = Settings) -> dict:
    """The values parsed ``args`` give the flagged fields of ``cls`` (``Settings``, or
    ``PlanRequest``'s search choices), by field name (``field_flags``)."""
    return {name: ff.value(args) for name, ff in field_flags(cls).items()}


def flag_defaults(s: Settings, mark: str = "flag") -> dict:
    """The parser's defaults (argument name -> value) that give ``s``'s values: ``flag_settings``
    inverted (``plan --config``); ``mark="adapter"``: those of the adapter's fields' flags."""
    out = {}
    for name, ff in field_flags(Settings, mark).items():
        value = getattr(s, name)
        out[ff.dest] = not value if ff.negated else value
    return out


def _schedule(name: str) -> str:

    try:
        return "auto" if name.lower() == "auto" else canonical(name)
    except ValueError as exc:
        raise ValueError(f"--pipeline-schedule {exc}") from None


def run_plan(args) -> int:
    """Run the planner for parsed ``args``; returns a process exit code."""
    console = Console(soft_wrap=False, width=max(Console().width, 140))
    try:
        check_args(args)
        if args.calibrate:
            return _run_calibrate(args, console)
        req = build_request(args)
        if args.max_seq_len:
            return _run_longest(args, req, console)
        result = plan(req)
        chosen = result.ranked[0] if result.ranked else None
        if args.explain:
            layout, pins = parse_layout(args.explain)
            chosen = evaluate_layout(req, layout, **pins)  # every option, fitting or not
            if args.json:
                print(json.dumps(explain_json(chosen, result), indent=2, default=str))
            else:
                print_explain(chosen, result, console)
        elif args.json:
            print(json.dumps(to_json(result), indent=2, default=str))
        else:
            print_table(result, console, top=args.top, show_rejected=args.show_rejected)
        if args.write_config:
            if chosen is None or not chosen.ok:
                console.print("[red]nothing to write: the layout does not fit[/]", style=None)
                return 1
            write_config(chosen.best, result, args.write_config)
            if not args.json:
                console.print(f"wrote {args.write_config}")
        return 0 if result.ranked or args.explain else 1
    except ValueError as exc:
        print(f"ndparallel plan: error: {exc}", file=sys.stderr)
        return 2


def _run_longest(args, req: PlanRequest, console: Console) -> int:
    if args.explain or args.write_config:
        raise ValueError(
            "--max-seq-len answers one question: leave out --explain / --write-config "
            "(then plan that length with --seq-len N)"
        )
    strategies = () if getattr(args, "cp_strategy_given", False) else CP_STRATEGIES  # else all
    rows = longest(req, strategies=strategies)
    summary = feature_summary(req, strategies=strategies)
    if args.json:
        print(
            json.dumps(
                {
                    "longest": [r.to_dict() for r in rows],
                    "summary": {k: (v.to_dict() if v else None) for k, v in summary.items()},
                },
                indent=2,
                default=str,
            )
        )
    else:
        print_longest(req, rows, summary, console, top=args.top)
    return 0 if any(r.seq_len for r in rows) else 1


def _run_calibrate(args, console: Console) -> int:
    from ndparallel.plan.calibrate.measure import calibrate

    model = load_model_spec(args.model) if args.model else None
    mb = 1 if str(args.micro_batch).lower() == "auto" else int(args.micro_batch)
    profile = calibrate(
        ranks=args.calibrate_ranks, quick=args.quick, model=model, seq_len=args.seq_len, micro_batch=mb
    )
    text = json.dumps(profile, indent=2)
    if args.calibrate_out:
        with open(args.calibrate_out, "w") as fh:
            fh.write(text)
        console.print(f"wrote {args.calibrate_out} (use it with --hardware-file)")
    if args.json or not args.calibrate_out:
        print(text)
    else:
        hw, m = profile["hardware"], profile["measurements"]
        console.print(
            f"GEMM {m['anchor_n']}³ bf16 {m['matmul_flops']['bfloat16'] / 1e12:.1f} TFLOP/s, fp32 "
            f"{m['matmul_flops']['float32'] / 1e12:.1f}; {len(hw['gemm_table'])} model GEMM shapes "
            f"measured; causal attention fwd/bwd "
            f"{'/'.join(f'{x:.0%}' for x in hw['attention_efficiency'][str(m['attention']['head_dim'])])}"
            f" of peak; element-wise "
            f"{m['elementwise']['stream'] / 1e9:.0f} GB/s (broadcast "
            f"{m['elementwise']['broadcast'] / 1e9:.0f}); {m['small_op']['host_s'] * 1e6:.1f} µs "
            f"per eager op"
        )
        console.print(m["note"])
    return 0


class PlanArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``ndparallel plan: error: ...``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"ndparallel plan: error: {message}\n")


def make_parser(
    description: str = "Rank parallel layouts for a model and cluster.",
) -> argparse.ArgumentParser:
    parser = PlanArgumentParser(prog="ndparallel plan", description=description)
    add_plan_arguments(parser)
    return parser


def main(argv: list[str] | None = None, description: str | None = None, defaults: dict | None = None) -> int:
    """``ndparallel plan`` on ``argv``; ``defaults`` (argument name -> value, e.g. from a training
    config) replace the parser's own, the flags in ``argv`` win over them."""
    parser = make_parser(*([description] if description else []))
    parser.set_defaults(**(defaults or {}))
    return run_plan(parser.parse_args(argv))

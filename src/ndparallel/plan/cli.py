"""``ndparallel plan`` arguments and entry point (wired into the main CLI by ``cli.py``)."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from ndparallel.plan import hardware as hwmod
from ndparallel.plan.adapter import SAVED_MODULES, saved_tables
from ndparallel.plan.cli_checks import check_args, gpu_mem_bytes, host_mem_bytes
from ndparallel.plan.layout import parse_layout
from ndparallel.plan.longest import feature_summary, longest, print_longest
from ndparallel.plan.models import PRESETS as MODEL_PRESETS
from ndparallel.plan.models import load_model_spec
from ndparallel.plan.pipeline import canonical
from ndparallel.plan.qat_memory import qat_format_problem
from ndparallel.plan.report import (
    explain_json,
    print_explain,
    print_table,
    to_json,
    write_config,
)
from ndparallel.plan.search import PlanRequest, evaluate_layout, plan


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the planner's options to ``parser``."""
    g = parser.add_argument_group("model and cluster")
    g.add_argument(
        "--config",
        metavar="TRAIN.yaml",
        help="plan for a training config: its base_model, sequence_len, batch, precision, "
        "optimizer, loss, CP strategy and LoRA become the defaults (flags given here "
        "win); with --write-config, OUT is that config with the planned layout",
    )
    g.add_argument("--model", help=f"preset ({', '.join(MODEL_PRESETS)}) or HF config.json / dir")
    g.add_argument("--gpus", type=int, help="total number of GPUs (world size)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    g.add_argument(
        "--gpu", default="h100-80gb", help=f"hardware preset: {', '.join(hwmod.PRESETS)} (default h100-80gb)"
    )
    g.add_argument("--hardware-file", help="hardware profile JSON (e.g. from --calibrate)")
    g.add_argument("--gpu-mem", help="override GPU memory, e.g. 80GB (GB = GiB here; a bare number is GB)")
    g.add_argument("--peak-tflops", type=float, help="override dense bf16 peak, TFLOP/s")
    g.add_argument("--intra-node-bw", type=float, help="override NVLink bandwidth, GB/s per GPU")
    g.add_argument("--inter-node-bw", type=float, help="override network bandwidth, GB/s per GPU")
    g.add_argument("--matmul-efficiency", type=float, help="fraction of peak an 8192³ GEMM reaches (0-1)")
    g.add_argument("--hbm-bw", type=float, help="override HBM bandwidth (spec), GB/s")
    t = parser.add_argument_group("training")
    t.add_argument("--seq-len", type=int, default=4096, help="sequence length (default 4096)")
    gb = t.add_mutually_exclusive_group()
    gb.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    gb.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    t.add_argument("--micro-batch", default="auto", help="micro-batch per GPU, or auto (1,2,4,8)")
    t.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto")
    t.add_argument(
        "--ac-policy",
        choices=("full", "selective"),
        default="full",
        help="checkpointing policy: full (ndparallel) or torchtitan's per-op "
        "selective policy (for comparisons; not run by ndparallel)",
    )
    t.add_argument("--mixed-precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    t.add_argument(
        "--optimizer",
        choices=("adamw", "sgd", "adamw_8bit", "adamw_4bit", "muon"),
        default="adamw",
        help="adamw_8bit / adamw_4bit: torchao's low-bit AdamW (train's adamw_8bit, "
        "paged_adamw_8bit, adamw_torch_4bit ...); muon: Muon + AdamW (plan/muon_cost.py)",
    )
    t.add_argument(
        "--no-sequence-parallel", action="store_true", help="TP with all-reduce instead of sequence parallel"
    )
    t.add_argument(
        "--no-loss-parallel",
        action="store_true",
        help="TP gathers full logits instead of a vocab-parallel loss",
    )
    t.add_argument(
        "--unsharded-grad-accumulation",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="accumulate unsharded gradients, reduce-scatter only after the last micro-batch "
        "(train's fsdp_config.unsharded_grad_accumulation); auto (default): pp layouts try "
        "both, others reduce-scatter every micro-batch",
    )
    t.add_argument(
        "--cp-strategy",
        choices=("ring", "allgather", "ulysses"),
        default="ring",
        help="context-parallel attention communication (train's cp_comm_strategy)",
    )
    t.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="FSDP keeps params unsharded between forward and backward",
    )
    t.add_argument(
        "--cp-kernel",
        choices=("flash", "math"),
        default="flash",
        help="CP block kernel (flash: what 'auto' runs on CUDA in bf16; math: fp32)",
    )
    t.add_argument(
        "--loss-impl",
        choices=("full", "chunked"),
        default="chunked",
        help="chunked: the trainer's memory-efficient loss (default); full: whole logits",
    )
    t.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=None,
        help="tokens per chunk of --loss-impl chunked (default: 256 MiB of fp32 logits)",
    )
    t.add_argument(
        "--fused-adamw",
        action="store_true",
        help="AdamW fused=True (default: torch's foreach AdamW, as the trainer)",
    )
    _add_adapter_arguments(t)
    _add_long_context_arguments(t)
    _add_pipeline_arguments(t)
    o = parser.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    o.add_argument("--show-rejected", action="store_true", help="list every rejected layout")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument(
        "--explain",
        metavar="LAYOUT",
        help="explain one layout: dp_replicate=2,dp_shard=4,cp=1,tp=8 or 2x4x1x8, with pp=N or "
        "pp16:1x64x1x8 for pipeline stages (optionally mb=2,ac=on,schedule=Interleaved1F1B,v=2,uga=on)",
    )
    o.add_argument(
        "--max-seq-len",
        action="store_true",
        help="find the longest sequence that trains, per layout (micro-batch 1), and "
        "compare the long-context options",
    )
    o.add_argument(
        "--write-config",
        metavar="OUT.yaml",
        help="write the best (or the --explain) layout as a train config",
    )
    c = parser.add_argument_group("calibration")
    c.add_argument(
        "--calibrate", action="store_true", help="measure this machine and print a hardware profile"
    )
    c.add_argument("--calibrate-ranks", type=int, help="ranks for collective measurements")
    c.add_argument("--calibrate-out", help="save the profile JSON here")
    c.add_argument("--quick", action="store_true", help="fewer/smaller calibration measurements")


def _add_adapter_arguments(t) -> None:
    t.add_argument(
        "--adapter",
        choices=("none", "lora", "qlora"),
        default="none",
        help="lora: LoRA on every linear layer, the base frozen in the compute dtype "
        "(train's adapter: lora, lora_target_linear: true); qlora: the same on a "
        "4-bit NF4 base (train's adapter: qlora, load_in_4bit: true)",
    )
    t.add_argument(
        "--lora-r", type=int, default=None, help="LoRA rank (default 16; needs --adapter lora or qlora)"
    )
    t.add_argument(
        "--lora-modules-to-save",
        metavar="NAMES",
        default=None,
        help="tables trained in full beside the adapters (train's lora_modules_to_save), "
        "e.g. embed_tokens,lm_head: a trained copy of each (one if tied)",
    )
    t.add_argument(
        "--qat",
        metavar="WEIGHT[/ACT]",
        default=None,
        help="quantisation-aware training (train's qat:): int4, int4/int8, int4/float8, "
        "float8/float8 or mxfp4/mxfp4; adds what the fake quantisers keep for backward",
    )


def _add_pipeline_arguments(t) -> None:
    t.add_argument(
        "--pipeline-schedule",
        default="auto",
        help="pipeline schedule of the pp layouts: auto (1F1B and Interleaved1F1B), GPipe, 1F1B, "
        "Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble (train's pipeline_schedule)",
    )
    t.add_argument(
        "--pipeline-virtual-stages",
        type=int,
        default=None,
        help="stages per rank of the interleaved / zero-bubble schedules (default 2)",
    )
    t.add_argument(
        "--no-pipeline-parallel",
        action="store_true",
        help="search layouts without pipeline parallel (pp = 1) only",
    )


def _add_long_context_arguments(t) -> None:
    t.add_argument("--tiled-mlp", action="store_true", help="sequence-tiled MLP (train's tiled_mlp: true)")
    t.add_argument(
        "--tiled-mlp-num-shards",
        type=int,
        default=None,
        help="tiles per MLP call (default: ceil(local tokens / hidden))",
    )
    t.add_argument(
        "--activation-offloading",
        action="store_true",
        help="checkpointed layer inputs in host memory (train's activation_offloading: "
        "true; turns checkpointing on)",
    )
    t.add_argument(
        "--host-mem",
        help="host memory per node, e.g. 2TB or 1900GB: with offloading, "
        "layouts needing more than 80 %% of it are rejected (default: not checked)",
    )


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
    adapted = args.adapter in ("lora", "qlora")
    if args.lora_r is not None and not adapted:
        raise ValueError("--lora-r needs --adapter lora (or qlora)")
    lora_r = (16 if args.lora_r is None else args.lora_r) if adapted else 0
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
    if adapted and lora_r < 1:
        raise ValueError(f"--lora-r must be >= 1, got {lora_r}")
    if args.qat:
        problem = qat_format_problem(args.qat)
        if problem:
            raise ValueError(problem)
    return PlanRequest(
        model=load_model_spec(args.model),
        hardware=_hardware(args),
        gpus=args.gpus,
        gpus_per_node=min(args.gpus_per_node, args.gpus) if args.gpus_per_node else args.gpus,
        seq_len=args.seq_len,
        global_batch=global_batch,
        micro_batch=mb,
        checkpointing=args.activation_checkpointing,
        ac_policy=args.ac_policy,
        mixed_precision=args.mixed_precision,
        optimizer=args.optimizer,
        sequence_parallel=not args.no_sequence_parallel,
        reshard_after_forward=not args.no_reshard_after_forward,
        loss_parallel=not args.no_loss_parallel,
        unsharded_grad_accumulation={"on": True, "off": False}.get(args.unsharded_grad_accumulation),
        cp_strategy=args.cp_strategy,
        cp_kernel=args.cp_kernel,
        loss_impl=args.loss_impl,
        loss_chunk_tokens=args.loss_chunk_tokens,
        optimizer_fused=args.fused_adamw,
        lora_r=lora_r,
        quantized_base=args.adapter == "qlora",
        qat=args.qat,
        lora_saved=saved,
        tiled_mlp=args.tiled_mlp,
        tiled_mlp_num_shards=args.tiled_mlp_num_shards,
        activation_offloading=args.activation_offloading,
        host_mem_bytes=host_mem_bytes(args.host_mem) if args.host_mem else None,
        pipeline=not args.no_pipeline_parallel,
        pipeline_schedule=_schedule(args.pipeline_schedule),
        pipeline_virtual_stages=args.pipeline_virtual_stages,
    )


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
            layout, extras = parse_layout(args.explain)
            if extras:
                chosen = evaluate_layout(
                    req,
                    layout,
                    extras.get("micro_batch"),
                    extras.get("checkpointing"),
                    extras.get("pipeline_schedule"),
                    extras.get("pipeline_virtual_stages"),
                    extras.get("unsharded_grad_accumulation"),
                )
            else:
                chosen = evaluate_layout(req, layout)  # every option, fitting or not
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
    rows = longest(req)
    summary = feature_summary(req)
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
    from ndparallel.plan.calibrate import calibrate

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

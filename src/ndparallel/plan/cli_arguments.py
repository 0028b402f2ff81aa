"""The ``ndparallel plan`` command line's options, one group per concern (``cli.py`` runs them)."""

from __future__ import annotations

import argparse

from ndparallel.plan import hardware as hwmod
from ndparallel.plan.models import PRESETS as MODEL_PRESETS


class _StoreGiven(argparse.Action):
    """``store``, and ``<dest>_given`` set: the user named the value (a default does not)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the planner's options to ``parser``."""
    _add_cluster_arguments(parser.add_argument_group("model and cluster"))
    t = parser.add_argument_group("training")
    _add_batch_and_precision_arguments(t)
    _add_kernel_and_communication_arguments(t)
    _add_adapter_arguments(t)
    _add_long_context_arguments(t)
    _add_pipeline_arguments(t)
    _add_output_arguments(parser.add_argument_group("output"))
    _add_calibration_arguments(parser.add_argument_group("calibration"))


def _add_cluster_arguments(g) -> None:
    """The model, the cluster and its hardware."""
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


def _add_batch_and_precision_arguments(t) -> None:
    """Sequence, batch, checkpointing, precision, optimizer."""
    t.add_argument("--seq-len", type=int, default=4096, help="sequence length (default 4096)")
    gb = t.add_mutually_exclusive_group()
    gb.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    gb.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    t.add_argument("--micro-batch", default="auto", help="micro-batch per GPU, or auto (1,2,4,8)")
    t.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto")
    t.add_argument(
        "--ac-policy",
        choices=("full", "selective", "op"),
        default="full",
        help="checkpointing policy (fsdp_config.ac_policy): full recomputes each layer; "
        "selective only the norms and the MLP activation (Megatron's scheme); op: torchtitan's "
        "per-op policy (for comparisons; not run by ndparallel)",
    )
    t.add_argument("--mixed-precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    t.add_argument(
        "--optimizer",
        choices=("adamw", "sgd", "adamw_8bit", "adamw_4bit", "muon"),
        default="adamw",
        help="adamw_8bit / adamw_4bit: torchao's low-bit AdamW (train's adamw_8bit, "
        "paged_adamw_8bit, adamw_torch_4bit ...); muon: Muon + AdamW (plan/muon_cost.py)",
    )


def _add_kernel_and_communication_arguments(t) -> None:
    """TP, CP and FSDP communication, the loss and AdamW kernels."""
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
        action=_StoreGiven,
        help="context-parallel attention communication (train's cp_comm_strategy); --max-seq-len "
        "tries each unless this is given",
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
        dest="optimizer_fused",
        action="store_true",
        help="AdamW fused=True (default: torch's foreach AdamW, as the trainer)",
    )


def _add_output_arguments(o) -> None:
    """What the planner prints or writes."""
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


def _add_calibration_arguments(c) -> None:
    """Measuring this machine (``--calibrate``)."""
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
        help="what checkpointing keeps in host memory: full, the layer inputs; selective, its "
        "saved tensors but down_proj's output (train's activation_offloading: true; turns "
        "checkpointing on)",
    )
    t.add_argument(
        "--host-mem",
        help="host memory per node, e.g. 2TB or 1900GB: with offloading, "
        "layouts needing more than 80 %% of it are rejected (default: not checked)",
    )

"""``ndparallel export CKPT OUT``: argument parsing and error reporting around
``ndparallel.checkpoint.export.export_checkpoint``."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from ndparallel.checkpoint.directory import find_resume_checkpoint, list_checkpoints
from ndparallel.checkpoint.export import DTYPES, export_checkpoint
from ndparallel.cli.args import Parser, fail
from ndparallel.models.adapter_files import ADAPTER_CONFIG
from ndparallel.runtime.startup import import_model_libraries


def export_main(argv: Sequence[str] | None = None) -> int:
    """``ndparallel export CKPT OUT [--config C] [--dtype bf16] [--max-shard-size 5GB] [--tokenizer T]
    [--merge [--base DIR]]``."""
    parser = _export_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    ckpt, out_dir = Path(args.checkpoint), Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        return fail("export", f"OUT_DIR {out_dir} is a file: give a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.overwrite:
        held = ", ".join(sorted(p.name for p in out_dir.iterdir())[:4])
        return fail(
            "export",
            f"OUT_DIR {out_dir} is not empty ({held}): pick a new directory, or pass "
            "--overwrite to replace its model and config files",
        )
    if args.base is not None and not args.merge:
        return fail("export", "--base is the base model of --merge: add --merge (or drop --base)")
    if args.nf4 and not args.merge:
        return fail("export", "--nf4 is for --merge of a QLoRA adapter: add --merge (or drop --nf4)")
    dtype = DTYPES.get(args.dtype) if args.dtype else None
    import_model_libraries()  # the arguments are sound: what reads and writes the model, collector paused
    try:
        if not (ckpt / "COMPLETE").exists() and list_checkpoints(ckpt):
            found = find_resume_checkpoint(ckpt, "auto")
            if found is None:
                raise ValueError(f"{ckpt} holds no complete checkpoint")
            print(f"ndparallel export: using {found}")
            ckpt = found
        if args.merge:
            out = _merge(ckpt, out_dir, args, dtype)
        else:
            if (ckpt / ADAPTER_CONFIG).is_file():
                raise ValueError(
                    f"{ckpt} is a PEFT adapter directory: add --merge [--base DIR] to merge "
                    "it into its base model"
                )
            out = export_checkpoint(
                ckpt,
                args.out_dir,
                args.config,
                tokenizer=args.tokenizer,
                dtype=dtype,
                max_shard_size=args.max_shard_size,
            )
    except (ValueError, OSError) as exc:
        return fail("export", exc)
    print(f"ndparallel export: wrote {out}")
    return 0


def _export_parser() -> Parser:
    """The arguments of ``ndparallel export``."""
    parser = Parser(
        prog="ndparallel export",
        description="Turn a sharded checkpoint (any layout) into a Hugging Face safetensors directory, "
        "on one process without GPUs. CKPT: a checkpoint-N dir, or an output_dir (its "
        "newest complete checkpoint is used). A LoRA run's checkpoint becomes a PEFT adapter "
        "directory (adapter_config.json + adapter_model.safetensors), or with --merge the base "
        "model with the adapter merged in.",
    )
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument(
        "--config",
        default=None,
        help="HF model dir / config.json / preset (default: the config stored in the checkpoint)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer dir or hub id to save alongside")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA: write the base model with the adapter merged in (streamed tensor by "
        "tensor); CKPT may also be a PEFT adapter directory",
    )
    parser.add_argument(
        "--base",
        default=None,
        help="with --merge: the base model directory (default: the adapter's base_model_name_or_path)",
    )
    parser.add_argument(
        "--nf4",
        action="store_true",
        help="with --merge of a PEFT adapter directory trained with QLoRA: merge into the "
        "NF4-quantised-and-dequantised base, as trained (a QLoRA checkpoint: automatic)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty OUT_DIR (its model and config files are replaced)",
    )
    return parser


def _merge(ckpt: Path, out_dir: Path, args, dtype) -> Path:
    """``--merge``: a PEFT adapter directory as is, a LoRA checkpoint through its adapter export."""
    import tempfile

    from ndparallel.checkpoint.adapter_export import (
        export_adapter_checkpoint,
        is_adapter_checkpoint,
    )
    from ndparallel.checkpoint.adapter_merge import (
        checkpoint_quantization,
        merge_adapter_files,
    )
    from ndparallel.models.quantized import NF4Config

    kwargs = dict(base=args.base, dtype=dtype, max_shard_size=args.max_shard_size, tokenizer=args.tokenizer)
    if (ckpt / ADAPTER_CONFIG).is_file():
        return merge_adapter_files(ckpt, out_dir, nf4=NF4Config() if args.nf4 else None, **kwargs)
    nf4, nf4_dtype = checkpoint_quantization(ckpt)
    if nf4 is not None:
        print(
            "ndparallel export: a QLoRA checkpoint (load_in_4bit): merging into the NF4-quantised base it "
            "was "
            "trained on (dequantised)"
        )
        kwargs.update(nf4=nf4, nf4_dtype=nf4_dtype)
    if not is_adapter_checkpoint(ckpt):
        raise ValueError(
            f"--merge needs a LoRA run's checkpoint or a PEFT adapter directory; {ckpt} is "
            "neither (a full fine-tuning checkpoint exports without --merge)"
        )
    with tempfile.TemporaryDirectory(prefix=".ndparallel-adapter-") as tmp:  # small: r × d tensors
        adapter = export_adapter_checkpoint(ckpt, tmp)
        return merge_adapter_files(adapter, out_dir, **kwargs)

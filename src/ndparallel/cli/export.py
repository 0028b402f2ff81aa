"""``ndparallel export CKPT OUT``: argument parsing and error reporting around
``ndparallel.checkpoint.export.export_checkpoint``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from ndparallel.checkpoint.directory import find_resume_checkpoint, list_checkpoints
from ndparallel.checkpoint.export import DTYPES, export_checkpoint
from ndparallel.cli.args import Parser, fail


def export_main(argv: Sequence[str] | None = None) -> int:
    """``ndparallel export CKPT OUT [--config C] [--dtype bf16] [--max-shard-size 5GB] [--tokenizer T]``."""
    parser = Parser(
        prog="ndparallel export",
        description="Turn a sharded checkpoint (any layout) into a Hugging Face safetensors directory, "
                    "on one process without GPUs. CKPT: a checkpoint-N dir, or an output_dir (its "
                    "newest complete checkpoint is used). A LoRA run's checkpoint becomes a PEFT adapter "
                    "directory (adapter_config.json + adapter_model.safetensors).")
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--config", default=None, help="HF model dir / config.json / preset (default: "
                        "the config stored in the checkpoint)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer dir or hub id to save alongside")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty OUT_DIR (its model and config files are replaced)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    ckpt, out_dir = Path(args.checkpoint), Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        return fail("export", f"OUT_DIR {out_dir} is a file: give a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not args.overwrite:
        held = ", ".join(sorted(p.name for p in out_dir.iterdir())[:4])
        return fail("export", f"OUT_DIR {out_dir} is not empty ({held}): pick a new directory, or pass "
                              "--overwrite to replace its model and config files")
    try:
        if not (ckpt / "COMPLETE").exists() and list_checkpoints(ckpt):
            found = find_resume_checkpoint(ckpt, "auto")
            if found is None:
                raise ValueError(f"{ckpt} holds no complete checkpoint")
            print(f"ndparallel export: using {found}")
            ckpt = found
        out = export_checkpoint(ckpt, args.out_dir, args.config, tokenizer=args.tokenizer,
                                dtype=DTYPES.get(args.dtype) if args.dtype else None,
                                max_shard_size=args.max_shard_size)
    except (ValueError, OSError) as exc:
        return fail("export", exc)
    print(f"ndparallel export: wrote {out}")
    return 0

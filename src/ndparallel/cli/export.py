"""``ndparallel export CKPT OUT``: argument parsing and error reporting around
``ndparallel.checkpoint.export.export_checkpoint``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from ndparallel.checkpoint.directory import find_resume_checkpoint, list_checkpoints
from ndparallel.checkpoint.export import DTYPES, export_checkpoint


def export_main(argv: Sequence[str] | None = None) -> int:
    """``ndparallel export CKPT OUT [--config C] [--dtype bf16] [--max-shard-size 5GB] [--tokenizer T]``."""
    parser = argparse.ArgumentParser(
        prog="ndparallel export",
        description="Turn a sharded checkpoint (any layout) into a Hugging Face safetensors directory, "
                    "on one process without GPUs. CKPT: a checkpoint-N dir, or an output_dir (its "
                    "newest complete checkpoint is used).")
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--config", default=None, help="HF model dir / config.json / preset (default: "
                        "the config stored in the checkpoint)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating tensors")
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer dir or hub id to save alongside")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    ckpt = Path(args.checkpoint)
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
        print(f"ndparallel export: error: {exc}", file=sys.stderr)
        return 1
    print(f"ndparallel export: wrote {out}")
    return 0

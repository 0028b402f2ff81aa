"""One speed option of ``bench/gpu_single.py`` as a ``bench/gpu_all.sh`` step of its own: tokens/s and
MFU of ``nd + compile`` (regional ``torch.compile`` of the decoder layers) or ``nd + fp8`` (+ torchao
float8 linears) beside ``nd eager`` (bf16) and Hugging Face Accelerate's loop, Llama-3.2-1B shape,
one GPU.

The rows are measured once, in ``perf_2048``'s process (``gpu_single.py`` runs all six loops on the
same model, batch and optimizer, and checks every row's loss against eager's): this step reads its
``gpu_single_2048.json`` from ``$BENCH_RESULTS_DIR``, so the suite's smoke pays no second model build
or compile. Where that file is absent (``--only compile``, or ``perf_2048`` cut short), it runs
``gpu_single.py`` for the three rows it needs itself.

    python bench/gpu_row.py compile [--tiny]     # HEADLINE: the row's tok/s and MFU vs eager / Accelerate
    python bench/gpu_row.py fp8 [--tiny]

Exit 0 when the row ran within its loss tolerance, 1 when it raised or drifted, 77 (SKIP) when
``gpu_single.py`` skipped it (fp8 below compute capability 8.9: the reason is the headline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROWS = {"compile": "nd + compile", "fp8": "nd + fp8"}
SOURCE = "gpu_single_2048"
"""perf_2048's results (``gpu_all.sh``: ``gpu_single.py --name gpu_single_2048``)."""


def results_dir() -> Path:
    """``_common.results_dir`` without importing torch (this step only reads a JSON)."""
    return Path(os.environ.get("BENCH_RESULTS_DIR") or Path(__file__).resolve().parent / "results")


def measure(option: str, tiny: bool) -> Path:
    """Run ``gpu_single.py`` for Accelerate, eager and the option's row (the file was absent)."""
    variants = ",".join(("accelerate", "nd eager", ROWS[option]))
    seqs = "32" if tiny else "2048"
    name = f"{SOURCE}_{option}"
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_single.py")), "--seqs", seqs]
    cmd += ["--variants", variants, "--name", name, *(["--tiny"] if tiny else [])]
    subprocess.run(cmd, check=False)  # its rows land in the JSON even when one fails
    return results_dir() / f"{name}.json"


def summarise(option: str, payload: dict) -> tuple[int, str]:
    """(exit code, headline) of the option's row in ``gpu_single.py``'s results."""
    row = ROWS[option]
    texts, code = [], 0
    for seq, rows in payload["results"].items():
        r = rows.get(row)
        if r is None:
            return 1, f"seq {seq}: no {row!r} row in the results"
        if "skipped" in r:
            return 77, f"skipped: {r['skipped']}"
        if "error" in r:
            return 1, f"seq {seq}: {row} raised: {r['error'][:200]}"
        eager, acc = rows.get("nd eager", {}), rows.get("accelerate", {})
        text = f"seq {seq}: {row} {r['tokens_per_s']:,.0f} tok/s"
        if r.get("mfu") is not None:
            text += f", MFU {r['mfu']:.1%}"
        if eager.get("tokens_per_s"):
            text += f", {r['tokens_per_s'] / eager['tokens_per_s']:.2f}x eager bf16"
            text += f" ({eager['mfu']:.1%} MFU)" if eager.get("mfu") is not None else ""
        if acc.get("tokens_per_s"):
            text += f", {r['tokens_per_s'] / acc['tokens_per_s']:.2f}x Accelerate"
        text += f", peak {r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else ""
        if not r.get("drift_ok", True):
            code = 1
            text += f", loss drift {r['drift']:.2%} FAIL"
        texts.append(text)
    return code, "; ".join(texts) + (f" ({payload['device']})" if payload.get("device") else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("option", choices=sorted(ROWS))
    ap.add_argument("--tiny", action="store_true", help="gpu_single.py's CPU form when it must run")
    args = ap.parse_args(argv)
    path = results_dir() / f"{SOURCE}.json"
    if path.exists():
        print(f"gpu_row: {ROWS[args.option]} from {path} (measured by perf_2048)")
    else:
        path = measure(args.option, args.tiny)
    if not path.exists():
        print(f"HEADLINE: gpu_single.py wrote no results ({path})")
        return 1
    code, text = summarise(args.option, json.loads(path.read_text()))
    print(f"HEADLINE: {text}")
    return code


if __name__ == "__main__":
    sys.exit(main())

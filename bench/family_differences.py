"""How far each cell of the family matrix is from one process (issue 39): the largest differences.

    python bench/family_differences.py [--layouts 'FSDP 2,CP 2'] [--families 'Llama,Gemma 4']

Runs the cells of ``tests/test_family_matrix.py`` — the same tiny models (``shrink_model`` of each
config class's defaults, saved by ``save_pretrained``), the same 2 SGD steps on packed rows, the
same per-family settings, the same pre-launch refusals — and prints, per family and layout, the
largest relative parameter difference from one process (max |diff| / max |reference| of a tensor)
with the tensor it is in, and the largest relative loss and gradient-norm differences. The test
checks each cell against the tolerances; this shows where in them each one lies. Markdown table on
stdout, JSON in bench/results/family_differences.json. ~2-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> int:
    import torch
    import transformers

    from ndparallel.testing import run_on_ranks
    from ndparallel.tools.equivalence import compare
    from ndparallel.tools.shrink import shrink_model
    from test_family_matrix import (
        FAMILIES,
        LAYOUTS,
        PARAM_TOL,
        TOL,
        _setup,
        prelaunch_verdict,
        short_reason,
        train_families,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated layout names")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated family names")
    args = ap.parse_args(argv)
    layouts = [n.strip() for n in args.layouts.split(",")]
    families = [n.strip() for n in args.families.split(",")]
    unknown = [n for n in layouts if n not in LAYOUTS] + [n for n in families if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown layout or family {unknown}; choose from {list(LAYOUTS)} and {list(FAMILIES)}")
    cells: dict[str, dict[str, dict | str]] = {f: {} for f in families}
    with tempfile.TemporaryDirectory() as tmp:
        saved = {}
        for name in families:
            config = shrink_model(getattr(transformers, FAMILIES[name])(), tp_size=2, cp_size=2).config
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(Path(tmp) / name)
            saved[name] = str(Path(tmp) / name)
        reference = run_on_ranks(
            train_families, 1, {n: _setup(p, {}, n) for n, p in saved.items()}, None, timeout_s=900
        )[0]
        for layout_name in layouts:
            layout, extra = LAYOUTS[layout_name]
            runnable = {}
            for name, path in saved.items():
                verdict = prelaunch_verdict(path, layout, extra)
                if verdict is None:
                    runnable[name] = _setup(path, extra, name)
                else:
                    cells[name][layout_name] = f"refused: {short_reason(verdict)}"
            world = 1
            for v in layout.values():
                world *= v
            got = run_on_ranks(train_families, world, runnable, layout, timeout_s=900)[0]
            for name in runnable:
                result = got[name]
                cells[name][layout_name] = (
                    result if isinstance(result, str) else compare(reference[name], result)
                )
            print(f"{layout_name}: done", file=sys.stderr, flush=True)
    print(
        f"largest relative parameter difference from one process after 2 SGD steps (the test's tolerances: "
        f"losses and gradient norms {TOL:g} relative, parameters {PARAM_TOL:g} absolute)\n"
    )
    print("| family | " + " | ".join(layouts) + " |\n|---|" + "---|" * len(layouts))
    for name in families:
        row = []
        for layout_name in layouts:
            cell = cells[name][layout_name]
            row.append(
                cell
                if isinstance(cell, str)
                else f"{cell['param_rel']:.0e} (`{_short(cell['param_rel_tensor'])}`)"
            )
        print(f"| {name} | " + " | ".join(row) + " |")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "family_differences.json").write_text(json.dumps(cells, indent=1, default=str))
    return 0


def _short(tensor: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.self_attn.q_proj``."""
    return tensor.removeprefix("model.").removesuffix(".weight")


if __name__ == "__main__":
    sys.exit(main())

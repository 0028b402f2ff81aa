"""``ndparallel plan``'s entry point: the flags parsed once (``parser.py``), the request they give
(``from_flags.py``), and what the planner answers (``report.py``, ``search/longest.py``,
``calibrate/``). ``cli/__init__.py`` adds ``--config TRAIN.yaml``: a training config's values
under the flags (``run_plan``'s ``base``)."""

from __future__ import annotations

import json
import sys

from rich.console import Console

from ndparallel.plan.cli.explain_keys import parse_layout
from ndparallel.plan.cli.flag_checks import check_args
from ndparallel.plan.cli.from_flags import build_request, run_values
from ndparallel.plan.cli.parser import parse
from ndparallel.plan.cli.report import explain_json, print_explain, print_table, to_json, write_config
from ndparallel.plan.models import load_model_spec
from ndparallel.plan.search.evaluation import evaluate_layout, plan
from ndparallel.plan.search.longest import CP_STRATEGIES, feature_summary, longest, print_longest
from ndparallel.plan.search.request import DEFAULT_SETTINGS, PlanRequest


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    """``ndparallel plan`` on ``argv``."""
    return run_plan(parse(argv, description))


def run_plan(args, base: dict | None = None, said: dict | None = None) -> int:
    """Run the planner for parsed ``args`` (``base``: a training config's run values, by key, under
    the flags given; ``said``: what ``--json`` adds about them, e.g. the config's ``rows``);
    returns a process exit code."""
    console = Console(soft_wrap=False, width=max(Console().width, 140))
    try:
        values = run_values(args, base)
        check_args(args, values)
        if args.calibrate:
            return _run_calibrate(args, values, console)
        req = build_request(args, values)
        if args.max_seq_len:
            return _run_longest(args, req, console, pinned="cp_comm_strategy" in values)
        # the table and its best row need the best --top layouts; --json and --explain every one
        result = plan(req, top=None if args.json or args.explain else args.top)
        chosen = result.ranked[0] if result.ranked else None
        if args.explain:
            layout, pins = parse_layout(args.explain)
            chosen = evaluate_layout(req, layout, **pins)  # every option, fitting or not
            if args.json:
                print(json.dumps({**explain_json(chosen, result), **(said or {})}, indent=2, default=str))
            else:
                print_explain(chosen, result, console)
        elif args.json:
            print(json.dumps({**to_json(result), **(said or {})}, indent=2, default=str))
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


def _run_longest(args, req: PlanRequest, console: Console, pinned: bool) -> int:
    if args.explain or args.write_config:
        raise ValueError(
            "--max-seq-len answers one question: leave out --explain / --write-config "
            "(then plan that length with --sequence-len N)"
        )
    strategies = () if pinned else CP_STRATEGIES  # a CP strategy given: that one, else each
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
    return 0 if any(r.sequence_len for r in rows) else 1


def _run_calibrate(args, values: dict, console: Console) -> int:
    from ndparallel.plan.calibrate.measure import calibrate

    model = load_model_spec(values["base_model"]) if values.get("base_model") else None
    mb = str(values.get("micro_batch_size", "auto"))
    seq = values.get("sequence_len", DEFAULT_SETTINGS.sequence_len)
    profile = calibrate(
        ranks=args.calibrate_ranks,
        quick=args.quick,
        model=model,
        seq_len=seq,
        micro_batch=1 if mb.lower() == "auto" else int(mb),
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

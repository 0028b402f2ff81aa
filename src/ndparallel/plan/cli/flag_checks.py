"""Range checks of ``ndparallel plan``'s flags: each bad value becomes one ``ValueError`` line that
names the flag and the fix (the CLI prints ``ndparallel plan: error: <line>`` and exits 2)."""

from __future__ import annotations

import json
from pathlib import Path

from ndparallel.plan import hardware as hwmod
from ndparallel.plan.cli.parser import field_flags
from ndparallel.plan.search.evaluation import PlanRequest
from ndparallel.plan.settings import Settings
from ndparallel.runtime.sizes import parse_size

MIN_GPU_MEM = hwmod.GiB
"""Below 1 GiB a ``--gpu-mem`` value is taken for a unit slip (``96MB`` for ``96GB``)."""


def _dest(flag: str) -> str:
    """The argument name argparse gives ``flag`` (``--seq-len`` -> ``seq_len``)."""
    return flag.lstrip("-").replace("-", "_")


def _positive_int(args, flag: str, value=None) -> None:
    v = getattr(args, _dest(flag)) if value is None else value
    if v is not None and v < 1:
        raise ValueError(f"{flag} {v}: must be a whole number >= 1")


def _positive(args, flag: str, unit: str) -> None:
    v = getattr(args, _dest(flag))
    if v is not None and not v > 0:
        raise ValueError(f"{flag} {v}: must be > 0 ({unit})")


def gpu_mem_bytes(text: str, minimum: float = MIN_GPU_MEM) -> float:
    """``--gpu-mem``: '80GB', '141GiB', or a bare number of GB (GB = GiB, as GPU memory is
    quoted and as ``mem_bytes`` is reported). Below ``minimum`` (1 GiB: a unit slip for a GPU's
    memory) is refused; ``simulate`` passes a smaller floor for the budgets of tiny CPU models."""
    try:
        value = parse_size(text, gb_is_gib=True, bare_unit="gib")
    except ValueError:
        raise ValueError(
            f"--gpu-mem {text!r}: not a size; write e.g. 80GB or 141GiB (a bare number is read as GB)"
        ) from None
    if not value > 0:
        raise ValueError(f"--gpu-mem {text!r}: must be > 0 (e.g. 80GB)")
    if value < minimum:
        raise ValueError(
            f"--gpu-mem {text!r} is {value / hwmod.GiB:.3g} GiB: below 1 GiB, "
            "probably a unit slip; write e.g. 80GB"
        )
    return value


def host_mem_bytes(text: str) -> float:
    """``--host-mem``: host memory per node, '2TB', '1900GB' (GB = GiB; a bare number is GB)."""
    try:
        value = parse_size(text, gb_is_gib=True, bare_unit="gib")
    except ValueError:
        raise ValueError(f"--host-mem {text!r}: not a size; write e.g. 2TB or 1900GB (per node)") from None
    if value < MIN_GPU_MEM:
        raise ValueError(
            f"--host-mem {text!r} is {value / hwmod.GiB:.3g} GiB: below 1 GiB, probably a "
            "unit slip; write e.g. 1900GB"
        )
    return value


def _field_flags(args, cls: type) -> None:
    """The checks the flags of ``cls``' fields declare (``plan/field_marks.py``'s ``flag``)."""
    flags = field_flags(cls)
    for ff in flags.values():
        value = ff.value(args)
        if ff.how.get("positive"):
            _positive_int(args, ff.option, value)
        needs = flags.get(ff.how.get("needs"))
        if value and needs and not needs.value(args):
            raise ValueError(f"{ff.option} needs {needs.option}")
        other, bad, why = ff.how.get("refuses", (None, None, None))
        if value and other and getattr(args, other) == bad:
            raise ValueError(f"{ff.option} {why}: drop --{other.replace('_', '-')} {bad}")


def _micro_batch(args) -> None:
    text = str(args.micro_batch).strip().lower()
    if text == "auto":
        return
    try:
        mb = int(text)
    except ValueError:
        raise ValueError(f"--micro-batch {args.micro_batch!r}: use a whole number >= 1 or 'auto'") from None
    _positive_int(args, "--micro-batch", mb)


def _cluster(args) -> None:
    _positive_int(args, "--gpus")
    _positive_int(args, "--gpus-per-node")
    gpus, per_node = args.gpus, args.gpus_per_node
    if gpus and per_node and gpus > per_node and gpus % per_node:
        lo, hi = gpus // per_node * per_node, -(-gpus // per_node) * per_node
        fits = [d for d in range(2, gpus + 1) if gpus % d == 0 and d <= 16]
        raise ValueError(
            f"--gpus {gpus} with --gpus-per-node {per_node}: the planner places whole nodes, and "
            f"{gpus} is not a multiple of {per_node}; use --gpus {lo or per_node} or {hi}, or a "
            f"--gpus-per-node that divides {gpus} ({', '.join(map(str, fits))})"
        )


def _paths(args) -> None:
    for flag, attr in (("--write-config", "write_config"), ("--calibrate-out", "calibrate_out")):
        path = getattr(args, attr, None)
        if not path:
            continue
        p = Path(path)
        if p.is_dir():
            raise ValueError(
                f"{flag} {path}: is a directory; give a file name, e.g. "
                f"{p / 'plan.yaml' if attr == 'write_config' else p / 'hw.json'}"
            )
        if not p.parent.is_dir():
            raise ValueError(
                f"{flag} {path}: directory {p.parent} does not exist; create it first or pick another path"
            )
    hw_file = getattr(args, "hardware_file", None)
    if hw_file:
        try:
            hwmod.load_hardware_file(hw_file)
        except FileNotFoundError:
            raise ValueError(
                f"--hardware-file {hw_file}: no such file (write one with --calibrate --calibrate-out FILE)"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"--hardware-file {hw_file}: not JSON ({exc}); give a profile written by --calibrate"
            ) from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--hardware-file {hw_file}: {exc}") from None


def check_args(args) -> None:
    """Raise ``ValueError('--flag value: fix')`` for the first bad value of a parsed namespace."""
    _cluster(args)
    _field_flags(args, Settings)
    _field_flags(args, PlanRequest)
    _positive_int(args, "--global-batch-size")
    _positive_int(args, "--global-batch-tokens")
    _positive_int(args, "--top")
    _positive_int(args, "--calibrate-ranks")
    _micro_batch(args)
    if args.host_mem is not None:
        host_mem_bytes(args.host_mem)
    if args.global_batch_tokens and args.seq_len and args.global_batch_tokens % args.seq_len:
        raise ValueError(
            f"--global-batch-tokens {args.global_batch_tokens} is not a multiple of "
            f"--seq-len {args.seq_len}; use a multiple, or --global-batch-size"
        )
    eff = args.matmul_efficiency
    if eff is not None and not 0 < eff <= 1:
        raise ValueError(f"--matmul-efficiency {eff}: a fraction of peak, 0 < x <= 1 (e.g. 0.8)")
    _positive(args, "--peak-tflops", "TFLOP/s")
    _positive(args, "--intra-node-bw", "GB/s per GPU")
    _positive(args, "--inter-node-bw", "GB/s per GPU")
    _positive(args, "--hbm-bw", "GB/s")
    if args.gpu_mem is not None:
        gpu_mem_bytes(args.gpu_mem)
    _paths(args)

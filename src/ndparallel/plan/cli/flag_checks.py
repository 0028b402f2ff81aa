"""Range checks of ``ndparallel plan``'s flags: each bad value becomes one ``ValueError`` line that
names the flag and the fix (the CLI prints ``ndparallel plan: error: <line>`` and exits 2)."""

from __future__ import annotations

import json
from pathlib import Path

from ndparallel.plan import hardware as hwmod
from ndparallel.plan.cli.flags import FLAGS
from ndparallel.plan.search.request import DEFAULT_SETTINGS
from ndparallel.runtime.sizes import parse_size

MIN_GPU_MEM = hwmod.GiB
"""Below 1 GiB a ``--gpu-mem`` value is taken for a unit slip (``96MB`` for ``96GB``)."""


def _dest(flag: str) -> str:
    """The argument name argparse gives ``flag`` (``--gpus-per-node`` -> ``gpus_per_node``)."""
    return flag.lstrip("-").replace("-", "_")


def _positive_int(args, flag: str) -> None:
    _whole(flag, getattr(args, _dest(flag)))


def _whole(flag: str, value) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{flag} {value}: must be a whole number >= 1")


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


def _run_flags(values: dict) -> None:
    """The run flags' values (given, or from a training config), by key: whole numbers >= 1, the
    micro-batch (or auto), and the two flags that need another."""
    for flag in FLAGS:
        if flag.positive and flag.key != "lora_r":
            _whole(flag.option, values.get(flag.key))
        if flag.key == "micro_batch_size":
            _micro_batch(values.get(flag.key, "auto"))
        if flag.key == "tiled_mlp_num_shards" and values.get(flag.key) and not values.get("tiled_mlp"):
            raise ValueError("--tiled-mlp-num-shards needs --tiled-mlp")
        if flag.key == "activation_offloading" and values.get(flag.key):
            if str(values.get("activation_checkpointing")).lower() in ("off", "false"):
                raise ValueError(
                    "--activation-offloading offloads what checkpointing keeps: drop "
                    f"--activation-checkpointing {values['activation_checkpointing']}"
                )


def _micro_batch(value) -> None:
    text = str(value).strip().lower()
    if text == "auto":
        return
    try:
        mb = int(text)
    except ValueError:
        raise ValueError(f"--micro-batch-size {value!r}: use a whole number >= 1 or 'auto'") from None
    _whole("--micro-batch-size", mb)


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


def check_args(args, values: dict) -> None:
    """Raise ``ValueError('--flag value: fix')`` for the first bad value of the parsed ``args`` and
    the run flags' ``values`` (``request.run_values``)."""
    _cluster(args)
    _run_flags(values)
    _positive_int(args, "--global-batch-size")
    _positive_int(args, "--global-batch-tokens")
    _positive_int(args, "--top")
    _positive_int(args, "--calibrate-ranks")
    if args.host_mem is not None:
        host_mem_bytes(args.host_mem)
    seq = values.get("sequence_len", DEFAULT_SETTINGS.sequence_len)
    if args.global_batch_tokens and seq and args.global_batch_tokens % seq:
        raise ValueError(
            f"--global-batch-tokens {args.global_batch_tokens} is not a multiple of "
            f"--sequence-len {seq}; use a multiple, or --global-batch-size"
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

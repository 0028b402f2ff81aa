"""Accelerator presets and hardware profiles (a preset, a calibrated JSON file, or explicit numbers).

Bandwidths are per GPU and one direction, in bytes/s; ``link_efficiency`` turns a spec number
into what NCCL's ring achieves (bus bandwidth). A calibrated profile stores measured numbers and
``link_efficiency = 1``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Hardware:
    """What the cost model needs to know about one accelerator and its links."""

    name: str
    mem_bytes: float
    """Device memory (what the driver reports as total)."""
    peak_flops: float
    """Dense bf16 matmul peak, FLOP/s."""
    peak_flops_fp32: float
    """Dense fp32 (not TF32) peak, FLOP/s."""
    hbm_bw: float
    """Device memory bandwidth, bytes/s (optimizer step is memory-bound)."""
    intra_node_bw: float
    """Per-GPU one-direction bandwidth to GPUs of the same node (NVLink), bytes/s."""
    inter_node_bw: float
    """Per-GPU one-direction bandwidth across nodes (its NIC), bytes/s."""
    intra_node_latency: float = 5e-6
    """Alpha of one ring step inside a node, seconds."""
    inter_node_latency: float = 15e-6
    """Alpha of one ring step across nodes, seconds."""
    link_efficiency: float = 0.8
    """Fraction of the link's spec bandwidth a ring collective achieves."""
    matmul_efficiency: float = 0.65
    """Fraction of peak FLOP/s that large training matmuls achieve."""
    runtime_overhead_bytes: float = 2 * GiB
    """CUDA context, NCCL buffers, kernels: memory the training tensors cannot use."""
    collectives: dict = field(default_factory=dict, compare=False)
    """Measured costs: kind -> {group size (str) -> {"alpha_s": .., "bus_bw": ..}} (calibration)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Hardware":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"hardware profile has unknown fields: {', '.join(unknown)}")
        return cls(**data)


PRESETS: dict[str, Hardware] = {
    h.name: h
    for h in [
        # A100 SXM: 312 TFLOP/s bf16, 19.5 fp32; NVLink3 600 GB/s both ways; DGX A100 has one
        # 200 Gb/s HDR NIC per GPU. Memory = the driver's total (40536 / 81920 MiB).
        Hardware("a100-40gb", 40536 * MiB, 312e12, 19.5e12, 1.555e12, 300e9, 25e9,
                 matmul_efficiency=0.7),
        Hardware("a100-80gb", 81920 * MiB, 312e12, 19.5e12, 2.039e12, 300e9, 25e9,
                 matmul_efficiency=0.7),
        # H100 SXM: 989 TFLOP/s bf16 dense, 67 fp32; NVLink4 900 GB/s both ways; one 400 Gb/s
        # NDR NIC per GPU (DGX H100). 81559 MiB reported.
        Hardware("h100-80gb", 81559 * MiB, 989e12, 67e12, 3.35e12, 450e9, 50e9),
        # H200 SXM: the H100 die with 141 GB HBM3e at 4.8 TB/s; 143771 MiB reported.
        Hardware("h200", 143771 * MiB, 989e12, 67e12, 4.8e12, 450e9, 50e9),
    ]
}
ALIASES = {"h100": "h100-80gb", "a100": "a100-80gb", "h200-141gb": "h200"}


def get_preset(name: str) -> Hardware:
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown GPU {name!r}: use one of {', '.join(PRESETS)} or --hardware-file")
    return PRESETS[key]


def load_hardware_file(path: str | Path) -> Hardware:
    """Hardware from a JSON profile (as written by ``--calibrate``)."""
    with open(path) as fh:
        data = json.load(fh)
    return Hardware.from_dict(data.get("hardware", data))


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | float, *, gb_is_gib: bool = False) -> float:
    """'80GB' -> bytes. With ``gb_is_gib`` (memory sizes), GB/MB/TB mean GiB/MiB/TiB, as GPU
    memory is quoted."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a size from {text!r} (e.g. '80GB', '141GiB', '4e10')")
    unit = m.group(2).lower()
    if gb_is_gib and unit in ("k", "kb", "m", "mb", "g", "gb", "t", "tb"):
        unit = unit[0] + "ib"
    return float(m.group(1)) * _UNITS[unit]


def with_overrides(hw: Hardware, **overrides) -> Hardware:
    """A copy of ``hw`` with the given non-None fields replaced (renamed '<name>+custom')."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    if not changes:
        return hw
    return replace(hw, name=f"{hw.name}+custom", **changes)

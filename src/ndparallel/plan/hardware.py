"""Accelerator presets and hardware profiles (a preset, a calibrated JSON file, or explicit numbers).

The efficiency defaults were measured on this project's H200 (``bench/reference/``, see
docs/planner.md, *Constants*): an 8192³ bf16 GEMM at 786.5 TFLOP/s = 0.795 of the 989 peak; the
training step's element-wise kernels averaging 3.3 TB/s = 0.69 of 4.8 TB/s (contiguous kernels
alone reach 4.1–4.2, broadcast ones 0.4 of that); cuDNN causal attention (head dim 64, seq 2048)
at 0.37 / 0.23 of peak forward / backward; 1.06 µs of GPU idle per back-to-back kernel and 7 µs
of host time per eager op. Other GPUs use them as assumptions until calibrated.

Bandwidths are per GPU and one direction, in bytes/s; ``link_efficiency`` turns a spec number
into what NCCL's ring achieves (bus bandwidth). A calibrated profile stores measured numbers and
``link_efficiency = 1``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ndparallel.plan.field_hash import cached_field_hash

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
    matmul_efficiency: float = 0.795
    """Fraction of ``peak_flops`` an 8192³ bf16 GEMM reaches (smaller GEMMs: ``gemm.py``)."""
    runtime_overhead_bytes: float = 2 * GiB
    """CUDA context, NCCL buffers, kernels: device memory outside PyTorch's allocator."""
    hbm_efficiency: float = 0.69
    """Fraction of ``hbm_bw`` that PyTorch's element-wise kernels move (bytes read + written)."""
    broadcast_efficiency: float = 0.40
    """Element-wise ops with a broadcast operand (RoPE's cos/sin, norm weights, the per-token
    rsqrt) run in PyTorch's strided kernel at this fraction of the contiguous ones' bandwidth."""
    gemm_half_dim: float = 128.0
    """``x₀`` of the GEMM shape curve ``x/(x+x₀)`` per dimension (``gemm.py``)."""
    attention_efficiency: dict = field(
        default_factory=lambda: {"64": [0.37, 0.23], "128": [0.61, 0.38]}, compare=False
    )
    """Causal flash attention by head dim: [forward, backward] model FLOPs / (time · peak), the
    backward counted as 2× the forward's FLOPs. The nearest head dim is used."""
    cp_block_efficiency: dict = field(default_factory=dict, compare=False)
    """CP ring block kernels measured by ``--calibrate``: kernel ('flash', 'math') -> {"fwd", "bwd"}
    fractions of peak (backward FLOPs = 2.5× the forward's). Without an entry 'flash' is the causal
    flash kernel × ``plan.attention.CP_FLASH_SLOWDOWN`` and 'math' is costed from its FLOPs and
    score-tensor bytes."""
    host_link_bw: float = 50e9
    """Per-GPU one-direction bandwidth of pinned host <-> device copies, bytes/s (PCIe Gen5 x16:
    ~55 GB/s achievable; Gen4 ~25): activation offloading. An assumption until measured
    (``bench/gpu_long_context.py`` measures it)."""
    host_mem_per_node: float | None = field(default=None, compare=False)
    """Host memory of a typical server of this GPU, per node (bytes): what bounds offloaded
    activations when ``plan`` is given no ``--host-mem`` (NVIDIA's DGX datasheets: DGX A100 320 GB
    1 TB, 640 GB 2 TB; DGX H100 and DGX H200 2 TB). None: not checked."""
    kernel_overhead_s: float = 1e-6
    """GPU idle time per kernel launched back to back (launch gap)."""
    host_op_s: float = 7e-6
    """Host (Python + dispatcher) time per eager op: the step is host-bound when its ops cost more."""
    gemm_table: list = field(default_factory=list, compare=False)
    """Measured bf16 GEMMs: [{"m", "n", "k", "flops_per_s"}] (``--calibrate``)."""
    collectives: dict = field(default_factory=dict, compare=False)
    """Measured costs: kind -> {group size (str) -> {"alpha_s": .., "bus_bw": ..}} (calibration)."""

    def __hash__(self) -> int:
        return cached_field_hash(self)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Hardware:
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
        Hardware(
            "a100-40gb",
            40536 * MiB,
            312e12,
            19.5e12,
            1.555e12,
            300e9,
            25e9,
            matmul_efficiency=0.7,
            host_link_bw=25e9,
            host_mem_per_node=1024 * GiB,  # DGX A100 320 GB
        ),
        Hardware(
            "a100-80gb",
            81920 * MiB,
            312e12,
            19.5e12,
            2.039e12,
            300e9,
            25e9,
            matmul_efficiency=0.7,
            host_link_bw=25e9,
            host_mem_per_node=2048 * GiB,  # DGX A100 640 GB
        ),
        # H100 SXM: 989 TFLOP/s bf16 dense, 67 fp32; NVLink4 900 GB/s both ways; one 400 Gb/s
        # NDR NIC per GPU (DGX H100). 81559 MiB reported.
        Hardware("h100-80gb", 81559 * MiB, 989e12, 67e12, 3.35e12, 450e9, 50e9, host_mem_per_node=2048 * GiB),
        # H200 SXM: the H100 die with 141 GB HBM3e at 4.8 TB/s; 143771 MiB reported.
        Hardware("h200", 143771 * MiB, 989e12, 67e12, 4.8e12, 450e9, 50e9, host_mem_per_node=2048 * GiB),
    ]
}
ALIASES = {"h100": "h100-80gb", "a100": "a100-80gb", "h200-141gb": "h200"}


def get_preset(name: str) -> Hardware:
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"unknown GPU {name!r}: use one of {', '.join(PRESETS)} or --hardware-file")
    return PRESETS[key]


def preset_for_device(device_name: str) -> Hardware | None:
    """The preset of a CUDA device name ('NVIDIA H200', 'NVIDIA H100 80GB HBM3',
    'NVIDIA A100-SXM4-80GB'), or None."""
    name = device_name.lower()
    for key, preset in (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-80gb")):
        if key in name:
            if preset == "a100-80gb" and "40gb" in name:
                preset = "a100-40gb"
            return PRESETS[preset]
    return None


def load_hardware_file(path: str | Path) -> Hardware:
    """Hardware from a JSON profile (as written by ``--calibrate``)."""
    with open(path) as fh:
        data = json.load(fh)
    return Hardware.from_dict(data.get("hardware", data))


def with_overrides(hw: Hardware, **overrides) -> Hardware:
    """A copy of ``hw`` with the given non-None fields replaced (renamed '<name>+custom')."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    if not changes:
        return hw
    return replace(hw, name=f"{hw.name}+custom", **changes)

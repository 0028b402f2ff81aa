"""The speed options from YAML and the Python API, the device-resident token count, and fused AdamW
on DTensors (the kernel the trainer picks on CUDA), checked on CPU."""

import pytest
import torch

from ndparallel.axolotl import ConfigError, load_config
from ndparallel.techniques.technique_options import CompileOptions, Float8Options, LossOptions
from ndparallel.testing import run_on_ranks


def test_yaml_fields_become_options():
    cfg = load_config(
        None,
        [
            "chunked_loss=false",
            "loss_chunk_tokens=64",
            "torch_compile=true",
            "compile_backend=aot_eager",
            "fp8=true",
            "fp8_recipe=rowwise",
        ],
    )
    assert cfg.loss_options() == LossOptions(chunked=False, chunk_tokens=64)
    assert cfg.compile_options() == CompileOptions(enabled=True, backend="aot_eager")
    assert cfg.float8_options() == Float8Options(enabled=True, recipe="rowwise")
    defaults = load_config(None, [])
    assert defaults.loss_options() == LossOptions() and defaults.tp_options().loss_parallel is None
    assert not defaults.compile_options().enabled and not defaults.float8_options().enabled


@pytest.mark.parametrize(
    "override, field", [("loss_chunk_tokens=0", "loss_chunk_tokens"), ("fp8_recipe=blockwise", "fp8_recipe")]
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, [override])


def test_token_count_is_a_device_tensor_and_an_int_still_works():
    from ndparallel.techniques.loss import causal_lm_loss, global_num_items

    labels = torch.tensor([[1, -100, 2], [3, 4, -100]])
    n = global_num_items([{"shift_labels": labels}], None)
    assert isinstance(n, torch.Tensor) and n.dtype == torch.int64 and n.ndim == 0 and int(n) == 4
    logits = torch.randn(2, 3, 7)
    assert torch.equal(causal_lm_loss(logits, labels, n), causal_lm_loss(logits, labels, 4))


def test_fused_adamw_only_on_cuda():
    from ndparallel.optim.build import build_optimizer, fused_supported

    p = torch.nn.Parameter(torch.zeros(3))
    assert not fused_supported([p])
    assert not build_optimizer([p]).defaults["fused"]


def _fused_vs_default(layout):
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.engine import forward_backward
    from ndparallel.models.presets import preset_config
    from ndparallel.optim.build import build_optimizer
    from ndparallel.tools.equivalence import (
        TrainSetup,
        build_model,
        make_global_batches,
    )

    setup = TrainSetup(preset_config("tiny-llama"), steps=2, global_micro_batch=4, seq_len=16)
    out = []
    for fused in (False, True):
        acc = Accelerator(ParallelismConfig(**layout))
        model = acc.prepare(build_model(setup))
        opt = build_optimizer(model.parameters(), lr=1e-3, weight_decay=0.01, fused=fused)
        for micro in make_global_batches(setup):
            rows = 4 // acc.dp_size
            forward_backward(
                acc.engine,
                model,
                [
                    {k: v[acc.dp_rank * rows : (acc.dp_rank + 1) * rows] for k, v in mb.items()}
                    for mb in micro
                ],
            )
            opt.step()
            opt.zero_grad()
        out.append(
            torch.cat(
                [
                    (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                    for p in model.parameters()
                ]
            )
        )
    return float((out[0] - out[1]).abs().max())


def test_fused_adamw_on_dtensors_equals_for_loop_fsdp_x_tp():
    # AdamW turns fp32 rounding on near-zero gradients into lr-sized steps (it divides by sqrt(v))
    assert run_on_ranks(_fused_vs_default, 4, {"dp_shard_size": 2, "tp_size": 2})[0] <= 1e-5

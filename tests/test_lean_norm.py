"""The lean RMSNorm (``techniques/lean_norm.py``, turned on by ``tiled_mlp``): the same output as HF's
norm, bit for bit; gradients as close to exact as HF's; a tiny llama trains under FSDP 2 × CP 2 and
under TP 2 + sequence parallel (its DTensor path) as one process does, with the lean norms counted
(the runs are not vacuous); the probe leaves other norm forms alone; the saved bytes, measured.
``tests/test_long_context.py`` runs every tiled_mlp layout (CP strategies, TP + SP + CP, LoRA,
compile) with the lean norms on as well."""

import copy
import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from ndparallel.parallel.options import ActivationOptions, TPOptions
from ndparallel.runtime.memory_probe import LiveBytes
from ndparallel.techniques import lean_norm as lean
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import train_under_layout
from ndparallel.tools.saved_bytes import SavedBytes
from test_long_context import BASE  # its tiny llama: 2 steps of 4 packed rows of 32 tokens, SGD

TILED = ActivationOptions(tiled_mlp=True, tiled_mlp_num_shards=3)


def _norm(cls, h, dtype):
    torch.manual_seed(0)
    norm = cls(h, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(h))
    return norm.to(dtype)


def _run(norm, x, g):
    x = x.detach().clone().requires_grad_()
    y = norm(x)
    y.backward(g)
    return y, x.grad, norm.weight.grad


def _exact_gradients(weight, x, g, eps):
    """The norm's input and weight gradients in float64 (HF's norm casts to float32 inside)."""
    w = weight.detach().double().requires_grad_()
    x = x.double().requires_grad_()
    y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    y.backward(g.double())
    return x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm])
def test_same_output_and_gradients_as_hf(cls, dtype):
    """Forward: bit-identical. Gradients: each within 2× HF's own error against float64 (plus one
    ulp of the largest value): the lean backward is as exact as HF's autograd (3 uneven tiles)."""
    h = 64
    hf = _norm(cls, h, dtype)
    mine = copy.deepcopy(hf)
    assert lean.lean_norm(mine, num_tiles=3) and lean.is_lean(mine)
    x = torch.randn(2, 37, h).mul(torch.rand(2, 37, 1) * 4).to(dtype)
    g = torch.randn(2, 37, h).to(dtype)
    exact = _exact_gradients(hf.weight, x, g, hf.variance_epsilon)
    theirs, ours = _run(hf, x, g), _run(mine, x, g)
    assert torch.equal(theirs[0], ours[0])
    ulp = torch.finfo(dtype).eps
    for name, e, t, o in zip(("dx", "dweight"), exact, theirs[1:], ours[1:]):
        err_hf, err_lean = ((a.double() - e).abs().max().item() for a in (t, o))
        assert err_lean <= 2 * err_hf + ulp * e.abs().max().item(), (name, err_lean, err_hf)


def test_probe_keeps_other_forms():
    """Gemma's ``(1 + w)`` in fp32 and a bias-free LayerNorm (one weight, an ``eps``) keep their own
    forward; a tiny llama's 2 × 2 layer norms and final norm become lean."""
    gemma, layer_norm = GemmaRMSNorm(64), torch.nn.LayerNorm(64, bias=False)
    for module in (gemma, layer_norm):
        cls = type(module)
        assert not lean.lean_norm(module) and type(module) is cls
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(BASE.model_config)
    names = [n for n, m in model.named_modules() if m in lean.apply_lean_norms(model)]
    assert len(names) == 2 * BASE.model_config.num_hidden_layers + 1, names


def _saved_and_backward(make_lean, tokens, h=128):
    norm = LlamaRMSNorm(h).to(torch.bfloat16)
    if make_lean:
        lean.lean_norm(norm)
    x = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)
    with SavedBytes(exclude=[norm.weight]) as saved:
        y = norm(x)
    g = torch.randn_like(y)
    with LiveBytes() as live:
        y.backward(g)
    return saved.total, live.peak


def test_saved_bytes_per_token():
    """bf16, h = 128, per token (the difference between 2,048 and 1,024 tokens), measured
    2026-12-06: saved for backward — HF 772 B (``6·h + 4``: fp32 ``x``, bf16 ``x̂``, fp32 rstd),
    lean 260 B (``2·h + 4``: ``x`` and rstd); the backward's peak of new storage — HF 2,560 B
    (``20·h``: five fp32 copies of the input), lean 256 B (``2·h``: its input gradient) plus one
    tile's fp32 temporaries (a constant 16·h² B with the default tiles of h tokens). Saved and
    backward together: 3,332 against 516 B per token (6.5×)."""
    h, (t1, t2) = 128, (1024, 2048)
    per_token = {}
    for make_lean in (False, True):
        (s1, b1), (s2, b2) = (_saved_and_backward(make_lean, t) for t in (t1, t2))
        per_token[make_lean] = ((s2 - s1) / (t2 - t1), (b2 - b1) / (t2 - t1))
    (hf_saved, hf_backward), (lean_saved, lean_backward) = per_token[False], per_token[True]
    assert lean_saved <= 2 * h + 4 and hf_saved >= 6 * h, per_token
    assert lean_backward <= 2 * h and hf_backward >= 20 * h, per_token
    assert hf_saved + hf_backward >= 6 * (lean_saved + lean_backward), per_token


def _train_counting(setup, layout):
    """Train; also how many lean norm calls ran on local tensors and on DTensors."""
    calls = {"tensor": 0, "dtensor": 0}
    run = lean.lean_rms_norm

    def counted(x, *args):
        y = run(x, *args)
        if y is not None:
            calls["dtensor" if isinstance(x, DTensor) else "tensor"] += 1
        return y

    lean.lean_rms_norm = counted
    try:
        return train_under_layout(setup, layout), calls
    finally:
        lean.lean_rms_norm = run


def _norm_calls(setup):
    """Norm forwards per rank in training: (2 per layer + the final) per micro-batch and step."""
    per_pass = 2 * setup.model_config.num_hidden_layers + 1
    return per_pass * setup.steps


@pytest.mark.parametrize(
    "layout,world,tp",
    [({"dp_shard_size": 2, "cp_size": 2}, 4, None), ({"tp_size": 2}, 2, TPOptions(sequence_parallel=True))],
    ids=["fsdp2-cp2", "tp2-sp"],
)
def test_trains_as_one_process(layout, world, tp):
    kwargs = {"activation_options": TILED} | ({"tp_options": tp} if tp else {})
    # unpacked rows under SP without CP: transformers' own packed-row mask (test_long_context.py)
    setup = dataclasses.replace(BASE, parallel_kwargs=kwargs, packed_documents=tp is None)
    got, calls = run_on_ranks(_train_counting, world, setup, layout, timeout_s=400)[0]
    assert_matches(one_process_reference(setup), got)
    lean_kind, other = ("dtensor", "tensor") if tp else ("tensor", "dtensor")
    assert calls[lean_kind] >= _norm_calls(setup) and calls[other] == 0, calls

"""The chunked loss (linear + cross-entropy in token chunks, no full logits) equals the logits path:
alone, and under FSDP, TP with sequence + loss parallel, CP, FSDP × TP × CP; in evaluation too."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import TPOptions
from ndparallel.techniques.chunked_ce import (
    chunked_linear_cross_entropy,
    default_chunk_tokens,
)
from ndparallel.techniques.technique_options import LossOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, compare, train_under_layout

LOGITS = {"loss_options": LossOptions(chunked=False)}
BASE = TrainSetup(
    preset_config("tiny-llama"),
    steps=3,
    global_micro_batch=4,
    seq_len=32,
    grad_accum=2,
    optimizer="sgd",
    lr=0.5,
    max_grad_norm=1.0,
)


def _reference(setup):
    """One process computing the loss from full logits (LOGITS), with its measured bounds."""
    return one_process_reference(
        dataclasses.replace(setup, parallel_kwargs=LOGITS), keep_options=tuple(LOGITS)
    )


def _check(setup, layout, world, **kwargs):
    got = run_on_ranks(
        train_under_layout,
        world,
        dataclasses.replace(
            setup, parallel_kwargs={"loss_options": LossOptions(chunked=True, chunk_tokens=8), **kwargs}
        ),
        layout,
        timeout_s=600,
    )[0]
    assert_matches(_reference(setup), got)


# ------------------------------------------------------------------------------ the function
def _inputs(dtype, n_tok=37, vocab=101, hidden=16):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, n_tok, hidden, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (2, n_tok), generator=g)
    y[0, :5] = -100
    return h, w, y


@pytest.mark.parametrize("chunk", [1, 8, 74, None])
def test_equals_cross_entropy_of_the_logits_fp32(chunk):
    h, w, y = _inputs(torch.float32)
    n = (y != -100).sum()
    loss = chunked_linear_cross_entropy(h, w, y, n, chunk_tokens=chunk)
    loss.backward()
    got = (loss.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref = F.cross_entropy((h @ w.t()).reshape(-1, 101), y.reshape(-1), reduction="sum") / n
    ref.backward()
    torch.testing.assert_close(got[0], ref.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got[1], h.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], w.grad, rtol=1e-5, atol=1e-7)


def test_bf16_within_bf16_rounding_and_int_count():
    h, w, y = _inputs(torch.bfloat16)
    n = int((y != -100).sum())
    loss = chunked_linear_cross_entropy(h, w, y, n, chunk_tokens=8)
    loss.backward()
    gw = w.grad.float()
    w.grad = None
    ref = F.cross_entropy((h @ w.t()).float().reshape(-1, 101), y.reshape(-1), reduction="sum") / n
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    assert (gw - w.grad.float()).abs().max() <= 2**-7 * w.grad.float().abs().max()


def test_no_grad_and_single_backward():
    h, w, y = _inputs(torch.float32)
    with torch.no_grad():
        assert chunked_linear_cross_entropy(h, w, y, 10).requires_grad is False
    loss = chunked_linear_cross_entropy(h, w, y, 10)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_default_chunk_is_256_mib_of_logits():
    assert default_chunk_tokens(131072, 8192) == 512
    assert default_chunk_tokens(131072, 100) == 100
    assert default_chunk_tokens(10**9, 10) == 1


def test_models_with_softcapping_fall_back_or_refuse():
    from transformers import AutoModelForCausalLM

    from ndparallel.techniques.lm_loss import use_chunked_loss

    llama = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    gemma2 = AutoModelForCausalLM.from_config(_gemma2_config())
    assert use_chunked_loss(llama, LossOptions()) is True
    assert use_chunked_loss(gemma2, LossOptions()) is False
    assert use_chunked_loss(llama, LossOptions(chunked=False)) is False
    with pytest.raises(ValueError, match="soft-caps|plain LM head"):
        use_chunked_loss(gemma2, LossOptions(chunked=True))


def _gemma2_config():
    from transformers import Gemma2Config

    return Gemma2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=64,
    )


# ------------------------------------------------------------------------------- the layouts
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-tied"])
def test_one_process_with_equals_without(preset):
    _check(dataclasses.replace(BASE, model_config=preset_config(preset)), None, 1)


def test_fsdp2():
    _check(BASE, {"dp_shard_size": 2}, 2)


def test_tp2_sequence_parallel_loss_parallel_tied():
    _check(
        dataclasses.replace(BASE, model_config=preset_config("tiny-llama-tied")),
        {"tp_size": 2},
        2,
        tp_options=TPOptions(sequence_parallel=True),
    )


def test_cp2():
    _check(BASE, {"cp_size": 2}, 2)


@pytest.mark.slow
def test_fsdp2_tp2_cp2_8_ranks():
    _check(
        BASE,
        {"dp_shard_size": 2, "tp_size": 2, "cp_size": 2},
        8,
        tp_options=TPOptions(sequence_parallel=True),
    )


# ------------------------------------------------------------------------------ evaluation
def _eval_both(layout):
    from ndparallel import ParallelismConfig
    from ndparallel.engine import Engine
    from ndparallel.tools.equivalence import build_model
    from ndparallel.training.evaluate import evaluate, validation_loader

    engine = Engine(ParallelismConfig(**layout))
    model = engine.parallelize(build_model(BASE))
    blocks = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(3))
    chunked = evaluate(engine, model, validation_loader(engine, blocks, 2, 0))
    engine.options = dataclasses.replace(engine.options, loss=LossOptions(chunked=False))
    logits = evaluate(engine, model, validation_loader(engine, blocks, 2, 0))
    return chunked["eval_loss"], logits["eval_loss"]


@pytest.mark.parametrize("layout, world", [({"dp_shard_size": 2}, 2), ({"tp_size": 2}, 2)])
def test_eval_loss_equals_logits_path(layout, world):
    chunked, logits = run_on_ranks(_eval_both, world, layout)[0]
    assert abs(chunked - logits) <= 1e-6 * logits, (chunked, logits)


def test_bf16_one_process_within_bf16_rounding():
    setup = dataclasses.replace(BASE, mixed_precision="bf16", grad_accum=1)
    ref = run_on_ranks(train_under_layout, 1, dataclasses.replace(setup, parallel_kwargs=LOGITS), None)[0]
    got = run_on_ranks(
        train_under_layout,
        1,
        dataclasses.replace(setup, parallel_kwargs={"loss_options": LossOptions(chunk_tokens=16)}),
        None,
    )[0]
    diff = compare(ref, got)  # measured 1.5e-5 / 6e-5: bf16 logits and chunk-wise bf16 products
    assert diff["loss_rel"] <= 1e-3 and diff["grad_norm_rel"] <= 1e-2, diff

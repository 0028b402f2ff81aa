"""QLoRA: a 4-bit NF4 frozen base (torchao's NF4Tensor) with LoRA adapters trains the same adapter
on every layout as QLoRA on one process: the reference quantises the whole weights with torchao's
``to_nf4`` and trains PEFT's adapters on one process; the layouts read and quantise each rank's rows
(``load_model(..., quantization=NF4Config(...))``), pipeline stages included. fp32 compute of the
dequantised weights, SGD."""

import dataclasses

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch
import torch.nn as nn

from ndparallel.models.presets import preset_config
from ndparallel.models.quantized import NF4Config, is_nf4, nf4_with_mean, quantize_row_shard
from ndparallel.parallel.options import ActivationOptions, FSDPOptions, PipelineOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, train_under_layout

torchao = pytest.importorskip("torchao")
from torchao.quantization import to_nf4  # noqa: E402

FORWARD_RTOL = 1e-5  # one forward's loss, no training: fp32 reduction order only
NF4 = NF4Config(block_size=32, scaler_block_size=4)  # tiny weights: 128-value scaler blocks
LORA = dict(r=4, alpha=8, dropout=0.0, target_linear=True)
_MODEL_DIR: dict = {}


def _model_dir(tmp_path_factory) -> str:
    if "dir" not in _MODEL_DIR:
        from transformers import AutoModelForCausalLM

        path = tmp_path_factory.mktemp("tiny-llama")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(preset_config("tiny-llama")).save_pretrained(path)
        _MODEL_DIR["dir"] = str(path)
    return _MODEL_DIR["dir"]


def _inner(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def load_reference(engine, setup):
    """QLoRA on one process, independent of the sharded path: transformers' model, PEFT's adapters
    (A as ndparallel initialises them on every layout), every linear but lm_head -> to_nf4(whole)."""
    from transformers import AutoModelForCausalLM

    from ndparallel.models.adapters import apply_adapter, initial_adapter_weights, lora_config

    model = apply_adapter(AutoModelForCausalLM.from_pretrained(_MODEL_DIR["dir"]), lora_config(**LORA))
    with torch.no_grad():
        init = initial_adapter_weights(model, seed=0)
        for name, p in model.named_parameters():
            if name in init:
                p.copy_(init[name])
        head = _inner(model).get_output_embeddings()
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and m is not head and ".lora_" not in name:
                m.weight = nn.Parameter(
                    to_nf4(m.weight.detach(), NF4.block_size, NF4.scaler_block_size), requires_grad=False
                )
    return engine.parallelize(model)


def load_sharded(engine, setup):
    from ndparallel.models.adapters import lora_config

    return engine.build_model(_MODEL_DIR["dir"], adapter=lora_config(**LORA), quantization=NF4, seed=0)


def _setup(tmp_path_factory, **kw):
    _model_dir(tmp_path_factory)  # both loaders read it (set before the ranks fork)
    kw = {"optimizer": "sgd", "lr": 0.5, **kw}
    return TrainSetup(
        preset_config("tiny-llama"), steps=3, global_micro_batch=4, seq_len=32, max_grad_norm=1.0, **kw
    )


def _run(setup, layout, world, **parallel_kwargs):
    """The one-process reference (the base quantised by hand: ``load_reference``), with its measured
    bounds and the same strategy options, and the layout's run (loaded sharded)."""
    setup = dataclasses.replace(setup, parallel_kwargs=parallel_kwargs)
    ref = one_process_reference(
        dataclasses.replace(setup, load=load_reference), keep_options=tuple(parallel_kwargs)
    )
    got = run_on_ranks(
        train_under_layout, world, dataclasses.replace(setup, load=load_sharded), layout, timeout_s=400
    )[0]
    return ref, got


def _check(tmp_path_factory, layout, world, setup_kw=None, **parallel_kwargs):
    reference, got = _run(_setup(tmp_path_factory, **(setup_kw or {})), layout, world, **parallel_kwargs)
    sgd = (setup_kw or {}).get("optimizer", "sgd") == "sgd"
    diff = assert_matches(reference, got, params=sgd)  # the parameters: the adapters (the base is below)
    ref = reference.result
    adapters = [k for k in ref.params if ".lora_" in k]
    assert max(ref.params[k].abs().max().item() for k in adapters if "lora_B" in k) > 1e-3  # B moved from 0
    if not sgd:  # AdamW amplifies rounding into lr-sized steps (README): a coarse, stated bound
        assert max((ref.params[k] - got.params[k]).abs().max().item() for k in adapters) <= 1e-3, diff
    base = [k for k in ref.params if ".lora_" not in k]  # dequantised NF4 weights + norms, embeddings
    assert all(torch.equal(ref.params[k], got.params[k]) for k in base)  # the same 4-bit base, bit for bit
    _assert_really_quantised(got)
    return ref, got


def _assert_really_quantised(result):
    """Not vacuous: the trained base is to_nf4 of the weights on disk (not the weights themselves)."""
    from safetensors.torch import load_file

    disk = load_file(f"{_MODEL_DIR['dir']}/model.safetensors")
    name = "base_model.model.model.layers.1.mlp.down_proj.base_layer.weight"
    original = disk["model.layers.1.mlp.down_proj.weight"]
    expected = to_nf4(original, NF4.block_size, NF4.scaler_block_size).get_original_weight()
    assert torch.equal(result.params[name], expected)
    assert (result.params[name] - original).abs().max() > 1e-4  # 4-bit: far from the original
    norm = "base_model.model.model.norm.weight"
    assert torch.equal(result.params[norm], disk["model.norm.weight"])  # not a linear: unquantised


def test_fsdp2(tmp_path_factory):
    _check(tmp_path_factory, {"dp_shard_size": 2}, 2)


def test_dp2(tmp_path_factory):
    _check(tmp_path_factory, {"dp_replicate_size": 2}, 2)


def test_hsdp_2x2_with_activation_checkpointing(tmp_path_factory):
    _check(
        tmp_path_factory,
        {"dp_replicate_size": 2, "dp_shard_size": 2},
        4,
        activation_options=ActivationOptions(activation_checkpointing=True),
    )


def test_fsdp2_cp2_adamw_accumulation(tmp_path_factory):
    _check(
        tmp_path_factory,
        {"dp_shard_size": 2, "cp_size": 2},
        4,
        setup_kw=dict(optimizer="adamw", lr=1e-2, grad_accum=2),
    )


def test_fsdp4_cpu_offload(tmp_path_factory):
    _check(tmp_path_factory, {"dp_shard_size": 4}, 4, fsdp_options=FSDPOptions(cpu_offload=True))


def test_pp2_fsdp2(tmp_path_factory):
    """Pipeline parallel: each stage reads and quantises its own layers' rows, FSDP-sharded, and
    draws its adapters' init where the whole model's seeded order puts them."""
    _check(
        tmp_path_factory,
        {"pp_size": 2, "dp_shard_size": 2},
        4,
        pipeline_options=PipelineOptions(schedule="1F1B", microbatches=2),
    )


def _peft_model():
    """transformers' model from the directory with PEFT's adapters, A as ndparallel initialises it."""
    from transformers import AutoModelForCausalLM

    from ndparallel.models.adapters import apply_adapter, initial_adapter_weights, lora_config

    model = apply_adapter(AutoModelForCausalLM.from_pretrained(_MODEL_DIR["dir"]), lora_config(**LORA))
    with torch.no_grad():
        init = initial_adapter_weights(model, seed=0)
        for name, p in model.named_parameters():
            if name in init:
                p.copy_(init[name])
    return model


def _prepared_loss(layout: dict, quantise: bool) -> float:
    """The Accelerate facade: ``acc.prepare_model(peft_model, quantization=NF4)`` (or the reference
    quantised by hand on one process); the loss of one fixed batch."""
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.techniques.loss import causal_lm_loss

    acc = Accelerator(ParallelismConfig(**layout))
    if quantise:
        model = acc.prepare_model(_peft_model(), quantization=NF4)
    else:
        model = load_reference(acc.engine, None)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    loss = causal_lm_loss(model(input_ids=ids[:, :-1]).logits, ids[:, 1:], ids[:, 1:].numel())
    assert sum(is_nf4(p) for p in model.parameters()) == 14
    return float(loss)


def test_prepare_model_quantises_a_model_in_memory(tmp_path_factory):
    _setup(tmp_path_factory)
    ref = run_on_ranks(_prepared_loss, 1, {}, False)[0]
    got = run_on_ranks(_prepared_loss, 2, {"dp_shard_size": 2}, True)
    assert all(abs(g - ref) <= FORWARD_RTOL * abs(ref) for g in got), (ref, got)


def test_shard_wise_quantisation_equals_whole_weight_quantisation():
    """Default blocks (64, 256): each of 4 row shards quantised with the whole weight's absmax mean
    is bit for bit the matching chunk of to_nf4(whole); quantised alone (its own mean) it is not."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import get_block_absmax

    config = NF4Config()
    torch.manual_seed(0)
    weight = torch.randn(512, 256) * torch.linspace(0.1, 3.0, 512).unsqueeze(1)  # rows of other scales
    whole = to_nf4(weight, config.block_size, config.scaler_block_size)
    mean = get_block_absmax(weight.flatten(), config.block_size).mean()
    alone_differs = False
    for shard, expected in zip(weight.chunk(4), whole.chunk(4)):
        got = nf4_with_mean(shard, mean, config)
        for attr in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            assert torch.equal(getattr(got, attr), getattr(expected, attr)), attr
        assert torch.equal(got.get_original_weight(), expected.get_original_weight())
        alone = quantize_row_shard(shard, config)  # no group: the shard is taken for the whole weight
        alone_differs |= not torch.equal(alone.get_original_weight(), expected.get_original_weight())
    assert alone_differs


def test_layout_problems_are_named():
    from transformers import AutoModelForCausalLM

    from ndparallel.models.quantized import nf4_layout_problem, quantize_linears

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    assert nf4_layout_problem(model, 4, 2) is None  # nothing quantised: nothing to say
    names = quantize_linears(model, NF4)
    assert len(names) == 14 and all(is_nf4(m.weight) for n, m in model.named_modules() if n in names)
    assert not is_nf4(model.lm_head.weight)
    assert nf4_layout_problem(model, 8, 1) is None
    tp = nf4_layout_problem(model, 2, 2)
    assert "tensor_parallel_size" in tp and "dp_shard_size" in tp
    too_many = nf4_layout_problem(model, 32, 1)  # k_proj: 32 rows of 64, 16 scaler blocks of 128
    assert "k_proj" in too_many and "dividing 16" in too_many, too_many


def _gather_nf4_repeatedly(rounds: int) -> dict:
    """Every NF4 weight of an FSDP 2 QLoRA model gathered dequantised ``rounds`` times."""
    from ndparallel.engine.engine import Engine
    from ndparallel.layout.config import ParallelismConfig
    from ndparallel.models.adapters import lora_config
    from ndparallel.models.quantized import dequantize

    engine = Engine(ParallelismConfig(dp_shard_size=2))
    model = engine.build_model(_MODEL_DIR["dir"], adapter=lora_config(**LORA), quantization=NF4, seed=0)
    nf4 = {n: p for n, p in model.named_parameters() if is_nf4(p)}
    first = {n: dequantize(p).clone() for n, p in nf4.items()}
    for _ in range(rounds):
        for n, p in nf4.items():
            assert torch.equal(dequantize(p), first[n]), n
    return first


def test_gathering_nf4_shards_is_exact_and_stable(tmp_path_factory):
    """Export, the equivalence harness and the Accelerate facade gather a QLoRA base through
    ``dequantize``. Gathering the 4-bit shards themselves (torchao's functional all-gather override)
    killed a rank with a corrupted heap (SIGSEGV / ``malloc(): unaligned tcache chunk``) in 2 of 3
    runs of this loop on gloo; dequantising each shard first and gathering the values is the
    whole-tensor dequantisation bit for bit, every time."""
    from safetensors.torch import load_file

    _model_dir(tmp_path_factory)
    got = run_on_ranks(_gather_nf4_repeatedly, 2, 150, timeout_s=300)[0]
    disk = load_file(f"{_MODEL_DIR['dir']}/model.safetensors")
    assert len(got) == 14  # 2 layers x 7 linears
    for name, value in got.items():
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        expected = to_nf4(disk[key], NF4.block_size, NF4.scaler_block_size).get_original_weight()
        assert torch.equal(value, expected), name

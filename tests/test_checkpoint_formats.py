"""Checkpoint layouts read on load (models/checkpoint_formats.py): gpt-oss experts stored as MXFP4
(``*_blocks`` + ``*_scales``, dequantised on load) and Axolotl's linearized Llama 4 experts (one
linear per expert, fused into transformers' experts). Tiny stand-ins written here: the MXFP4 one
packed by a quantiser of this file from values MXFP4 represents exactly, so the load must give
the reference weights bit for bit; both load into 1 and 2 FSDP ranks and train (SGD, fp32) as
the reference checkpoint does on one process. Pre-quantised bitsandbytes checkpoints are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from axolotl_stand_ins import tiny_config
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, full_parameters, train_under_layout


def _e2m1(code: int) -> float:
    """The value of a 4-bit E2M1 code (sign, 2 exponent bits with bias 1, 1 mantissa bit)."""
    sign, exp, man = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


def mxfp4_pack(experts: int, rows: int, cols: int, gen: torch.Generator):
    """Random MXFP4 weights in the stored orientation [experts, rows, cols]: (blocks, scales, the
    exact values as the model's [experts, cols, rows] parameter)."""
    codes = torch.randint(0, 16, (experts, rows, cols // 32, 32), generator=gen)
    exponent = torch.randint(-8, -3, (experts, rows, cols // 32), generator=gen)
    table = torch.tensor([_e2m1(c) for c in range(16)])
    values = table[codes] * torch.exp2(exponent.float())[..., None]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # first value in the low nibble
    return (
        blocks,
        (exponent + 127).to(torch.uint8),
        values.reshape(experts, rows, cols).transpose(1, 2).contiguous(),
    )


def _save(model, path: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)


def _rewrite(ref: Path, out: Path, convert, config_extra: dict | None = None) -> None:
    """``out``: ``ref`` with its weights passed through ``convert`` (and config.json fields added)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ref, out)
    state = convert(load_file(ref / "model.safetensors"))
    save_file(
        {k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    if config_extra:
        config = json.loads((out / "config.json").read_text())
        config.update(config_extra)
        (out / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(reference dir, MXFP4 dir): the same weights, the experts exactly MXFP4 values."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_oss"))
    gen, packed = torch.Generator().manual_seed(1), {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                e, cols, rows = p.shape
                blocks, scales, exact = mxfp4_pack(e, rows, cols, gen)
                p.copy_(exact)
                packed[name] = (blocks, scales)
    _save(model, root / "ref")

    def to_mxfp4(state):
        for name, (blocks, scales) in packed.items():
            del state[name]
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        return state

    _rewrite(
        root / "ref",
        root / "mxfp4",
        to_mxfp4,
        {
            "quantization_config": {
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
            }
        },
    )
    return root / "ref", root / "mxfp4"


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """(reference dir, linearized dir): the same weights, the experts as Axolotl's per-expert linears."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("llama4")
    torch.manual_seed(0)
    _save(AutoModelForCausalLM.from_config(tiny_config("llama4_text")), root / "ref")
    _rewrite(root / "ref", root / "linearized", _linearize)
    return root / "ref", root / "linearized"


def _linearize(state: dict) -> dict:
    """Axolotl's linearized layout: each expert as gate / up / down linears."""
    for name in [k for k in state if k.endswith("experts.gate_up_proj")]:
        prefix, gate_up = name.removesuffix("gate_up_proj"), state.pop(name)
        down, inter = state.pop(prefix + "down_proj"), gate_up.shape[-1] // 2
        for e in range(gate_up.shape[0]):
            state[f"{prefix}gate_projs.{e}.weight"] = gate_up[e, :, :inter].T
            state[f"{prefix}up_projs.{e}.weight"] = gate_up[e, :, inter:].T
            state[f"{prefix}down_projs.{e}.weight"] = down[e].T
    return state


def _loaded(model_dir: str, layout: dict) -> dict:
    from ndparallel import ParallelismConfig
    from ndparallel.engine import Engine

    engine = Engine(ParallelismConfig(**layout))
    return full_parameters(engine.build_model(model_dir))


def _assert_same_weights(ref: Path, other: Path, world: int) -> None:
    layout = {"dp_shard_size": world}
    want = run_on_ranks(_loaded, 1, str(ref), {})[0]
    got = run_on_ranks(_loaded, world, str(other), layout)[0]
    assert set(got) == set(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert differ == []


def test_mxfp4_experts_are_dequantised_exactly_on_load(gpt_oss):
    from safetensors import safe_open

    ref, mxfp4 = gpt_oss
    with safe_open(mxfp4 / "model.safetensors", "pt") as f:  # the stand-in is really packed
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in f.keys()
        assert "model.layers.0.mlp.experts.gate_up_proj" not in f.keys()
    _assert_same_weights(ref, mxfp4, 1)
    _assert_same_weights(ref, mxfp4, 2)  # each rank dequantises its 2 of the 4 experts


def test_linearized_llama4_experts_are_fused_on_load(llama4):
    ref, linearized = llama4
    _assert_same_weights(ref, linearized, 2)


def test_linearized_multimodal_llama4_checkpoint_loads_its_text_model(tmp_path):
    """Axolotl's published linearized checkpoints are Llama4ForConditionalGeneration
    (``language_model.model.layers.*``): the text model is read from them, experts fused."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        projector_input_dim=32,
        projector_output_dim=32,
        vision_output_dim=32,
    )
    torch.manual_seed(0)
    _save(
        Llama4ForConditionalGeneration(
            Llama4Config(text_config=tiny_config("llama4_text").to_dict(), vision_config=vision)
        ),
        tmp_path / "ref",
    )
    _rewrite(tmp_path / "ref", tmp_path / "linearized", _linearize)
    _assert_same_weights(tmp_path / "ref", tmp_path / "linearized", 2)


def _setup(model_type: str, model_dir: Path) -> TrainSetup:
    return TrainSetup(tiny_config(model_type), steps=2, optimizer="sgd", lr=0.5, model_dir=str(model_dir))


def _train(model_type: str, model_dir: Path, world: int):
    layout = {"dp_shard_size": world} if world > 1 else None
    return run_on_ranks(train_under_layout, world, _setup(model_type, model_dir), layout, timeout_s=300)[0]


@pytest.mark.parametrize("fmt,model_type", [("gpt_oss", "gpt_oss"), ("llama4", "llama4_text")])
def test_converted_checkpoints_train_as_the_reference_on_fsdp(fmt, model_type, request):
    ref, converted = request.getfixturevalue(fmt)
    reference = one_process_reference(_setup(model_type, ref))
    for world in (1, 2):
        assert_matches(reference, _train(model_type, converted, world))
    assert reference.result.losses[-1] < reference.result.losses[0]  # it trained


def _export(model_dir: str, out: str) -> None:
    from ndparallel import ParallelismConfig
    from ndparallel.checkpoint.export import save_hf_model
    from ndparallel.engine import Engine

    engine = Engine(ParallelismConfig(dp_shard_size=2))
    save_hf_model(engine.build_model(model_dir), out, engine.is_main_process)


@pytest.mark.parametrize("fmt", ["gpt_oss", "llama4"])
def test_export_is_transformers_plain_layout(fmt, request, tmp_path):
    """The trained model is saved as transformers saves the family (no MXFP4, no linearized experts):
    from_pretrained reads it without Axolotl's patches or a quantizer."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref, converted = request.getfixturevalue(fmt)
    run_on_ranks(_export, 2, str(converted), str(tmp_path / "out"))
    ours, want = load_file(tmp_path / "out" / "model.safetensors"), load_file(ref / "model.safetensors")
    assert set(ours) == set(want) and all(torch.equal(ours[k], want[k].to(ours[k].dtype)) for k in want)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def test_prequantized_bitsandbytes_checkpoint_is_refused_before_launch(llama4, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ndparallel.models.weights import weights_problem

    ref, _ = llama4

    def bnb(state):  # bitsandbytes' layout: packed uint8 weights and their quantisation state
        for name in [k for k in state if k.endswith("q_proj.weight")]:
            state[name] = torch.zeros(state[name].numel() // 2, 1, dtype=torch.uint8)
            state[name + ".absmax"] = torch.ones(state[name].numel() // 32)
        return state

    _rewrite(
        ref,
        tmp_path / "bnb",
        bnb,
        {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
    )
    for path in (tmp_path / "bnb", ref):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        problem = weights_problem(model, [path / "model.safetensors"])
        if path == ref:
            assert problem is None  # the control: the bf16 checkpoint loads
        else:
            assert (
                problem is not None
                and "pre-quantised by bitsandbytes" in problem
                and "bf16 checkpoint" in problem
            )


def test_only_the_sliced_rows_are_read_for_mxfp4(gpt_oss, monkeypatch):
    """The memory bound: a rank's slice is built from its rows of the stored tensors (reading a
    whole tensor fails here), in blocks of rows (here one expert per block)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import ndparallel.models.key_conversion as kc
    from ndparallel.models.safetensors_read import SliceReader, checkpoint_plan, stored_tensors

    _, mxfp4 = gpt_oss
    config = AutoConfig.from_pretrained(mxfp4)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    files = [mxfp4 / "model.safetensors"]
    plan = checkpoint_plan(model, files)
    name = "model.layers.1.mlp.experts.down_proj"
    group = plan.fused[name]
    assert group.maps_rows() and not group.stacks_rows()
    reader = SliceReader(str(mxfp4), model, plan, stored_tensors(files))
    rows = []

    def read_rows(key, lo, hi):
        rows.append((lo, hi))
        return reader._read_rows(key, lo, hi)

    def no_whole(key):
        raise AssertionError(f"read {key} whole")

    shape = list(group.shapes[name])
    full = group.read(model, name, [0, 0, 0], shape, reader._read_whole)  # no read_rows: all at once
    piece = group.read(model, name, [2, 0, 0], [2, *shape[1:]], no_whole, read_rows)
    assert rows == [(2, 4), (2, 4)] and torch.equal(piece, full[2:4])  # blocks, scales: rows 2-3 only
    rows.clear()
    monkeypatch.setattr(kc, "_BLOCK_VALUES", shape[1] * shape[2])  # one expert per block
    out = torch.empty(2, shape[1], shape[2] - 8)
    got = group.read(model, name, [2, 0, 8], [2, shape[1], shape[2] - 8], no_whole, read_rows, out=out)
    assert got is out and rows == [(2, 3), (2, 3), (3, 4), (3, 4)] and torch.equal(out, full[2:4, :, 8:])

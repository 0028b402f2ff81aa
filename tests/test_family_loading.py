"""Checkpoints as transformers writes them load sharded and export back unchanged: GPT-NeoX (its head
is ``embed_out`` on disk, ``lm_head`` in the model) and MoE families (one tensor per expert on disk,
fused ``experts.gate_up_proj`` / ``down_proj`` in the model), through transformers' own conversion
mapping. The header check sees the same keys before launch; a fused tensor's slice reads only the
experts in its rows."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from ndparallel.testing import run_on_ranks
from ndparallel.tools.shrink import shrink_model

FAMILIES = ["GPTNeoXConfig", "MixtralConfig", "Qwen3MoeConfig", "DeepseekV3Config"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for cls in FAMILIES:
        config = shrink_model(getattr(transformers, cls)(), tp_size=1, cp_size=1).config
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / cls)
        out[cls] = root / cls
    return out


def _load_and_export(paths: dict, out_root: str) -> dict:
    """On each rank (FSDP over all): load every model sharded, gather it, export it."""
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.tools.equivalence import full_parameters

    acc = Accelerator(ParallelismConfig(dp_shard_size=2))
    out = {}
    for cls, path in paths.items():
        model = acc.load_model(str(path))
        out[cls] = full_parameters(model)
        acc.save_model(model, f"{out_root}/{cls}")
    return out if acc.is_main_process else {}


def test_sharded_load_and_export_equal_transformers(saved, tmp_path):
    got = run_on_ranks(_load_and_export, 2, saved, str(tmp_path), timeout_s=300)[0]
    for cls, path in saved.items():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
        assert set(got[cls]) == set(ref), cls
        for name, tensor in ref.items():
            assert torch.equal(got[cls][name], tensor.float()), (cls, name)
        written, original = (
            load_file(tmp_path / cls / "model.safetensors"),
            load_file(path / "model.safetensors"),
        )
        assert set(written) == set(original), (cls, sorted(set(written) ^ set(original))[:4])
        assert all(torch.equal(written[k], original[k]) for k in original), cls
    neox = load_file(saved["GPTNeoXConfig"] / "model.safetensors")
    assert "embed_out.weight" in neox and "lm_head.weight" not in neox  # the conversion was needed
    moe = load_file(saved["MixtralConfig"] / "model.safetensors")
    assert any(".experts.3.w1." in k for k in moe)


def test_header_check_follows_the_conversion(saved, tmp_path):
    """Before launch: the stored per-expert keys satisfy the fused model tensors; a missing expert
    and a wrongly shaped one are named."""
    from safetensors.torch import save_file

    from ndparallel.models.weights import weights_problem

    path = saved["Qwen3MoeConfig"]
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert weights_problem(model, [path / "model.safetensors"]) is None
    tensors = load_file(path / "model.safetensors")
    key = next(k for k in tensors if ".experts.1.up_proj." in k)
    broken = tmp_path / "model.safetensors"
    save_file({k: v for k, v in tensors.items() if k != key}, broken)
    assert "experts" in weights_problem(model, [broken])
    save_file({**tensors, key: tensors[key][:-1]}, broken)
    problem = weights_problem(model, [broken])
    assert "experts.gate_up_proj cannot be built from its stored tensors" in problem, problem


def test_fused_slice_reads_only_its_experts(saved):
    """FSDP's dim-0 shard of ``experts.gate_up_proj`` [E, 2I, H]: only the experts in those rows are
    read (memory: the shard's rows, not the whole fused tensor), and the slice is exact."""
    from ndparallel.models.key_conversion import checkpoint_keys

    path = saved["MixtralConfig"]
    tensors = load_file(path / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    plan = checkpoint_keys(model, {k: ("F32", list(v.shape)) for k, v in tensors.items()})
    name = "model.layers.0.mlp.experts.gate_up_proj"
    fused = plan.fused[name]
    assert fused.stacks_rows()
    reads = []

    def read(key):
        reads.append(key)
        return tensors[key]

    shape = fused.shapes[name]
    piece = fused.read(model, name, [2, 0, 0], [2, *shape[1:]], read)
    assert sorted({int(k.split(".experts.")[1].split(".")[0]) for k in reads}) == [2, 3]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()[name]
    assert torch.equal(piece, ref[2:4])

"""``acc.load_model``: meta init + sharded safetensors load equals a plain ``from_pretrained`` under
every layout (parameters, buffers via forward outputs, ties, one training step); clear errors."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, ViTConfig

from ndparallel.engine.model_build import build_model
from ndparallel.models.presets import preset_config
from ndparallel.testing import RankFailure, run_on_ranks

LAYOUTS = {
    "1rank": ({}, 1),
    "fsdp2": ({"dp_shard_size": 2}, 2),
    "hsdp2x2": ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4),
}
TP_LAYOUT = ({"dp_shard_size": 2, "tp_size": 2}, 4)


def _inputs(vocab):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (2, 16), generator=g)


def _save(path, preset, dtype=torch.float32, **save_kwargs):
    # The tied model has uneven dims (vocab 250, intermediate 100) so FSDP pads some shards.
    overrides = {"vocab_size": 250, "intermediate_size": 100} if preset.endswith("tied") else {}
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(preset_config(preset, **overrides)).to(dtype)
    model.save_pretrained(path, **save_kwargs)
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "untied": _save(root / "untied", "tiny-llama"),
        "tied": _save(root / "tied", "tiny-llama-tied"),
        "sharded": _save(root / "sharded", "tiny-llama", max_shard_size="100KB"),
        "bf16": _save(root / "bf16", "tiny-llama", dtype=torch.bfloat16),
    }


def _probe(path, layout):
    """Load under ``layout``; return full params, ties, logits, and params after one SGD step."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(**layout))
    model = acc.load_model(path)
    tied_after_load = model.lm_head.weight is model.model.embed_tokens.weight
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    params = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    x = _inputs(model.config.vocab_size)
    # No separate no_grad forward first: under FSDP it was seen to leave the output group
    # (norm + lm_head, reshard_after_forward=False) without gradients in the next step.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = model(input_ids=x, labels=x)
    acc.backward(out.loss)  # the same batch on every rank: the mean equals one process
    opt.step()
    logits = out.logits.detach()
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    stepped = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return dict(
        params=params,
        logits=logits,
        stepped=stepped,
        buffers=buffers,
        tied=(tied_after_load, model.lm_head.weight is model.model.embed_tokens.weight),
    )


def _reference(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    x = _inputs(model.config.vocab_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    opt.step()
    return dict(
        params=params,
        logits=out.logits.detach(),
        stepped=model.state_dict(),
        buffers=dict(model.named_buffers()),
        tied=model.config.tie_word_embeddings,
    )


def _max_diff(a, b):
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _check(path, layout, world):
    ref = _reference(path)
    got = run_on_ranks(_probe, world, path, layout)[0]
    assert _max_diff(got["params"], ref["params"]) == 0.0
    assert _max_diff(got["buffers"], ref["buffers"]) == 0.0  # rotary inv_freq recomputed
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-5
    assert _max_diff(got["stepped"], ref["stepped"]) <= 1e-6
    assert got["tied"] == (ref["tied"], ref["tied"])


@pytest.mark.parametrize("kind", ["untied", "tied"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_equals_from_pretrained(ckpts, kind, layout):
    _check(ckpts[kind], *LAYOUTS[layout])


@pytest.mark.parametrize("kind", ["sharded", "bf16"])
def test_sharded_index_and_dtype_conversion(ckpts, kind):
    _check(ckpts[kind], *LAYOUTS["fsdp2"])


def test_fsdp_x_tp(ckpts):
    _check(ckpts["untied"], *TP_LAYOUT)


def _preset_probe(name):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    before = torch.random.get_rng_state()
    model = acc.load_model(name, seed=7)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    return sd, torch.equal(before, torch.random.get_rng_state())


def test_preset_random_init_is_seeded_and_same_on_every_rank():
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(preset_config("tiny-llama-tied")).state_dict()
    results = run_on_ranks(_preset_probe, 2, "tiny-llama-tied")
    assert _max_diff(results[0][0], ref) == 0.0  # the full state dict is gathered on rank 0
    assert all(rng_untouched for _, rng_untouched in results)


# ------------------------------------------------------------------------------------- errors
def test_missing_path_names_presets(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*tiny-llama"):
        build_model(None, tmp_path / "nope")


def test_pickled_weights_are_refused_not_unpickled(tmp_path):
    (tmp_path / "config.json").write_text(preset_config("tiny-llama").to_json_string())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle: must never be opened")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*[Cc]onvert"):
        build_model(None, tmp_path)


def test_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_model(None, tmp_path)


def test_config_without_causal_lm_class(tmp_path):
    with pytest.raises(ValueError, match="vit.*causal"):
        build_model(None, ViTConfig())
    (tmp_path / "config.json").write_text(json.dumps(ViTConfig().to_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="causal"):
        build_model(None, tmp_path)


def _load_wrong(path):
    from ndparallel import Accelerator

    return Accelerator().load_model(path)


def test_checkpoint_of_another_model_names_missing_keys(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(preset_config("tiny-llama").to_json_string())
    save_file({"transformer.wte.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(RankFailure, match="not in the checkpoint"):
        run_on_ranks(_load_wrong, 1, str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_slice_matches_slicing(tmp_path, monkeypatch, dtype):
    """Contiguous, strided and dtype-converting slice reads, with tiny blocks for strided ones."""
    from safetensors.torch import save_file

    import ndparallel.models.safetensors_read as ml
    from ndparallel.models.weights import read_header

    monkeypatch.setattr(ml, "_TEMP_BYTES", 40)
    full = torch.randn(7, 5, 3).to(dtype)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    header, start = read_header(tmp_path / "w.safetensors", with_data_start=True)
    cases = [([2, 0, 0], [3, 5, 3]), ([0, 1, 0], [7, 3, 3]), ([1, 2, 1], [5, 2, 2])]
    for out_dtype in (dtype, torch.float32):
        for offsets, lengths in cases:
            target = torch.empty(lengths, dtype=out_dtype)
            with open(tmp_path / "w.safetensors", "rb", buffering=0) as f:
                ml.read_slice(f, start, header["w"], offsets, lengths, target)
            want = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].to(out_dtype)
            assert torch.equal(target, want), (offsets, lengths, out_dtype)


def test_hub_id_that_cannot_be_fetched_is_one_clear_error(monkeypatch):
    """Offline (this machine reaches no hub): an unknown ``org/name`` ends in one error naming it."""
    from ndparallel.models.loading import resolve_model_dir

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="'no-such-org/no-such-model' is not a local directory"):
        resolve_model_dir("no-such-org/no-such-model", is_local_main=True)


def test_local_paths_are_not_sent_to_the_hub(tmp_path):
    from ndparallel.models.loading import resolve_model_dir

    assert resolve_model_dir(str(tmp_path), True) == tmp_path
    assert resolve_model_dir("./relative/dir", True) == Path("./relative/dir")

"""HF export: from a sharded model (FSDP2, FSDP2×TP2) and from a DCP checkpoint (offline CLI);
the result reloads with ``from_pretrained`` and gives the trained sharded model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ndparallel.cli.export_command import export_main
from ndparallel.runtime.multirank import run_on_ranks
from ndparallel.runtime.sizes import parse_size

INPUT = torch.arange(24).reshape(2, 12) % 200


def _train_and_export(layout: dict, out: str, preset: str) -> dict | None:
    """Train 2 steps, export with ``acc.save_model`` and with tiny shards, save a checkpoint;
    return the sharded model's logits on ``INPUT`` (rank 0)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.checkpoint import save_checkpoint
    from ndparallel.checkpoint.export import save_hf_model
    from ndparallel.models.presets import preset_config
    from ndparallel.tools.equivalence import (
        TrainSetup,
        build_model,
        make_global_batches,
        setup_optimizer,
    )

    setup = TrainSetup(model_config=preset_config(preset), steps=2, seq_len=16, global_micro_batch=4)
    acc = Accelerator(ParallelismConfig(**layout))
    model = build_model(setup)
    optimizer = setup_optimizer(setup, model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    rows = setup.global_micro_batch // acc.dp_size
    for (mb,) in make_global_batches(setup):
        mb = {k: v[acc.dp_rank * rows : (acc.dp_rank + 1) * rows] for k, v in mb.items()}
        n = acc.global_num_items([mb])
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
        acc.backward(acc.causal_lm_loss(logits, mb["shift_labels"], n), num_items_in_batch=n)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=INPUT, position_ids=torch.arange(12).expand(2, -1)).logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
    acc.save_model(model, f"{out}/hf")
    save_hf_model(model, f"{out}/hf-sharded", is_main=acc.is_main_process, max_shard_size="60KB")
    save_checkpoint(f"{out}/ckpt", model, optimizer, step=2)
    dist.barrier()
    return logits.float() if acc.is_main_process else None


def _reload_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def _keys(path: Path) -> set[str]:
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            keys |= set(sf.keys())
    return keys


@pytest.fixture(scope="module")
def fsdp_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("export-fsdp")
    logits = run_on_ranks(_train_and_export, 2, {"dp_shard_size": 2}, str(out), "tiny-llama-tied")[0]
    return out, logits


def test_fsdp_export_reloads_with_same_logits(fsdp_export):
    out, logits = fsdp_export
    assert (out / "hf" / "model.safetensors").is_file() and (out / "hf" / "config.json").is_file()
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    torch.testing.assert_close(_reload_logits(out / "hf"), logits, rtol=1e-5, atol=1e-5)
    # Tied embeddings are saved once, under the name HF keeps.
    keys = _keys(out / "hf")
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys


def test_sharded_export_writes_index(fsdp_export):
    out, logits = fsdp_export
    index = json.loads((out / "hf-sharded" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((out / "hf-sharded" / f).is_file() for f in files)
    assert set(index["weight_map"]) == _keys(out / "hf")
    torch.testing.assert_close(_reload_logits(out / "hf-sharded"), logits, rtol=1e-5, atol=1e-5)


def test_export_cli_from_checkpoint(fsdp_export, tmp_path):
    out, logits = fsdp_export
    assert export_main([str(out / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", "100KB"]) == 0
    torch.testing.assert_close(_reload_logits(tmp_path / "hf"), logits, rtol=1e-5, atol=1e-5)
    assert _keys(tmp_path / "hf") == _keys(out / "hf")
    assert export_main([str(out / "ckpt"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as sf:
        assert sf.get_tensor("model.norm.weight").dtype == torch.bfloat16
    # An incomplete checkpoint is refused with a clear message.
    (out / "ckpt" / "COMPLETE").rename(out / "ckpt" / "COMPLETE.bak")
    try:
        assert export_main([str(out / "ckpt"), str(tmp_path / "bad")]) == 2  # input error
    finally:
        (out / "ckpt" / "COMPLETE.bak").rename(out / "ckpt" / "COMPLETE")


def test_fsdp_tp_export_reloads_with_same_logits(tmp_path):
    pytest.importorskip("ndparallel.parallel.tp.tensor")
    logits = run_on_ranks(
        _train_and_export, 4, {"dp_shard_size": 2, "tp_size": 2}, str(tmp_path), "tiny-llama"
    )[0]
    torch.testing.assert_close(_reload_logits(tmp_path / "hf"), logits, rtol=1e-5, atol=1e-5)
    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "from-ckpt")]) == 0
    torch.testing.assert_close(_reload_logits(tmp_path / "from-ckpt"), logits, rtol=1e-5, atol=1e-5)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("100KB") == 100_000 and parse_size(123) == 123
    with pytest.raises(ValueError):
        parse_size("lots")

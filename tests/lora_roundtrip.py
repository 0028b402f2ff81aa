"""The saved-adapter round trip both LoRA-extension tests run on 2 FSDP ranks: a base saved with
``save_pretrained``, trained from disk (meta build, sharded load) and saved as a PEFT adapter and a
merged model; the adapter loaded back as ``lora_model_dir`` does. Each returns logits on ``PROBE``."""

from __future__ import annotations

import torch

PROBE = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))


def save_base(path: str, config) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def train_and_save(setup, base_dir: str, out: str) -> torch.Tensor:
    """FSDP 2 from the saved base: ``setup.steps`` steps, then ``out/adapter`` and ``out/merged``."""
    from ndparallel import ParallelismConfig
    from ndparallel.checkpoint.export import save_hf_model
    from ndparallel.engine import Engine, train_step
    from ndparallel.models.adapters import lora_config
    from ndparallel.tools.equivalence import make_global_batches, setup_optimizer

    engine = Engine(ParallelismConfig(dp_shard_size=2))
    model = engine.build_model(base_dir, adapter=lora_config(**setup.adapter), seed=1)
    optimizer = setup_optimizer(setup, model)
    rows, r = setup.global_micro_batch // engine.dp_size, engine.dp_rank
    for i, micro_batches in enumerate(make_global_batches(setup)):
        local = [{k: v[r * rows : (r + 1) * rows] for k, v in mb.items()} for mb in micro_batches]
        train_step(engine, model, optimizer, local, max_grad_norm=1.0, step=i + 1)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits.detach().clone()
    save_hf_model(model, f"{out}/adapter", engine.is_main_process)
    save_hf_model(model, f"{out}/merged", engine.is_main_process, merge_adapter=True)
    return logits


def continue_from(base_dir: str, adapter_dir: str) -> torch.Tensor:
    """``lora_model_dir``'s path: the saved adapter loaded on FSDP 2."""
    from ndparallel import ParallelismConfig
    from ndparallel.engine import Engine
    from ndparallel.models.adapter_files import read_adapter_config

    engine = Engine(ParallelismConfig(dp_shard_size=2))
    model = engine.build_model(
        base_dir, adapter=read_adapter_config(adapter_dir), adapter_weights=adapter_dir
    )
    with torch.no_grad():
        return model.eval()(input_ids=PROBE).logits.detach().clone()

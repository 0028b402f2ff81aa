"""`ndparallel train` with Axolotl's ``lora_modules_to_save`` and ``lora_target_parameters`` on a
QLoRA mixture-of-experts run (FSDP 2): the final PEFT adapter, the one exported from the DCP
checkpoint and the merged model agree, hold the trained embedding / head and expert adapters, and
the saved modules were never quantised."""

from __future__ import annotations

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch
from safetensors.torch import load_file

from ndparallel.axolotl import load_config
from ndparallel.testing import run_on_ranks

CONFIG = """base_model: {base}
tokenizer: builtin:stdlib
tokenizer_vocab_size: 512
datasets: [{{path: 'builtin:stdlib', max_bytes: 100000}}]
sequence_len: 32
micro_batch_size: 2
max_steps: 2
save_steps: 2
learning_rate: 5.0e-3
device: cpu
dp_shard_size: 2
adapter: qlora
load_in_4bit: true
nf4_block_size: 32
nf4_scaler_block_size: 4
lora_r: 4
lora_alpha: 8
lora_target_modules: [q_proj, v_proj]
lora_target_parameters: [experts.gate_up_proj, experts.down_proj]
lora_modules_to_save: [embed_tokens, lm_head]
merge_lora: true
"""


def _train(path: str, overrides: list[str]):
    from ndparallel.training.trainer import run_training

    torch.compiler.set_stance("force_eager")
    run_training(load_config(path, overrides))
    return True


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from ndparallel.models.presets import preset_config

    root = tmp_path_factory.mktemp("lora-extra")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(preset_config("tiny-qwen3-moe", vocab_size=512)).save_pretrained(
        root / "base"
    )
    cfg = root / "cfg.yaml"
    cfg.write_text(CONFIG.format(base=root / "base"))
    run_on_ranks(
        _train,
        2,
        str(cfg),
        [f"output_dir={root / 'out'}", f"dataset_cache_dir={root / 'cache'}"],
        timeout_s=400,
    )
    return root


def _nf4_base(root):
    """The base as the run computed with it: its NF4 linears quantised and back (experts, router,
    embedding and head are not NF4)."""
    from torchao.quantization import to_nf4
    from transformers import AutoModelForCausalLM

    from ndparallel.models.quantized import NF4Config, quantized_linears

    model = AutoModelForCausalLM.from_pretrained(root / "base").float().eval()
    names, _ = quantized_linears(model, NF4Config(block_size=32, scaler_block_size=4))
    assert names and not [n for n in names if "lm_head" in n or "experts" in n]
    with torch.no_grad():
        for name in names:
            w = model.get_submodule(name).weight
            w.copy_(to_nf4(w, 32, 4).get_original_weight())
    return model


def test_adapter_export_and_merge_agree(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ndparallel.checkpoint.export import export_checkpoint

    out = run / "out"
    final = load_file(str(out / "final" / "adapter_model.safetensors"))
    base = load_file(str(run / "base" / "model.safetensors"))
    emb, head = final["base_model.model.model.embed_tokens.weight"], final["base_model.model.lm_head.weight"]
    assert (emb - base["model.embed_tokens.weight"]).abs().max() > 1e-4  # trained in full
    assert (head - base["lm_head.weight"]).abs().max() > 1e-4
    assert any(".experts.lora_B." in k and v.abs().max() > 0 for k, v in final.items())
    exported = load_file(
        str(export_checkpoint(out / "checkpoint-2", tmp_path / "adapter") / "adapter_model.safetensors")
    )
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").float().eval()(input_ids=ids).logits
        lora = PeftModel.from_pretrained(_nf4_base(run), str(out / "final")).eval()(input_ids=ids).logits
        untouched = _nf4_base(run)(input_ids=ids).logits
    assert (lora - merged).abs().max() <= 2e-5
    assert (lora - untouched).abs().max() > 1e-3

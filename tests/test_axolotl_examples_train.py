"""A representative handful of Axolotl's own examples (tests/fixtures/axolotl_examples) trained to the
end on 2 CPU ranks, unchanged but for paths (tiny local models, local data in each dataset's own
columns), sequence_len, max_steps and micro-batch sizes: ``--nproc-per-node 2`` without degrees in
the YAML gives data parallelism (or FSDP where the config asks for it), as Axolotl's launch does.

* FSDP (FSDP1 ``fsdp:`` list + legacy ``fsdp_`` keys), full fine-tuning, chat_template (Llama 3's
  named template, ShareGPT columns, a ``train[:N%]`` split), sample packing, the Liger plugin
  (-> compile, chunked loss), a validation split smaller than one global batch;
* LoRA on Qwen 3 with packing, Alpaca data, wandb and SwanLab (offline, no network), TensorBoard and MLflow;
* streamed pre-training (``pretraining_dataset``, per-document attention); Muon pre-training on FSDP2;
* QAT on FSDP2, LoRA with modules_to_save and deduplication, sequential packing, QLoRA, fp16 LoRA.
Each output loads with transformers / PEFT. (Elsewhere: the seed config, test_axolotl_config.py; a
multimodal QLoRA example, test_multimodal.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from axolotl_stand_ins import FIXTURES
from cli_helpers import train_on_forked_ranks
from sft_fixtures import alpaca_records, chat_records, llama3_tokenizer, tiny_llama_dir, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = FIXTURES / "examples"


def _train(config: Path, cwd: Path, *sets: str, env: dict | None = None) -> subprocess.CompletedProcess:
    args = ["train", config, "--nproc-per-node", "2", *[a for s in sets for a in ("--set", s)]]
    proc = train_on_forked_ranks(args, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _sharegpt(records: list[dict]) -> list[dict]:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return [
        {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in r["messages"]]}
        for r in records
    ]


def tiny_qwen3_dir(path: Path) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = llama3_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow  # Liger -> torch.compile (aot_eager here: inductor's CPU codegen cost 37 CPU s cold)
@pytest.mark.timeout(300)  # a real multi-rank launch, 40-95 s on 2 cores: over the 120 s default budget
def test_fsdp_chat_template_packing_liger_full_finetune(tmp_path):
    model = tiny_llama_dir(tmp_path / "llama")
    data = tmp_path / "finetome"
    data.mkdir()
    write_jsonl(data / "train.jsonl", _sharegpt(chat_records(150)))
    proc = _train(
        EXAMPLES / "llama-3/fft-8b-liger-fsdp.yaml",
        tmp_path,
        f"base_model={model}",
        f"datasets.0.path={data}",
        "sequence_len=128",
        "max_steps=2",
        "micro_batch_size=1",
        "gradient_accumulation_steps=2",
        "torch_compile_backend=aot_eager",  # Axolotl's key; inductor's codegen is test_compile's
        "output_dir=out",
    )
    notes = proc.stdout
    for said in (
        "fsdp_config: Axolotl's legacy fsdp_ prefix dropped",
        "FSDP2 over every rank",
        "-> torch_compile: true",
        "gradient_checkpointing: true ->",
        "bf16: auto -> false",
    ):
        assert said in notes, (said, notes[-3000:])
    out = tmp_path / "out"
    rows = _steps(out)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and any("eval_loss" in r for r in rows)
    assert "FSDP 2 on 2 rank(s)" in proc.stdout, proc.stdout[-2000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out / "final").config.num_hidden_layers == 2
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert tok.eos_token == "<|eot_id|>" and tok.pad_token == "<|finetune_right_pad_id|>"


def test_lora_packing_alpaca_with_wandb_swanlab_offline_tensorboard_mlflow(tmp_path):
    model = tiny_qwen3_dir(tmp_path / "qwen3")
    write_jsonl(tmp_path / "alpaca.jsonl", alpaca_records(60))
    env = {
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_SILENT": "true",  # any network call would fail
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    _train(
        EXAMPLES / "qwen3/8b-lora-fused-attn.yaml",
        tmp_path,
        f"base_model={model}",
        f"datasets.0.path={tmp_path / 'alpaca.jsonl'}",
        "sequence_len=128",
        "max_steps=3",
        "gradient_accumulation_steps=1",
        "output_dir=out",
        "wandb_project=axolotl-replay",
        "wandb_mode=offline",
        "use_tensorboard=true",
        "mlflow_experiment_name=replay",
        f"mlflow_tracking_uri=file://{tmp_path / 'mlruns'}",
        "swanlab_project=replay",
        "swanlab_mode=offline",
        env=env,
    )
    out = tmp_path / "out"
    assert [r["step"] for r in _steps(out) if "loss" in r] == [1, 2, 3]
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))  # the offline run, to `wandb sync` later
    assert list((out / "runs").rglob("events.out.tfevents.*"))
    assert list((tmp_path / "mlruns").rglob("metrics/loss"))
    (swanlab,) = (out / "swanlog").rglob("run-*.swanlab")  # the offline run, to `swanlab sync` later
    assert (
        b"loss" in swanlab.read_bytes()
        and b"learning_rate" in next((out / "swanlog").rglob("config.yaml")).read_bytes()
    )
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), out / "final")
    assert lora.peft_config["default"].r == 32 and lora.peft_config["default"].lora_alpha == 64


def test_streamed_pretraining(tmp_path):
    model = tiny_llama_dir(tmp_path / "smollm")
    write_jsonl(
        tmp_path / "fineweb.jsonl", [{"text": r["output"], "id": i} for i, r in enumerate(alpaca_records(80))]
    )
    proc = _train(
        EXAMPLES / "streaming/pretrain.yaml",
        tmp_path,
        f"base_model={model}",
        f"pretraining_dataset.0.path={tmp_path / 'fineweb.jsonl'}",
        "pretraining_dataset.0.name=null",
        "sequence_len=64",
        "max_steps=3",
        "gradient_accumulation_steps=2",
        "logging_steps=1",
        "output_dir=out",
    )
    assert "streamed while training" in proc.stdout or [r for r in _steps(tmp_path / "out") if "loss" in r]
    assert [r["step"] for r in _steps(tmp_path / "out") if "loss" in r] == [1, 2, 3]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final").config.model_type == "llama"


@pytest.mark.parametrize("extra", [["pretraining_dataset.0.split=train[:10%]"]])
def test_streamed_pretraining_refuses_a_slice_at_dry_run(tmp_path, extra, capsys):
    from cli_helpers import forbid_launch, run_cli

    mp = pytest.MonkeyPatch()
    forbid_launch(mp)
    try:
        model = tiny_llama_dir(tmp_path / "smollm")
        write_jsonl(tmp_path / "fineweb.jsonl", [{"text": "a b c"}])
        code, _, err = run_cli(
            capsys,
            "train",
            EXAMPLES / "streaming/pretrain.yaml",
            "--set",
            f"base_model={model}",
            "--set",
            f"pretraining_dataset.0.path={tmp_path / 'fineweb.jsonl'}",
            "--dry-run",
            "--set",
            f"output_dir={tmp_path / 'out'}",
            *[x for e in extra for x in ("--set", e)],
        )
    finally:
        mp.undo()
    assert code == 2 and "a streamed dataset has no length to slice by" in err, err


def tiny_qwen2_dir(path: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = llama3_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_muon_pretraining_fsdp2(tmp_path):
    """Axolotl's Muon pre-training example (FSDP2, streamed data): Muon for the hidden matrices,
    AdamW for the rest, said under --dry-run; trains and its output loads."""
    model = tiny_qwen2_dir(tmp_path / "qwen2")
    write_jsonl(tmp_path / "c4.jsonl", [{"text": r["output"]} for r in alpaca_records(80)])
    proc = _train(
        EXAMPLES / "qwen2/muon-pretrain-fsdp2.yaml",
        tmp_path,
        f"base_model={model}",
        f"pretraining_dataset.0.path={tmp_path / 'c4.jsonl'}",
        "pretraining_dataset.0.name=null",
        "sequence_len=64",
        "max_steps=3",
        "micro_batch_size=2",
        "output_dir=out",
    )
    assert "optimizer: muon: Muon" in proc.stdout, proc.stdout[-3000:]
    assert [r["step"] for r in _steps(tmp_path / "out") if "loss" in r] == [1, 2, 3]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final").config.model_type == "qwen2"


ALPACA_RUNS = {  # example -> extra --set overrides (each example's alpaca datasets point at local data)
    "llama-3/3b-qat-fsdp2.yaml": [],  # QAT int8 activations / int4 weights (group 32) on FSDP2
    "llama-3/lora-1b-deduplicate-sft.yml": ["datasets.1.path={data}"],  # LoRA + modules_to_save + dedup
    "llama-3/lora-1b-sample-packing-sequentially.yml": ["datasets.1.path={data}"],  # next fit, no shuffle
    "llama-3/qlora-1b.yml": ["nf4_block_size=2", "nf4_scaler_block_size=2"],  # QLoRA (NF4 groups fit 64)
    "archived/openllama-3b/lora.yml": ["special_tokens=null"],  # fp16 LoRA, dynamic loss scale (its <s> </s>
    # <unk> are OpenLLaMA's tokenizer's; the stand-in's tokenizer has its own)
}


@pytest.fixture
def low_bit_update_uncompiled(monkeypatch):
    """torchao's 8-bit AdamW (these examples' ``adamw_bnb_8bit``) ``torch.compile``s its update once
    per parameter shape and state kind in each rank: inductor's C++ codegen, ~15 CPU s a test here
    (more with a cold cache), for what these tests do not check. In their forked ranks the update
    runs as written, eagerly (the same torchao optimizer, quantised states and arithmetic), as
    test_qlora_train runs it (``force_eager``); compiled, it is test_optim_lowbit's, which checks it
    against one process."""
    import torch
    import torchao.optim.adam as adam

    compile_ = torch.compile

    def compile_all_but_the_update(model=None, **kwargs):
        return model if model is adam.single_param_adam else compile_(model, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_all_but_the_update)


@pytest.mark.timeout(300)  # a real multi-rank launch, 40-95 s on 2 cores: over the 120 s default budget
@pytest.mark.parametrize("example", sorted(ALPACA_RUNS))
def test_more_alpaca_examples_train_to_the_end(example, tmp_path, low_bit_update_uncompiled):
    """QAT, LoRA with modules_to_save and deduplication, sequential packing, QLoRA and fp16: each
    example as written but for paths and sizes, 2 steps on 2 ranks; the output loads."""
    model = tiny_llama_dir(tmp_path / "llama")
    data = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_records(48))
    sets = [s.format(data=data) for s in ALPACA_RUNS[example]]
    _train(
        EXAMPLES / example,
        tmp_path,
        f"base_model={model}",
        f"datasets.0.path={data}",
        "sequence_len=256",
        "max_steps=2",
        "micro_batch_size=2",
        "gradient_accumulation_steps=1",
        "output_dir=out",
        *sets,
    )
    out = tmp_path / "out"
    assert [r["step"] for r in _steps(out) if "loss" in r][-1] == 2
    from transformers import AutoModelForCausalLM

    if (out / "final" / "adapter_config.json").is_file():
        from peft import PeftModel

        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), out / "final")
    else:
        AutoModelForCausalLM.from_pretrained(out / "final")
    if "deduplicate" in example:  # the example lists one dataset twice: its second copy is dropped
        (meta,) = (tmp_path / ".cache" / "rows").glob("*/meta.json")
        assert json.loads(meta.read_text())["dropped_duplicates"] == 48

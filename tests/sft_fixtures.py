"""Small local stand-ins for a fine-tuning run: a Llama-3-style tokenizer (its special tokens, BOS
added by the tokenizer, Llama 3's chat template), a tiny Llama saved with ``save_pretrained``,
and alpaca / chat JSON-lines files, all generated in a temporary directory."""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = (
    "the a model data train answer question list write explain why how what number sum city river "
    "python code function value small large first second red blue green fast slow"
).split()


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def alpaca_records(n: int, seed: int = 0) -> list[dict]:
    """Alpaca-shaped records of varied lengths; every third has an empty ``input``."""
    rng = random.Random(seed)
    return [
        {
            "instruction": _sentence(rng, 3, 12),
            "input": "" if i % 3 == 0 else _sentence(rng, 2, 10),
            "output": " ".join(_sentence(rng, 3, 10) for _ in range(rng.randint(1, 4))),
        }
        for i in range(n)
    ]


def chat_records(n: int, seed: int = 0) -> list[dict]:
    """Conversations: an optional system turn, then 1-3 user/assistant exchanges."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": _sentence(rng, 3, 6)}] if i % 2 else []
        for _ in range(rng.randint(1, 3)):
            messages += [
                {"role": "user", "content": _sentence(rng, 2, 8)},
                {"role": "assistant", "content": _sentence(rng, 3, 12)},
            ]
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def llama3_tokenizer(vocab_size: int = 700):
    """A byte-level BPE trained on the fixtures' words, with Llama 3's special tokens and template."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    from ndparallel.data.chat import LLAMA3

    texts = [json.dumps(r) for r in alpaca_records(200, seed=1) + chat_records(100, seed=1)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A $B",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    out.chat_template = LLAMA3
    return out


def tiny_llama_dir(path: Path, vocab_size: int | None = None) -> Path:
    """A tiny Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) and its tokenizer, saved with
    ``save_pretrained`` (use_cache true in config.json, as in real checkpoints)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = llama3_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab_size or len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        use_cache=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def tiny_moe_dir(path: Path) -> Path:
    """A tiny Qwen3-MoE (``tiny-qwen3-moe``: 8 experts, 2 a token, its router's load-balancing loss
    in the model's loss) with the tokenizer of ``tiny_llama_dir``, seeded, saved with ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM

    from ndparallel.models.presets import preset_config

    tok = llama3_tokenizer()
    config = preset_config(
        "tiny-qwen3-moe", vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def weights_checksum(path: Path) -> str:
    """sha256 of a saved model's tensors (names, dtypes, shapes, bytes; sorted): a fixture recorded
    on one model tells a test that builds another (the peers' fixtures under tests/fixtures/)."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors = load_file(str(file))
        for name in sorted(tensors):
            t = tensors[name].contiguous()
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()

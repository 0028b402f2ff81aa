"""The inputs of the Axolotl side-by-side: local data, a local tokenizer, and one config per case.

Everything is generated from fixed seeds (no Hub access): a byte-level BPE with Llama 3's
pre-tokenizer pattern (so ``:\\n\\n`` is one token, as in Llama 3), Llama 3's BOS convention, a base
model's eos (``<|end_of_text|>``) and ChatML turn tokens in a ChatML template, as a base model
fine-tuned into ChatML has. ``write_inputs(dir)`` writes ``tokenizer/``, ``data/*.jsonl`` and
returns the cases: ``{name: config}`` with paths relative to ``dir``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS, BOS, PAD = "<|end_of_text|>", "<|begin_of_text|>", "<|pad|>"
SPECIALS = [BOS, EOS, PAD, "<|im_start|>", "<|im_end|>"]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
WORDS = (
    "the a model data train answer question list write explain why how what number sum city river "
    "python code function value small large first second red blue green fast slow: - 1. 2. ( ) ,"
).split()
ANSWER_STARTS = ["", "", "", "\n", "- ", ": ", " ", "\n\n1. "]  # some straddle the prompt's end


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."


def _answer(rng: random.Random, long: bool) -> str:
    n = rng.randint(12, 20) if long else rng.randint(1, 4)
    return rng.choice(ANSWER_STARTS) + " ".join(_sentence(rng, 3, 10) for _ in range(n))


def alpaca_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    inputs = lambda i: ["", "   ", "\n", None][i % 4] if i % 3 == 0 else _sentence(rng, 2, 10)  # noqa: E731
    return [
        {
            "instruction": _sentence(rng, 3, 12),
            **({} if inputs(i) is None else {"input": inputs(i)}),
            "output": _answer(rng, long=i % 9 == 4),
        }
        for i in range(n)
    ]


def custom_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for r in alpaca_records(n, seed):
        r = {"input": "", **r}
        r["system"] = None if rng.random() < 0.3 else _sentence(rng, 2, 6)
        out.append(r)
    return out


def chat_records(n: int, seed: int, sharegpt: bool = False) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": _sentence(rng, 3, 6)}] if i % 2 else []
        for _ in range(rng.randint(1, 3)):
            messages += [
                {"role": "user", "content": _sentence(rng, 2, 8)},
                {"role": "assistant", "content": _answer(rng, long=i % 11 == 5).strip()},
            ]
        if sharegpt:
            names = {"system": "system", "user": "human", "assistant": "gpt"}
            out.append(
                {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}
            )
        else:
            out.append({"messages": messages})
    return out


def io_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "segments": [
                {"text": BOS + "Q: " + _sentence(rng, 2, 8) + "\n", "label": False},
                {"text": "A: " + _sentence(rng, 3, 12) + EOS, "label": True},
            ]
        }
        for _ in range(n)
    ]


def completion_records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"text": " ".join(_sentence(rng, 4, 14) for _ in range(rng.choice([1, 2, 3, 8, 25])))}
        for _ in range(n)
    ]


def build_tokenizer(texts: list[str], vocab_size: int = 800):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
            ),
        ]
    )
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    out.chat_template = CHATML
    return out


def write_model_dir(path: Path, tokenizer) -> None:
    """The tokenizer and a tiny Llama config (no weights: preprocessing reads neither)."""
    from transformers import LlamaConfig

    tokenizer.save_pretrained(path)
    LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    ).save_pretrained(path)


DATA = {
    "alpaca": lambda: alpaca_records(48, 1),
    "chat": lambda: chat_records(40, 2),
    "sharegpt": lambda: chat_records(24, 3, sharegpt=True),
    "custom": lambda: custom_records(36, 4),
    "io": lambda: io_records(16, 5),
    "completion": lambda: completion_records(24, 6),
}


def cases() -> dict[str, dict]:
    """Every case: a config (Axolotl's keys) whose ``datasets[].path`` is relative to the inputs."""
    chat = {"path": "data/chat.jsonl", "type": "chat_template", "roles_to_train": ["assistant"]}
    custom_full = {
        "system_prompt": "You are terse.",
        "field_system": "system",
        "system_format": "<<SYS>>{system}<</SYS>>\n",
        "field_instruction": "instruction",
        "field_input": "input",
        "field_output": "output",
        "format": "[INST] {instruction}\n{input} [/INST]",
        "no_input_format": "[INST] {instruction} [/INST]",
    }
    custom_fields = {"field_instruction": "instruction", "field_input": "input", "field_output": "output"}

    def ds(**d):
        return {"datasets": [d]}

    out = {
        "alpaca": ds(path="data/alpaca.jsonl", type="alpaca"),
        "alpaca_seq128": {**ds(path="data/alpaca.jsonl", type="alpaca"), "sequence_len": 128},
        "alpaca_chat": ds(path="data/alpaca.jsonl", type="alpaca:chat"),
        "alpaca_chatml": ds(path="data/alpaca.jsonl", type="alpaca:chatml"),
        "alpaca_phi": ds(path="data/alpaca.jsonl", type="alpaca:phi"),
        "alpaca_train_on_inputs": {**ds(path="data/alpaca.jsonl", type="alpaca"), "train_on_inputs": True},
        "alpaca_packing": {**ds(path="data/alpaca.jsonl", type="alpaca"), "sample_packing": True},
        "chat_eos_turn": ds(**chat, train_on_eos="turn"),
        "chat_eos_turn_eot_set": {**ds(**chat, train_on_eos="turn"), "eot_tokens": ["<|im_end|>"]},
        "chat_eos_all_eot_set": {**ds(**chat, train_on_eos="all"), "eot_tokens": ["<|im_end|>"]},
        "chat_eos_last_eot_set": {**ds(**chat, train_on_eos="last"), "eot_tokens": ["<|im_end|>"]},
        "chat_eos_none_eot_set": {**ds(**chat, train_on_eos="none"), "eot_tokens": ["<|im_end|>"]},
        "chat_user_and_assistant": {
            **ds(**{**chat, "roles_to_train": ["user", "assistant"]}, train_on_eos="turn"),
            "eot_tokens": ["<|im_end|>"],
        },
        "chat_train_on_inputs": {**ds(**chat), "train_on_inputs": True},
        "chat_seq128": {**ds(**chat), "eot_tokens": ["<|im_end|>"], "sequence_len": 128},
        "sharegpt": {
            **ds(
                path="data/sharegpt.jsonl",
                type="chat_template",
                field_messages="conversations",
                message_property_mappings={"role": "from", "content": "value"},
                roles={"user": ["human"], "assistant": ["gpt"]},
            ),
            "eot_tokens": ["<|im_end|>"],
        },
        "custom_full": ds(path="data/custom.jsonl", type=custom_full),
        "custom_fields_only": ds(path="data/custom.jsonl", type=custom_fields),
        "input_output": ds(path="data/io.jsonl", type="input_output"),
        "completion": ds(path="data/completion.jsonl", type="completion"),
        "completion_packing": {**ds(path="data/completion.jsonl", type="completion"), "sample_packing": True},
    }
    base = {"sequence_len": 256, "chat_template": "tokenizer_default", "micro_batch_size": 1}
    return {name: {**base, **cfg} for name, cfg in out.items()}


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def write_inputs(root: Path) -> dict[str, dict]:
    root = Path(root)
    (root / "data").mkdir(parents=True, exist_ok=True)
    texts = []
    for name, make in DATA.items():
        records = make()
        (root / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        texts += list(_strings(records))
    texts += ["### Instruction:\n", "### Input:\n", "### Response:\n\n1. ", "USER: ", "ASSISTANT:- "] * 50
    write_model_dir(root / "model", build_tokenizer(texts))
    return cases()

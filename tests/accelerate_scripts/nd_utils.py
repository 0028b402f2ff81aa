"""Our own copy of the helpers of Accelerate's ``examples/torch_native_parallelism/utils.py``,
written to the same API (``get_dataset``, ``create_collate_fn``, ``setup_tokenizer``,
``get_model_flops_per_token``, ``PerformanceTracker``). Differences, for an offline CPU test: the
"tokenizer" only knows the vocabulary size, and the dataset is packed random tokens (seeded)
instead of TinyStories."""

import time
from contextlib import nullcontext

import torch
from datasets import Dataset
from transformers import AutoConfig

from ndparallel import Accelerator  # was: from accelerate import Accelerator


class _VocabOnlyTokenizer:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.pad_token = self.eos_token = 0


def setup_tokenizer(model_id: str):
    return _VocabOnlyTokenizer(AutoConfig.from_pretrained(model_id).vocab_size)


def get_dataset(
    tokenizer, seq_len: int, accelerator: Accelerator | None = None, num_docs: int = 64
) -> Dataset:
    """Packed sequences of ``seq_len`` tokens: input_ids, shift_labels (= labels) and position_ids."""
    processing_ctx = accelerator.main_process_first if accelerator else nullcontext
    g = torch.Generator().manual_seed(1234)
    with processing_ctx():
        docs = [
            torch.randint(1, tokenizer.vocab_size, (int(n),), generator=g).tolist()
            for n in torch.randint(seq_len // 2, 2 * seq_len, (num_docs,), generator=g)
        ]
        raw = Dataset.from_dict({"input_ids": docs})

    def create_packed_sequences(examples):
        tokens = [t for ids in examples["input_ids"] for t in ids]
        n = len(tokens) // (seq_len + 1)
        rows = [tokens[i * (seq_len + 1) : (i + 1) * (seq_len + 1)] for i in range(n)]
        return {
            "input_ids": [r[:-1] for r in rows],
            "shift_labels": [r[1:] for r in rows],
            "position_ids": [list(range(seq_len)) for _ in rows],
            "labels": [r[1:] for r in rows],
        }

    with processing_ctx():
        packed = raw.map(
            create_packed_sequences, batched=True, remove_columns=raw.column_names, batch_size=1000
        )
    return packed.shuffle(seed=42)


def get_model_flops_per_token(model, seq_len: int) -> float:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    mlp = 18 * cfg.hidden_size * cfg.intermediate_size
    attn = 12 * head_dim * (cfg.num_attention_heads + cfg.num_key_value_heads)
    attn_dot = 12 * cfg.num_attention_heads * head_dim * seq_len
    return (mlp + attn + attn_dot) * cfg.num_hidden_layers


def create_collate_fn():
    def collate_fn(batch):
        input_ids = torch.tensor([item["input_ids"] for item in batch], dtype=torch.long)
        shift_labels = torch.tensor([item["shift_labels"] for item in batch], dtype=torch.long)
        return {"input_ids": input_ids, "shift_labels": shift_labels, "labels": shift_labels}

    return collate_fn


class PerformanceTracker:
    def __init__(self, warmup_steps: int = 10):
        self.warmup_steps = warmup_steps
        self.start_time, self.num_tokens, self.is_in_warmup, self.step_count = None, 0, True, 0

    def step(self, batch_tokens: float, model_flops_per_token: float | None = None) -> dict:
        self.step_count += 1
        if self.step_count == self.warmup_steps:
            self.start_time, self.num_tokens, self.is_in_warmup = time.perf_counter(), 0, False
            return {"warmup_completed": True}
        if self.is_in_warmup or self.start_time is None:
            return {}
        self.num_tokens += batch_tokens
        total = time.perf_counter() - self.start_time
        out = {
            "tokens_per_second": self.num_tokens / total,
            "steps_per_second": (self.step_count - self.warmup_steps) / total,
        }
        if model_flops_per_token is not None:
            out["tflops_per_device"] = model_flops_per_token * self.num_tokens / (total * 1e12)
        return out

    def get_print_message(self, metrics: dict, with_memory: bool = False) -> str:
        return (
            f" | Average steps/s: {metrics['steps_per_second']:.2f} | Average tokens/s: "
            f"{metrics['tokens_per_second']:.2f} | Average TFLOPS: {metrics['tflops_per_device']:.2f}"
        )

"""Data pipeline: built-in corpus, tokenizer, dataset loading, packing, dp-sharded loading."""

from .corpus import BUILTIN_STDLIB, StdlibCorpus, stdlib_corpus, stdlib_dataset
from .dataset import (
    DatasetSpec,
    load_text_dataset,
    load_text_datasets,
    tokenize_dataset,
)
from .loader import PackedLoader, epoch_permutation, global_batch, make_batch
from .packing import IGNORE_INDEX, PackedSplits, build_blocks, pack_blocks, split_blocks
from .tokenizer import default_cache_dir, load_or_train_tokenizer, train_bpe

__all__ = [
    "BUILTIN_STDLIB",
    "IGNORE_INDEX",
    "DatasetSpec",
    "PackedLoader",
    "PackedSplits",
    "StdlibCorpus",
    "build_blocks",
    "default_cache_dir",
    "epoch_permutation",
    "global_batch",
    "load_or_train_tokenizer",
    "load_text_dataset",
    "load_text_datasets",
    "make_batch",
    "pack_blocks",
    "split_blocks",
    "stdlib_corpus",
    "stdlib_dataset",
    "tokenize_dataset",
    "train_bpe",
]

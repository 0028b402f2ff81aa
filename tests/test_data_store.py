"""The memory-mapped block store packs exactly what the in-memory packing does, splits without
copying, and feeds the loader the same batches."""

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch

from ndparallel.data import PackedLoader, pack_blocks, split_blocks
from ndparallel.data.store import BlockStore, pack_to_file


def _tokenized(n_docs=40, seed=0):
    g = np.random.default_rng(seed)
    docs = [g.integers(0, 500, size=g.integers(1, 30)).tolist() for _ in range(n_docs)]
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    return datasets.Dataset.from_dict({"input_ids": docs}, features=features)


@pytest.mark.parametrize("pad_tail", [False, True])
def test_store_equals_in_memory_packing(tmp_path, pad_tail):
    ds = _tokenized()
    memory = pack_blocks(ds, 7, pad_tail=pad_tail)
    store = pack_blocks(ds, 7, pad_tail=pad_tail, cache_dir=tmp_path)
    assert isinstance(store, BlockStore) and store.shape == memory.shape
    assert torch.equal(store[torch.arange(len(store))], memory)
    assert torch.equal(store[3], memory[3:4]) and torch.equal(store[2:5], memory[2:5])
    assert list((tmp_path / "packed").glob("*.npy")), "packed once into the cache"


def test_chunked_stream_is_packed_in_order(tmp_path):
    chunks = [
        pa.array([[1, 2, 3], [4]], type=pa.list_(pa.int32())),
        pa.array([[5, 6], [7, 8, 9, 10]], type=pa.list_(pa.int32())).slice(0, 2),
    ]
    path = pack_to_file(pa.chunked_array(chunks), 4, tmp_path / "x.npy", pad_tail=True, pad_value=-100)
    assert np.load(path).tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, -100, -100]]
    assert not list(tmp_path.glob(".x.npy.tmp*"))


def test_split_views_and_loader_match_tensors(tmp_path):
    ds = _tokenized(200)
    memory = pack_blocks(ds, 9)
    store = pack_blocks(ds, 9, cache_dir=tmp_path)
    (mt, mv), (st, sv) = split_blocks(memory, 0.2, seed=3), split_blocks(store, 0.2, seed=3)
    assert isinstance(st, BlockStore) and st.array is store.array, "a view, not a copy"
    assert torch.equal(sv[torch.arange(len(sv))], mv)
    a = PackedLoader(mt, 2, dp_rank=1, dp_size=2, seed=5)
    b = PackedLoader(st, 2, dp_rank=1, dp_size=2, seed=5)
    for i in range(len(a)):
        x, y = a.micro_batch(i), b.micro_batch(i)
        assert all(torch.equal(x[k], y[k]) for k in x)

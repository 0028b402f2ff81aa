"""Dataset specs -> text -> tokens (cached) -> packed blocks -> train/val split; and the error cases."""

import json

import datasets
import pytest
import torch

from ndparallel.data import (
    IGNORE_INDEX,
    build_blocks,
    load_or_train_tokenizer,
    load_text_dataset,
    load_text_datasets,
    pack_blocks,
    split_blocks,
    tokenize_dataset,
)

DOCS = ["first document\nwith two lines", "second one", "third: def f(): pass", "", "fifth"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_or_train_tokenizer(
        cache_dir=tmp_path_factory.mktemp("tok"), vocab_size=512, max_bytes=300_000
    )


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS[:3]):
        (tmp_path / "txt" / f"{i}.txt").write_text(d)
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"content": d, "id": i}) + "\n" for i, d in enumerate(DOCS))
    )
    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_dict({"text": DOCS[:2]}).to_csv(str(tmp_path / "d.csv"), index=False)
    return tmp_path


def test_local_formats(files):
    cache = files / "cache"
    txt = load_text_dataset({"path": str(files / "txt")}, cache)  # a directory, one document per file
    assert txt.column_names == ["text"] and txt["text"] == DOCS[:3]
    lines = load_text_dataset({"path": str(files / "txt" / "0.txt"), "sample_by": "line"}, cache)
    assert lines["text"] == DOCS[0].split("\n")
    jl = load_text_dataset({"path": str(files / "d.jsonl"), "text_field": "content"}, cache)
    assert jl.column_names == ["text"] and jl["text"] == DOCS
    pq = load_text_dataset({"path": str(files / "d.parquet"), "type": "completion"}, cache)
    assert pq["text"] == DOCS
    assert load_text_dataset({"path": str(files / "d.csv"), "type": "csv"}, cache)["text"] == DOCS[:2]
    assert (
        load_text_dataset({"path": str(files / "d.jsonl"), "field": "content", "type": "json"}, cache)["text"]
        == DOCS
    )
    both = load_text_datasets([str(files / "d.parquet"), {"path": "builtin:stdlib", "max_files": 2}], cache)
    assert len(both) == len(DOCS) + 2 and both["text"][: len(DOCS)] == DOCS


def test_tokenize_appends_eos_and_caches(files, tok):
    cache = files / "cache"
    text = load_text_dataset(str(files / "d.parquet"), cache)
    out = tokenize_dataset(text, tok, cache)
    assert len(out) == len([d for d in DOCS if d])  # empty documents dropped
    for ids, doc in zip(out["input_ids"], [d for d in DOCS if d]):
        assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == doc
    cached = list((cache / "tokenized").glob("*.arrow"))
    assert len(cached) == 1 and out.cache_files[0]["filename"] == str(cached[0])
    mtime = cached[0].stat().st_mtime_ns
    again = tokenize_dataset(load_text_dataset(str(files / "d.parquet"), cache), tok, cache)
    assert again["input_ids"] == out["input_ids"] and cached[0].stat().st_mtime_ns == mtime  # reused


def test_pack_shapes_and_tail():
    tokenized = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 0], [4, 5, 0], [6, 7, 8, 9, 0]]})
    flat = [1, 2, 3, 0, 4, 5, 0, 6, 7, 8, 9, 0]
    blocks = pack_blocks(tokenized, 5)
    assert blocks.dtype == torch.int32 and blocks.shape == (2, 5)
    assert blocks.flatten().tolist() == flat[:10]  # ragged tail (2 tokens) dropped
    padded = pack_blocks(tokenized, 5, pad_tail=True)
    assert padded.shape == (3, 5) and padded[2].tolist() == [9, 0] + [IGNORE_INDEX] * 3
    with pytest.raises(ValueError, match="too small.*12 tokens.*13"):
        pack_blocks(tokenized, 13)


def test_split_deterministic():
    blocks = torch.arange(100 * 3).view(100, 3)
    train, val = split_blocks(blocks, 0.1, seed=1)
    assert val.shape[0] == 10 and train.shape[0] == 90
    assert sorted(torch.cat([train, val])[:, 0].tolist()) == blocks[:, 0].tolist()
    assert torch.equal(split_blocks(blocks, 0.1, seed=1)[1], val)
    assert not torch.equal(split_blocks(blocks, 0.1, seed=2)[1], val)
    assert split_blocks(blocks, 7)[1].shape[0] == 7 and split_blocks(blocks, 0)[1] is None
    assert split_blocks(blocks, 0.001)[1].shape[0] == 1  # a fraction rounds up
    for bad in (100, -1, 2.5, "x"):
        with pytest.raises(ValueError, match="val_set_size"):
            split_blocks(blocks, bad)


def test_build_blocks_builtin(tmp_path, tok):
    spec = [{"path": "builtin:stdlib", "max_files": 10}]
    s = build_blocks(spec, tok, sequence_len=32, val_set_size=0.05, seed=0, cache_dir=tmp_path)
    assert s.train.shape[1] == 33 and s.val.shape[1] == 33 and s.val.shape[0] >= 1
    train, val = s.train[torch.arange(len(s.train))], s.val[torch.arange(len(s.val))]
    assert int(train.min()) >= 0 and int(train.max()) < len(tok)
    again = build_blocks(spec, tok, sequence_len=32, val_set_size=0.05, seed=0, cache_dir=tmp_path)
    assert torch.equal(again.train[torch.arange(len(train))], train)
    assert torch.equal(again.val[torch.arange(len(val))], val)


def test_errors(files, tok):
    cache = files / "cache"
    with pytest.raises(ValueError, match=r"datasets\[1\]\.path: .*missing\.jsonl.* does not exist"):
        load_text_datasets([str(files / "d.parquet"), {"path": str(files / "missing.jsonl")}], cache)
    with pytest.raises(ValueError, match=r"does not exist"):
        load_text_dataset("./nowhere/data", cache)
    with pytest.raises(ValueError, match=r"\.type: unknown type 'sharegpt'.*completion"):
        load_text_dataset({"path": str(files / "d.jsonl"), "type": "sharegpt"}, cache)
    with pytest.raises(ValueError, match=r"text_field: column 'text'.*\['content', 'id'\]"):
        load_text_dataset({"path": str(files / "d.jsonl")}, cache)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['txt_field'\]"):
        load_text_dataset({"path": str(files / "d.jsonl"), "txt_field": "content"}, cache)
    (files / "data.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="cannot infer the format"):
        load_text_dataset(str(files / "data.bin"), cache)
    (files / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_text_dataset(str(files / "empty"), cache)
    (files / "txt" / "x.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"mixes formats \['json', 'text'\]"):
        load_text_dataset(str(files / "txt"), cache)
    with pytest.raises(ValueError, match="list is empty"):
        load_text_datasets([], cache)
    with pytest.raises(ValueError, match="too small"):
        build_blocks([str(files / "d.csv")], tok, sequence_len=4096, cache_dir=cache)

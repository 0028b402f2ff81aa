"""Axolotl's data-order switches: ``dataset_exact_deduplication`` (samples whose tokens and labels
repeat an earlier one's are dropped), ``sample_packing_sequentially`` (rows filled by next fit in
dataset order), ``curriculum_sampling`` (no shuffle) and ``shuffle_merged_datasets`` (Axolotl's
merged order): what each does to the rows, and the combinations refused before launch."""

import numpy as np
import pytest
import torch

from cli_helpers import forbid_launch, run_cli
from ndparallel.data.bins import first_fit_decreasing, next_fit
from ndparallel.data.dataset import DatasetSpec
from ndparallel.data.prepare import DataOptions, build_rows, prepare_samples
from sft_fixtures import alpaca_records, llama3_tokenizer, write_jsonl

IGNORE = -100


@pytest.fixture(scope="module")
def tok():
    return llama3_tokenizer()


def _samples(prepared) -> list[list[int]]:
    return [prepared.sample(k)[0].tolist() for k in range(len(prepared))]


def test_next_fit_fills_rows_in_order():
    lengths = np.array([5, 4, 3, 7, 1, 1, 8, 2])
    row_of = next_fit(lengths, 10)
    assert row_of.tolist() == [0, 0, 1, 1, 2, 2, 2, 3]  # a row closes when the next sample does not fit
    assert first_fit_decreasing(lengths, 10).tolist() != row_of.tolist()  # control: FFD reorders
    with pytest.raises(ValueError, match=r"in \[1, 10\]"):
        next_fit(np.array([11]), 10)


def test_exact_duplicates_are_dropped_first_kept(tok, tmp_path):
    records = alpaca_records(12)
    twin = dict(records[4], output=records[4]["output"] + " Different.")  # same prompt, other answer: kept
    data = write_jsonl(tmp_path / "a.jsonl", records + [records[3], records[7], twin, records[3]])
    spec = [DatasetSpec.from_any({"path": str(data), "type": "alpaca"})]
    everything = prepare_samples(spec, tok, DataOptions(sequence_len=256))
    unique = prepare_samples(spec, tok, DataOptions(sequence_len=256, deduplicate=True))
    assert len(everything) == 16 and len(unique) == 13 and unique.stats.dropped_duplicates == 3
    assert _samples(unique) == _samples(everything)[:12] + [_samples(everything)[14]]
    first = build_rows(spec, tok, DataOptions(sequence_len=256), tmp_path / "cache")
    deduplicated = build_rows(spec, tok, DataOptions(sequence_len=256, deduplicate=True), tmp_path / "cache")
    assert (len(first), len(deduplicated)) == (16, 13)  # a cache key of its own


def test_sequential_packing_keeps_the_data_order(tok, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(40))
    spec = [DatasetSpec.from_any({"path": str(data), "type": "alpaca"})]
    order = _samples(prepare_samples(spec, tok, DataOptions(sequence_len=256)))
    found = {}
    for sequential in (True, False):
        store = build_rows(
            spec,
            tok,
            DataOptions(sequence_len=256, sample_packing=True, sequential_packing=sequential),
            tmp_path / "cache",
        )
        batch = store[torch.arange(len(store))]
        pieces = []
        for r in range(len(store)):
            length = int(store.lengths(r)[0])
            pos = batch["position_ids"][r, :length]
            starts = [0] + [i for i in range(1, length) if int(pos[i]) == 0]
            pieces += [batch["input_ids"][r, a:b].tolist() for a, b in zip(starts, [*starts[1:], length])]
        found[sequential] = pieces
    assert found[True] == order  # every sample once, in the data's order
    assert found[False] != order and sorted(found[False]) == sorted(order)  # control: FFD reorders


def _cfg(tmp_path, extra: str) -> str:
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(8))
    path = tmp_path / "c.yaml"
    path.write_text(
        f"base_model: tiny-llama\ntokenizer_vocab_size: 512\nsequence_len: 64\noutput_dir: {tmp_path}/o\n"
        f"datasets: [{{path: {data}, type: alpaca}}]\n" + extra
    )
    return str(path)


def test_curriculum_sampling_turns_the_shuffle_off(tmp_path, capsys, monkeypatch):
    from ndparallel.axolotl import load_config
    from ndparallel.training.components import train_loader

    forbid_launch(monkeypatch)
    cfg = load_config(_cfg(tmp_path, "curriculum_sampling: true\n"))
    rows = torch.arange(12 * 65, dtype=torch.int32).view(12, 65)
    splits = type("S", (), {"train": rows})()
    ordered = train_loader(cfg, splits, None, 0, 1, None)
    assert [int(ordered.micro_batch(i)["input_ids"][0, 0]) for i in range(12)] == [65 * i for i in range(12)]
    shuffled = train_loader(load_config(_cfg(tmp_path, "")), splits, None, 0, 1, None)
    assert [int(shuffled.micro_batch(i)["input_ids"][0, 0]) for i in range(12)] != [65 * i for i in range(12)]
    code, out, err = run_cli(
        capsys,
        "train",
        _cfg(
            tmp_path,
            "curriculum_sampling: true\nsample_packing: true\n"
            "sample_packing_sequentially: true\ndataset_exact_deduplication: true\n",
        ),
        "--dry-run",
    )
    assert code == 0, err
    assert "packed several per row in dataset order" in out and "exact duplicates dropped" in out
    assert "rows in dataset order (curriculum_sampling)" in out


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (
            "dataset_exact_deduplication: true\npretraining_dataset: [{path: x.txt}]\nmax_steps: "
            "3\ndatasets:\n",
            "dataset_exact_deduplication: true with a streamed pretraining_dataset",
        ),
        (
            "sample_packing_sequentially: true\n",
            "sample_packing_sequentially: true without sample_packing: true",
        ),
        ("sample_packing_order: multipack\n", "sample_packing_order: multipack without sample_packing: true"),
        (
            "sample_packing_order: multipack\nsample_packing: true\nsample_packing_boundary_targets: true\n",
            "sample_packing_order: multipack and sample_packing_boundary_targets: true are not offered",
        ),
        (
            "sample_packing_order: multipack\nsample_packing: true\nmicro_batch_size: 2\n"
            "attn_implementation: flash_attention_2\n",
            "multipack with attn_implementation: flash_attention_2 and micro_batch_size: 2",
        ),
    ],
)
def test_data_order_switches_refused_where_they_cannot_apply(tmp_path, capsys, monkeypatch, extra, fragment):
    forbid_launch(monkeypatch)
    code, _, err = run_cli(capsys, "train", _cfg(tmp_path, extra), "--dry-run")
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_merged_order_is_datasets_shuffle_of_the_concatenation(tok, tmp_path):
    """``shuffle_merged_datasets`` (Axolotl's default): the samples in the order ``datasets`` itself
    gives the concatenated datasets shuffled by seed (what Axolotl's ``merge_datasets`` does), the
    samples too long dropped afterwards; the rows the loader draws follow that order."""
    import datasets

    a, b = alpaca_records(14), alpaca_records(9)
    b = [dict(r, instruction=r["instruction"] + " (b)") for r in b]
    b[2]["output"] = " ".join(["long"] * 300)  # dropped: longer than sequence_len
    specs = [
        DatasetSpec(path=str(write_jsonl(tmp_path / "a.jsonl", a)), type="alpaca"),
        DatasetSpec(path=str(write_jsonl(tmp_path / "b.jsonl", b)), type="alpaca"),
    ]
    plain = prepare_samples(specs, tok, DataOptions(sequence_len=256))
    merged = prepare_samples(specs, tok, DataOptions(sequence_len=256, shuffle_merged=True, seed=7))
    order = datasets.Dataset.from_list([{"k": i} for i in range(len(a) + len(b))]).shuffle(seed=7)["k"]
    kept = [i for i in order if i != len(a) + 2]
    by_record = {int(t) * len(a) + int(r): k for k, (t, r, _, _) in enumerate(plain.samples)}
    assert _samples(merged) == [_samples(plain)[by_record[i]] for i in kept]
    assert _samples(merged) != _samples(plain)  # control: the shuffle moved them


def test_multipack_said_in_the_dry_run(tmp_path, capsys, monkeypatch):
    forbid_launch(monkeypatch)
    packed = "sample_packing: true\nmicro_batch_size: 1\n"
    code, out, err = run_cli(
        capsys, "train", _cfg(tmp_path, packed + "sample_packing_order: multipack\n"), "--dry-run"
    )
    assert code == 0, err
    assert "packed several per row each epoch (first fit in the draw's order: Axolotl's multipack)" in out
    code, out, err = run_cli(
        capsys, "train", _cfg(tmp_path, packed + "sample_packing_bin_size: 8\n"), "--dry-run"
    )
    assert code == 0, err
    assert "sample_packing_bin_size: applies with sample_packing_order: multipack" in out

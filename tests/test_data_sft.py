"""Fine-tuning data: alpaca / chat-template / input_output samples with exactly the prompt masked,
sample packing (first-fit-decreasing, position_ids restarting, boundary labels -100), one sample
per row, padding that cannot reach real tokens, the caches, and the data errors."""

import json

import numpy as np
import pytest
import torch

from ndparallel.data import PackedLoader
from ndparallel.data.bins import first_fit_decreasing
from ndparallel.data.chat import ChatRenderer, resolve_template
from ndparallel.data.dataset import DatasetSpec
from ndparallel.data.encode import encode
from ndparallel.data.prepare import (
    DataOptions,
    build_data,
    build_rows,
    prepare_samples,
)
from ndparallel.data.prompts import ALPACA_NO_INPUT, ALPACA_WITH_INPUT, alpaca, render
from ndparallel.data.widths import bucket_widths, cut_width
from sft_fixtures import alpaca_records, chat_records, llama3_tokenizer, write_jsonl

IGNORE = -100


@pytest.fixture(scope="module")
def tok():
    return llama3_tokenizer()


def _trained_runs(ids, labels):
    """Maximal runs of trained positions, as token lists."""
    runs, cur = [], []
    for i, lab in zip(ids, labels):
        if lab == IGNORE:
            if cur:
                runs.append(cur)
            cur = []
        else:
            assert lab == i
            cur.append(i)
    return runs + ([cur] if cur else [])


# ------------------------------------------------------------------------------ masking
def test_alpaca_masks_exactly_the_prompt(tok):
    for record in alpaca_records(12):
        ids, labels = encode(tok, alpaca(record, "t"))
        template = ALPACA_WITH_INPUT if record["input"] else ALPACA_NO_INPUT
        prompt = template.format(**record)
        n_prompt = len(tok(prompt)["input_ids"])  # with the tokenizer's BOS
        assert labels[:n_prompt] == [IGNORE] * n_prompt  # the whole prompt is masked ...
        assert labels[n_prompt:] == ids[n_prompt:]  # ... and nothing else
        assert tok.decode(ids[:n_prompt]) == "<|begin_of_text|>" + prompt
        assert tok.decode(ids[n_prompt:]) == record["output"] + "<|end_of_text|>"  # the answer + eos, trained


def test_train_on_inputs_trains_every_token(tok):
    ids, labels = encode(tok, alpaca(alpaca_records(1)[0], "t"), train_on_inputs=True)
    assert labels == ids


def _chat(tok, record, eot=("<|eot_id|>",), **spec_kw):
    """Llama 3's template under a base model's eos: the turn token is given as eot_tokens (unset,
    only the eos ends a turn, as in Axolotl: test_chat_eot_tokens)."""
    spec = DatasetSpec(path="x", type="chat_template", **spec_kw)
    template = resolve_template(tok, spec.chat_template, None, "t")
    return encode(tok, render(record, spec, "t", ChatRenderer(tok, template, spec, eot)))


def test_chat_template_trains_exactly_the_assistant_turns(tok):
    for record in chat_records(8):
        ids, labels = _chat(tok, record)
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        runs = [tok.decode(r) for r in _trained_runs(ids, labels)]
        assert runs == [a + "<|eot_id|>" for a in answers]  # content + end-of-turn, headers masked
        masked = tok.decode([i for i, lab in zip(ids, labels) if lab == IGNORE])
        for m in record["messages"]:
            if m["role"] != "assistant":
                assert m["content"] in masked


@pytest.mark.parametrize(
    "train_on_eos, eot_trained", [("none", [False] * 3), ("all", [True] * 6), ("last", [False, False, True])]
)
def test_chat_train_on_eos(tok, train_on_eos, eot_trained):
    record = {
        "messages": [{"role": r, "content": f"{r} {i}"} for i in range(3) for r in ("user", "assistant")]
    }
    ids, labels = _chat(tok, record, train_on_eos=train_on_eos)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    got = [lab == eot for i, lab in zip(ids, labels) if i == eot]
    expect = (
        eot_trained if train_on_eos == "all" else [x for pair in zip([False] * 3, eot_trained) for x in pair]
    )
    assert got == expect


@pytest.mark.parametrize(
    "train_on_eos, train_on_eot, eot_trained",
    [
        ("none", "turn", [False, True] * 3),
        ("turn", "none", [False] * 6),
        ("none", "last", [False] * 5 + [True]),
    ],
)
def test_chat_train_on_eot_governs_turn_tokens_that_are_not_the_eos(
    tok, train_on_eos, train_on_eot, eot_trained
):
    """Llama 3's turns end with <|eot_id|>, its eos is <|end_of_text|>: train_on_eot decides."""
    record = {
        "messages": [{"role": r, "content": f"{r} {i}"} for i in range(3) for r in ("user", "assistant")]
    }
    ids, labels = _chat(tok, record, train_on_eos=train_on_eos, train_on_eot=train_on_eot)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert [lab == eot for i, lab in zip(ids, labels) if i == eot] == eot_trained


def test_chat_eot_tokens(tok):
    """eot_tokens unset: the turn end is the eos (<|end_of_text|>), which Llama 3's template does not
    use, so no turn end is trained, as in Axolotl, and eot_warning says so with the fix; set, the
    <|eot_id|> of trained turns is trained."""
    from ndparallel.data.chat import eot_warning

    record = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yo."}]}
    spec = DatasetSpec(path="x", type="chat_template")
    template = resolve_template(tok, None, None, "t")
    default = encode(tok, render(record, spec, "t", ChatRenderer(tok, template, spec)))
    explicit = encode(tok, render(record, spec, "t", ChatRenderer(tok, template, spec, ("<|eot_id|>",))))
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert default[0] == explicit[0]
    assert [lab == eot for i, lab in zip(*default) if i == eot] == [False, False]
    assert [lab == eot for i, lab in zip(*explicit) if i == eot] == [False, True]
    warning = eot_warning(template, tok.eos_token, None, "datasets[0]")
    assert "no turn end is trained" in warning and "set eot_tokens: [<|eot_id|>]" in warning
    assert eot_warning(template, tok.eos_token, ("<|eot_id|>",), "datasets[0]") is None
    with pytest.raises(ValueError, match=r"eot_tokens: '<\|im_end\|>' is not a token of the tokenizer"):
        ChatRenderer(tok, template, spec, ("<|im_end|>",))


def test_chat_roles_to_train_and_sharegpt_with_chatml(tok):
    record = {"conversations": [{"from": "human", "value": "Hi there."}, {"from": "gpt", "value": "Hello."}]}
    ids, labels = _chat(tok, record, eot=None, chat_template="chatml", roles_to_train=("user", "assistant"))
    runs = [tok.decode(r) for r in _trained_runs(ids, labels)]
    # <|im_end|> is not one token of this tokenizer and the eos is not in ChatML: no turn end trained
    assert runs == ["Hi there.", "Hello."]
    assert tok.decode(ids).startswith("<|im_start|>user\nHi there.")


def test_jeopardy_is_alpaca_with_the_clue_and_category_and_a_what_is_answer():
    spec = DatasetSpec.from_any({"path": "x.jsonl", "type": "jeopardy"})
    record = {"question": "This river flows through Cairo", "category": "RIVERS", "answer": "the Nile"}
    expected = render(
        {"instruction": record["question"], "input": "RIVERS", "output": "what is the Nile"},
        DatasetSpec.from_any({"path": "x.jsonl", "type": "alpaca"}),
        "row 0",
    )
    assert render(record, spec, "row 0").segments == expected.segments
    assert expected.segments[-1] == ("what is the Nile", True)
    with pytest.raises(ValueError, match="column 'question' is missing"):
        render({"category": "RIVERS", "answer": "x"}, spec, "row 0")


def test_input_output_segments(tok):
    record = {
        "segments": [
            {"text": "<|begin_of_text|>Q: two plus two?\n", "label": False},
            {"text": "A: four.<|end_of_text|>", "label": True},
        ]
    }
    ids, labels = encode(tok, render(record, DatasetSpec(path="x", type="input_output"), "t"))
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # used as written
    assert [tok.decode(r) for r in _trained_runs(ids, labels)] == ["A: four.<|end_of_text|>"]


def test_bad_records_name_the_row(tok, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", [*alpaca_records(3), {"instruction": "x", "output": None}])
    with pytest.raises(ValueError, match=r"datasets\[0\] row 3: column 'output' is missing or null"):
        _prepare(tok, [{"path": str(data), "type": "alpaca"}])
    bad_chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"row 0: messages\[0\] needs a text 'role' and 'content'"):
        _prepare(tok, [{"path": str(bad_chat), "type": "chat_template"}])
    with pytest.raises(ValueError, match=r"needs column 'instruction'"):
        _prepare(tok, [{"path": str(bad_chat), "type": "alpaca"}])


# ---------------------------------------------------------------------------- packing
def _prepare(tok, specs, cache=None, **kw):
    opts = DataOptions(**{"sequence_len": 64, **kw})
    return prepare_samples([DatasetSpec.from_any(s) for s in specs], tok, opts, cache)


def test_ffd_is_first_fit_decreasing_and_deterministic():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=300)
    row_of = first_fit_decreasing(lengths, 64)
    assert np.array_equal(row_of, first_fit_decreasing(lengths.copy(), 64))
    rows = [np.nonzero(row_of == r)[0].tolist() for r in range(int(row_of.max()) + 1)]
    assert all(rows) and sorted(k for r in rows for k in r) == list(range(300))  # each sample once
    free = [64 - sum(int(lengths[k]) for k in r) for r in rows]
    assert min(free) >= 0
    order = sorted(range(300), key=lambda k: (-lengths[k], k))  # replay first fit on that order
    placed = dict(enumerate(row_of.tolist()))
    room = []
    for k in order:
        first = next((i for i, f in enumerate(room) if f >= lengths[k]), len(room))
        if first == len(room):
            room.append(64)
        room[first] -= lengths[k]
        assert placed[k] == first
    assert len(rows) <= -(-int(lengths.sum()) // 64) * 11 // 9 + 1


def _samples_of_row(batch, r, length):
    """(input_ids, shift_labels) of each sample of row r, cut at position_ids restarts."""
    pos = batch["position_ids"][r, :length]
    starts = [0] + [i for i in range(1, length) if int(pos[i]) == 0]
    return [
        (batch["input_ids"][r, a:b].tolist(), batch["shift_labels"][r, a:b].tolist())
        for a, b in zip(starts, [*starts[1:], length])
    ]


@pytest.mark.parametrize("packing", [True, False])
def test_rows_hold_each_sample_once_with_restarts_and_boundary_labels(tok, tmp_path, packing):
    S = 512
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(40))
    specs = [{"path": str(data), "type": "alpaca"}]
    prepared = _prepare(tok, specs, sequence_len=S)
    store = build_rows(
        [DatasetSpec.from_any(s) for s in specs],
        tok,
        DataOptions(sequence_len=S, sample_packing=packing),
        tmp_path / "cache",
    )
    batch = store[torch.arange(len(store))]
    found = []
    for r in range(len(store)):
        length = int(store.lengths(r)[0])
        pieces = _samples_of_row(batch, r, length)
        assert packing or len(pieces) == 1
        found += pieces
        assert (batch["shift_labels"][r, length:] == IGNORE).all()  # padding: never a label
        assert (
            batch["position_ids"][r, length:]
            == torch.arange(length, S)[: S - length] - length + batch["position_ids"][r, length - 1] + 1
        ).all()  # continues, no restart
    expected = []
    for k in range(len(prepared)):
        ids, labels = prepared.sample(k)
        expected.append((ids.tolist(), [*labels[1:].tolist(), IGNORE]))  # shifted; boundary -100
    assert sorted(found) == sorted(expected)
    assert len(store) < len(prepared) / 2 if packing else len(store) == len(prepared)


def test_lengths_truncate_drop_split_and_untrained(tok, tmp_path):
    long = {"instruction": "word " * 300, "input": "", "output": "ok."}
    data = write_jsonl(tmp_path / "a.jsonl", [*alpaca_records(3), long])
    spec = {"path": str(data), "type": "alpaca"}
    # cut inside the prompt: no trained token left
    truncated = _prepare(tok, [spec], sequence_len=256, excess_length_strategy="truncate")
    assert truncated.stats.truncated == 1 and truncated.stats.dropped_untrained == 1 and len(truncated) == 3
    dropped = _prepare(tok, [spec], sequence_len=256)  # Axolotl's default: drop
    assert dropped.stats.dropped_too_long == 1 and dropped.stats.dropped_untrained == 0 and len(dropped) == 3
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "word " * 150}])
    split = _prepare(tok, [{"path": str(text), "type": "completion"}])
    assert len(split) == split.stats.pieces_from_split + 1 > 1  # raw text is cut, not lost
    assert sum(len(split.sample(k)[0]) for k in range(len(split))) == len(tok("word " * 150)["input_ids"]) + 1
    with pytest.raises(ValueError, match="no sample left.*1 longer than sequence_len=256 dropped"):
        _prepare(
            tok,
            [{"path": str(write_jsonl(tmp_path / "l.jsonl", [long])), "type": "alpaca"}],
            sequence_len=256,
            excess_length_strategy="drop",
        )


def test_unset_packing_concatenates_raw_text_only(tok, tmp_path):
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "word " * 40}] * 20)
    blocks = build_data([str(text)], tok, DataOptions(sequence_len=32)).train
    assert isinstance(blocks, torch.Tensor) and blocks.shape[1] == 33  # concatenated blocks, as before
    rows = build_data([str(text)], tok, DataOptions(sequence_len=32, sample_packing=True)).train
    assert rows[0]["position_ids"].shape == (1, 32)


def test_rows_are_cached(tok, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(10))
    specs = [DatasetSpec(path=str(data), type="alpaca")]
    opts = DataOptions(sequence_len=512, sample_packing=True)
    first = build_rows(specs, tok, opts, tmp_path / "cache")
    (meta,) = (tmp_path / "cache" / "rows").glob("*/meta.json")
    stamp = meta.stat().st_mtime_ns
    again = build_rows(specs, tok, opts, tmp_path / "cache")
    assert meta.stat().st_mtime_ns == stamp and torch.equal(first[0]["input_ids"], again[0]["input_ids"])
    assert json.loads(meta.read_text())["samples"] == 10
    assert all(isinstance(a, np.memmap) for a in again.columns.values())  # mapped, never read whole


def test_validation_split_of_rows(tok, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(30))
    splits = build_data(
        [{"path": str(data), "type": "alpaca"}],
        tok,
        DataOptions(sequence_len=256, val_set_size=0.2, seed=1),
        tmp_path / "cache",
    )
    assert len(splits.val) == 6 and len(splits.train) == 24
    assert not set(splits.train.rows.tolist()) & set(splits.val.rows.tolist())
    assert PackedLoader(splits.val, 2, shuffle=False).micro_batch(0)["input_ids"].shape == (2, 256)


def test_loader_cuts_padding_to_a_multiple(tok, tmp_path):
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(16))
    rows = build_data([{"path": str(data), "type": "alpaca"}], tok, DataOptions(sequence_len=256)).train
    fixed = PackedLoader(rows, 4, shuffle=False).micro_batch(0)
    cut = PackedLoader(rows, 4, shuffle=False, pad_to_multiple=8).micro_batch(0)
    width = cut["input_ids"].shape[1]
    longest = int(rows.lengths(np.arange(4)).max())
    assert width % 8 == 0 and longest <= width < longest + 8 and fixed["input_ids"].shape[1] == 256
    for k in cut:
        assert torch.equal(cut[k], fixed[k][:, :width])
    assert (fixed["shift_labels"][:, width:] == IGNORE).all()


def test_widths_rounded_bucketed_and_counted(tok, tmp_path):
    """Each dp rank cuts its own rows' width (rounded to the multiple, or to the next bucket);
    ``token_counts`` gives the real tokens (the rows' lengths) and the computed ones (every rank's
    rows × its width) of the global micro-batch without reading a token."""
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(16))
    rows = build_data([{"path": str(data), "type": "alpaca"}], tok, DataOptions(sequence_len=256)).train
    buckets = bucket_widths(256, 8)
    assert buckets == (16, 32, 64, 128, 256) and bucket_widths(100, 24) == (24, 48, 72, 100)
    assert (
        cut_width(1, 256, 8) == 8 and cut_width(33, 256, 8, buckets) == 64 and cut_width(250, 252, 8) == 252
    )
    for bucketed in (None, buckets):
        ranks = [
            PackedLoader(rows, 2, dp_rank=r, dp_size=2, seed=3, pad_to_multiple=8, buckets=bucketed)
            for r in (0, 1)
        ]
        for index in range(3):
            batches = [ld.micro_batch(index) for ld in ranks]
            idx = ranks[0]._global_rows(index)
            lengths = [rows.lengths(i) for i in idx]
            widths = [b["input_ids"].shape[1] for b in batches]
            assert widths == [cut_width(int(n.max()), 256, 8, bucketed) for n in lengths]
            real = sum(
                int((b["position_ids"] - torch.arange(b["position_ids"].shape[1]) == 0).all(1).sum())
                for b in batches
            )
            assert real == 4  # one sample per row, positions 0.. throughout
            assert ranks[1].token_counts(index) == (sum(int(n.sum()) for n in lengths), 2 * sum(widths))
    assert len(
        {
            w
            for i in range(6)
            for w in [
                PackedLoader(rows, 1, pad_to_multiple=8, buckets=buckets).micro_batch(i)["input_ids"].shape[1]
            ]
        }
    ) <= len(buckets)


def test_padding_cannot_reach_real_tokens(tok, tmp_path):
    """Right padding under causal attention: changing the padding tokens changes no real token's
    logits (negative control: changing a real token does)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(4))
    rows = build_data([{"path": str(data), "type": "alpaca"}], tok, DataOptions(sequence_len=256)).train
    batch = rows[torch.arange(4)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_cache=False,
        )
    ).eval()

    def logits(ids):
        with torch.no_grad():
            return model(input_ids=ids, position_ids=batch["position_ids"]).logits

    real = torch.arange(256)[None, :] < torch.as_tensor(rows.lengths(np.arange(4)))[:, None]
    base = logits(batch["input_ids"])
    noisy = torch.where(real, batch["input_ids"], torch.randint_like(batch["input_ids"], len(tok)))
    assert torch.equal(logits(noisy)[real], base[real])
    changed = batch["input_ids"].clone()
    changed[:, 3] = (changed[:, 3] + 1) % len(tok)
    assert not torch.allclose(logits(changed)[real], base[real])


# ------------------------------------------------------------------ custom instruction formats
MISTRAL_LIKE = {
    "system_prompt": "Be brief.",
    "system_format": "<<SYS>>{system}<</SYS>>\n",
    "field_instruction": "instruction",
    "field_input": "input",
    "field_output": "output",
    "format": "[INST] {instruction}\n{input} [/INST]\n",
    "no_input_format": "[INST] {instruction} [/INST]\n",
}


def test_custom_format_masks_exactly_the_prompt(tok):
    spec = DatasetSpec.from_any({"path": "x", "type": MISTRAL_LIKE})
    assert spec.type == "user_defined" and spec.format.no_input_format == MISTRAL_LIKE["no_input_format"]
    for record in alpaca_records(12):
        ids, labels = encode(tok, render(record, spec, "t"))
        turn = (
            MISTRAL_LIKE["format"].format(**record)
            if record["input"]
            else MISTRAL_LIKE["no_input_format"].format(instruction=record["instruction"])
        )
        prompt = "<<SYS>>Be brief.<</SYS>>\n" + turn
        n_prompt = len(tok(prompt)["input_ids"])
        assert labels[:n_prompt] == [IGNORE] * n_prompt and labels[n_prompt:] == ids[n_prompt:]
        assert tok.decode(ids[:n_prompt]) == "<|begin_of_text|>" + prompt
        assert tok.decode(ids[n_prompt:]) == record["output"] + "<|end_of_text|>"


def test_custom_format_system_column_and_defaults(tok):
    fmt = {"format": "Q: {instruction} {input}\nA: ", "field_system": "sys", "field_output": "answer"}
    spec = DatasetSpec.from_any({"path": "x", "type": fmt})
    with_system = render({"instruction": "hi", "sys": "S. ", "answer": "yo"}, spec, "t")
    # system_format '{system}'; no input and no no_input_format: Axolotl's default "{instruction} "
    assert with_system.segments == [("S. hi ", False), ("yo", True)]
    no_system = render({"instruction": "hi", "input": "there", "answer": "yo"}, spec, "t")
    assert no_system.segments == [("Q: hi there\nA: ", False), ("yo", True)]
    spaces = render({"instruction": "hi", "input": " ", "answer": "yo"}, spec, "t")
    assert spaces.segments == [
        ("Q: hi  \nA: ", False),
        ("yo", True),
    ]  # spaces are an input (Axolotl's `if input`)
    fields_only = DatasetSpec.from_any({"path": "x", "type": {"field_instruction": "q"}})
    axolotl_defaults = render(
        {"q": "hi", "input": "there", "output": "yo", "system": "S: "}, fields_only, "t"
    )
    assert axolotl_defaults.segments == [("S: hi there ", False), ("yo", True)]
    with pytest.raises(ValueError, match="t: column 'answer' is missing or null"):
        render({"instruction": "hi"}, spec, "t")


@pytest.mark.parametrize(
    "fmt, fragment",
    [
        ({"format": "{instruction} {question}"}, "type.format: placeholder(s) ['question'] are not filled"),
        (
            {"format": "{instruction}", "no_input_format": "{instruction} {input}"},
            "type.no_input_format: placeholder(s) ['input'] are not filled",
        ),
        ({"format": "{instruction", "field_output": "a"}, "type.format: "),
        ({"format": "{instruction}", "feld_output": "a"}, "unknown key(s) ['feld_output']"),
    ],
)
def test_bad_custom_format_is_one_line_before_launch(tmp_path, fmt, fragment):
    from ndparallel.axolotl import ConfigError, load_config

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"base_model": "tiny-llama", "datasets": [{"path": "d.jsonl", "type": fmt}]}))
    with pytest.raises(ConfigError) as info:
        load_config(str(cfg))
    assert fragment in str(info.value) and "datasets.0.type" in str(info.value), str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_eot_settings_flow_from_the_config():
    from ndparallel.axolotl import load_config

    cfg = load_config(
        None,
        ["eot_tokens=['<|eot_id|>']", "datasets=[{path: x.jsonl, type: chat_template, train_on_eot: all}]"],
    )
    assert cfg.data_options().eot_tokens == ("<|eot_id|>",)
    assert DatasetSpec.from_any(cfg.datasets[0].model_dump()).train_on_eot == "all"

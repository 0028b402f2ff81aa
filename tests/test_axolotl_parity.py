"""ndparallel's training examples against Axolotl 0.19.0's own, example by example.

``tests/fixtures/axolotl/parity/`` holds what ``bench/peers/axolotl.py`` recorded by running Axolotl
itself (``axolotl preprocess``'s steps) on each case of ``cases.json``, with the local tokenizer
(``model/``) and data (``data/``) there. Here the same configs go through ndparallel's data pipeline
(``load_config`` -> ``tokenize_specs`` -> ``prepare_samples``: what ``ndparallel preprocess --json``
prints) and every example must be identical: the same examples kept (the same dropped), the same
``input_ids``, and the same trained targets (``labels[1:]``: ``labels[0]`` is never a target once
labels are shifted, and Axolotl writes the BOS's own id there where ndparallel writes -100).

A case listed in ``DIFFERENCES`` is a deliberate difference (docs/axolotl.md, "where we differ from
Axolotl, and why"): it must differ exactly where the table says, and, where an option gives
Axolotl's behaviour, match with it. ``python tests/test_axolotl_parity.py`` prints the table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

PARITY = Path(__file__).parent / "fixtures" / "axolotl" / "parity"
CASES = json.loads((PARITY / "cases.json").read_text())


def _null_system_rows() -> set[int]:
    """Rows of the custom-format data whose system column is null: Axolotl gives them no system
    text (its null filling), ndparallel the ``system_prompt`` (docs/axolotl.md)."""
    rows = [json.loads(line) for line in (PARITY / "data" / "custom.jsonl").read_text().splitlines()]
    return {i for i, r in enumerate(rows) if r.get("system") is None}


DIFFERENCES = {
    "custom_full": ("a null system column: system_prompt here, no system text in Axolotl", _null_system_rows),
}
"""case -> (why, the record rows where the examples differ)."""


def ours(name: str, tmp: Path, **overrides) -> tuple[list[tuple[list, list]], list[int], dict]:
    """The case's examples through ndparallel's pipeline: (input_ids, labels) per kept sample,
    the record row of each, and the selection counts."""
    from ndparallel.axolotl.load import load_config
    from ndparallel.data.dataset import DatasetSpec
    from ndparallel.data.prepare import prepare_samples, tokenize_specs
    from ndparallel.training.components import load_tokenizer

    cfg = json.loads(json.dumps(CASES[name]))
    for d in cfg["datasets"]:
        d["path"] = str(PARITY / d["path"])
    cfg.update(base_model=str(PARITY / "model"), output_dir=str(tmp / "out"))
    cfg.update(shuffle_merged_datasets=False, **overrides)  # as Axolotl ran (bench/peers/axolotl.py)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = load_config(path)
    tokenizer = load_tokenizer(config, tmp)
    specs = [DatasetSpec.from_any(d.model_dump(), f"datasets[{i}]") for i, d in enumerate(config.datasets)]
    options = config.data_options()
    prepared = prepare_samples(
        specs, tokenizer, options, None, tokenize_specs(specs, tokenizer, options, None)
    )
    examples = [tuple(x.tolist() for x in prepared.sample(k)) for k in range(len(prepared))]
    return examples, [int(r) for r in prepared.samples[:, 1]], prepared.stats.as_dict()


def theirs(name: str) -> dict:
    return json.loads((PARITY / "expected" / f"{name}.json").read_text())


def compare(name: str, tmp: Path, **overrides) -> dict:
    """Counts of the comparison, and the record rows whose examples differ."""
    got, rows, stats = ours(name, tmp, **overrides)
    want = theirs(name)["examples"]
    out = {
        "axolotl": len(want),
        "ours": len(got),
        "same_ids": 0,
        "same_targets": 0,
        "differ_rows": [],
        "stats": stats,
    }
    if len(want) != len(got):
        return out
    for row, (ids, labels), ex in zip(rows, got, want):
        same_ids = ids == ex["input_ids"]
        same_targets = same_ids and labels[1:] == ex["labels"][1:]
        out["same_ids"] += same_ids
        out["same_targets"] += same_targets
        if not same_targets:
            out["differ_rows"].append(row)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_examples_match_axolotl(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recorded = theirs(name)
    assert recorded["axolotl"] == "0.19.0" and "examples" in recorded, recorded.get("error")
    result = compare(name, tmp_path)
    assert result["ours"] == result["axolotl"], (
        f"{name}: {result['ours']} examples kept here, {result['axolotl']} by Axolotl ({result['stats']})"
    )
    if name in DIFFERENCES:
        why, rows = DIFFERENCES[name]
        assert set(result["differ_rows"]) == rows(), (name, why, result["differ_rows"])
        return
    assert result["same_targets"] == result["ours"], (
        f"{name}: {result['same_ids']} of {result['ours']} identical input_ids, {result['same_targets']} "
        f"identical targets; rows differing: {result['differ_rows'][:10]}"
    )


def test_packed_boundary_targets_are_axolotls_on_request(tmp_path, monkeypatch):
    """Packed completion pieces: by default the label across a sample start is -100 (a packed sample
    trains as it does alone); ``sample_packing_boundary_targets: true`` gives Axolotl's packed
    labels, the last token of a sample trained to predict the next sample's first token (its BOS
    or, for a later piece of a document, its first text token)."""
    import torch

    from ndparallel.data.prepare import build_rows

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got, _, _ = ours("completion_packing", tmp_path)
    starts = {tuple(ids[:2]) for ids, _ in got}

    def boundary_labels(config_overrides):
        from ndparallel.axolotl.load import load_config
        from ndparallel.data.dataset import DatasetSpec
        from ndparallel.training.components import load_tokenizer

        cfg = json.loads(json.dumps(CASES["completion_packing"]))
        cfg["datasets"][0]["path"] = str(PARITY / cfg["datasets"][0]["path"])
        cfg.update(base_model=str(PARITY / "model"), output_dir=str(tmp_path / "o"), **config_overrides)
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        config = load_config(tmp_path / "c.yaml")
        tok = load_tokenizer(config, tmp_path)
        specs = [DatasetSpec.from_any(d.model_dump()) for d in config.datasets]
        store = build_rows(specs, tok, config.data_options(), None)
        batch = store[torch.arange(len(store))]
        out = []
        for r in range(len(store)):
            pos, ids, labels = batch["position_ids"][r], batch["input_ids"][r], batch["shift_labels"][r]
            for t in range(1, int(store.lengths(r)[0])):
                if pos[t] == 0:  # a sample starts at t: the label of t - 1
                    out.append((int(labels[t - 1]), int(ids[t])))
        return out

    ours_default = boundary_labels({})
    axolotl_like = boundary_labels({"sample_packing_boundary_targets": True})
    assert ours_default and all(label == -100 for label, _ in ours_default)
    assert len(axolotl_like) == len(ours_default) and all(label == token for label, token in axolotl_like)
    assert starts  # the samples themselves are Axolotl's (test_examples_match_axolotl)


def test_before_launch_says_what_axolotl_warns(tmp_path, monkeypatch):
    """eot_tokens unset with a ChatML template under a base model's eos: no turn end trained (as in
    Axolotl), said with the fix; the samples dropped as too long counted as Axolotl counts them."""
    from ndparallel.axolotl.load import load_config
    from ndparallel.preflight.checks import run_checks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = json.loads(json.dumps(CASES["chat_eos_turn"]))
    cfg["datasets"][0]["path"] = str(PARITY / cfg["datasets"][0]["path"])
    cfg.update(
        base_model=str(PARITY / "model"),
        output_dir=str(tmp_path / "o"),
        dataset_cache_dir=str(tmp_path / "c"),
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    notes = run_checks(load_config(tmp_path / "c.yaml"), world_size=1, check_weights=False).notes
    recorded = theirs("chat_eos_turn")
    eot = [n for n in notes if "eot_tokens is unset" in n]
    assert len(eot) == 1 and "no turn end is trained" in eot[0] and "set eot_tokens: [<|im_end|>]" in eot[0]
    assert any("not found in chat_template" in w for w in recorded["warnings"])  # Axolotl warned too
    dropped = f"{recorded['dropped']} of {recorded['records']} samples are longer than sequence_len=256"
    assert any(dropped in n for n in notes), notes


def _train_losses(config_path: str) -> list[float]:
    """``ndparallel train`` on these ranks (forked: no launcher); its logged losses."""
    from ndparallel.axolotl.load import load_config
    from ndparallel.training.trainer import run_training

    cfg = load_config(config_path)
    run_training(cfg)
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


TRAINER_FIXTURES = {
    "ga1": ("trainer_losses.json", 1),
    "ga2": ("trainer_losses_ga2_dp1.json", 1),
    "ga2_dp2": ("trainer_losses_ga2_dp2.json", 2),
}
"""Axolotl's trainer's losses (``bench/peers/axolotl_loss.py --fixture``) and its CPU processes."""


@pytest.mark.parametrize("case", TRAINER_FIXTURES)
def test_unpacked_losses_equal_axolotls_trainer(case, tmp_path, monkeypatch):
    """Axolotl 0.19.0's trainer (recorded by ``bench/peers/axolotl_loss.py --fixture``) and
    ``ndparallel train`` on one YAML: Axolotl's defaults for the data order (the merged dataset
    shuffled by ``seed``, then the ``Trainer``'s seeded random sampler, its batches dealt to the dp
    ranks in turn) and the shapes (each batch cut after its longest sample). Each step draws the same
    samples, so the losses are equal under ``agreement.model_floor`` (log2(n) ulp per step). Above
    one micro-batch per step with ``loss_reduction: micro_batch_mean`` (Axolotl's mean of the
    micro-batches' token means); the default, the global token mean, then differs (over 10× the bound,
    checked on one rank)."""
    from transformers import AutoConfig

    from ndparallel.testing import run_on_ranks
    from ndparallel.tools.agreement import model_floor

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name, ranks = TRAINER_FIXTURES[case]
    recorded = json.loads((PARITY / name).read_text())
    cfg = json.loads(json.dumps(recorded["config"]))
    cfg["base_model"] = str(PARITY / cfg["base_model"])
    cfg["datasets"][0]["path"] = str(PARITY / cfg["datasets"][0]["path"])
    cfg.update(dataset_cache_dir=str(tmp_path / "cache"), save_final_model=False, dp_replicate_size=ranks)
    several = ranks > 1 or cfg["gradient_accumulation_steps"] > 1
    mine = "micro_batch_mean" if several else "global_token_mean"
    # with accumulation on one rank, the default too: the negative control (it must differ)
    runs = dict.fromkeys([mine, "global_token_mean"] if several and ranks == 1 else [mine])
    for reduction in runs:
        path = tmp_path / f"{reduction}.yaml"
        path.write_text(
            yaml.safe_dump({**cfg, "loss_reduction": reduction, "output_dir": str(tmp_path / reduction)})
        )
        runs[reduction] = run_on_ranks(_train_losses, ranks, str(path), timeout_s=300)[0]
    theirs = [s["loss"] for s in recorded["steps"]]
    assert recorded["axolotl"] == "0.19.0" and len(theirs) == cfg["max_steps"]
    bound = model_floor(AutoConfig.from_pretrained(PARITY / "model"), len(theirs))
    worst = {k: max(abs(a - b) / a for a, b in zip(theirs, ours, strict=True)) for k, ours in runs.items()}
    ours = runs[mine]
    assert worst[mine] <= bound, f"differ by {worst} (relative), bound {bound:.1e}: {theirs} {ours}"
    if mine != "global_token_mean":  # a check that can fail: Axolotl's normalisation is not the default
        assert worst.get("global_token_mean", 1.0) > 10 * bound, (worst, bound)


def test_dry_run_states_the_expected_padding(tmp_path, monkeypatch):
    """``--dry-run``'s padding line: the padded share of the computed tokens under the run's settings
    (the rows' lengths drawn by the run's loader): every row at sequence_len pads most; cut after
    each micro-batch's longest row (Axolotl's default without packing), far less."""
    from ndparallel.axolotl.load import load_config
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.preflight.padding import expected_padding
    from ndparallel.training.components import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = {
        "base_model": str(PARITY / "model"),
        "datasets": [{"path": str(PARITY / "data" / "alpaca.jsonl"), "type": "alpaca"}],
        "sequence_len": 1024,
        "micro_batch_size": 8,
        "output_dir": str(tmp_path / "o"),
    }
    fractions = {}
    for pad in (True, False):
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({**cfg, "pad_to_sequence_len": pad}))
        config = load_config(tmp_path / "c.yaml")
        line = expected_padding(config, ParallelDims(), load_tokenizer(config, tmp_path))
        fractions[pad] = float(line.split("%")[0]) / 100
        assert "expected to be padding" in line and ("rows of 1024" in line) == pad, line
    assert 0.5 < fractions[True] and fractions[False] < fractions[True] / 2, fractions


if __name__ == "__main__":
    import tempfile

    print("| case | examples kept (Axolotl / here) | identical input_ids | identical trained targets |")
    print("|---|---|---|---|")
    for name in CASES:
        r = compare(name, Path(tempfile.mkdtemp()))
        print(f"| `{name}` | {r['axolotl']} / {r['ours']} | {r['same_ids']} | {r['same_targets']} |")

"""What a family cannot run is refused before launch (one line, exit 2); the TP plan finds the
decoder wherever it lives; the positions reach an attention its decoder layer does not pass them to
(Llama 4, negative control included); a family outside the tested set gets a shrunk check of its
layout before ``train`` launches."""

from __future__ import annotations

import pytest
import torch
import transformers

from cli_helpers import forbid_launch, run_cli
from ndparallel.tools.shrink import shrink_model


def _save(tmp_path, cls: str, **fields) -> str:
    """A tiny model of the family saved by save_pretrained; ``fields`` set on the shrunk config."""
    config = shrink_model(getattr(transformers, cls)(), tp_size=2, cp_size=2).config
    for name, value in fields.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    path = tmp_path / cls
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "cls, layout, fragments",
    [
        ("BloomConfig", ["context_parallel_size=2"], ["context_parallel_size=2", "AttentionInterface"]),
        ("StableLmConfig", ["tensor_parallel_size=2"], ["tensor_parallel_size=2", "no tensor-parallel plan"]),
        (
            "Llama4TextConfig",
            ["tensor_parallel_size=2"],
            ["tensor_parallel_size=2", "experts implementations"],
        ),
        (
            "MixtralConfig",
            ["expert_parallel_size=2"],
            ["expert_parallel_size=2 must divide", "dp_shard_size"],
        ),
        (
            "LlamaConfig",
            ["expert_parallel_size=2", "dp_shard_size=2"],
            ["expert_parallel_size=2", "not a mixture-of-experts"],
        ),
        (
            "Llama4TextConfig",
            ["context_parallel_size=2", "sequence_len=8192", "dp_shard_size=1"],
            ["floor_scale=8192", "sequence_len < 8192"],
        ),
    ],
)
def test_unsupported_combination_refused_before_launch(tmp_path, capsys, monkeypatch, cls, layout, fragments):
    forbid_launch(monkeypatch)
    model = (
        _save(tmp_path, cls, max_position_embeddings=16384)
        if cls.startswith("Llama4")
        else _save(tmp_path, cls)
    )
    code, _, err = run_cli(
        capsys,
        "train",
        "--set",
        f"base_model={model}",
        "--set",
        "sequence_len=32",
        "--set",
        "datasets=[{path: 'builtin:stdlib'}]",
        *(a for item in layout for a in ("--set", item)),
        "--dry-run",
    )
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_tp_plan_found_outside_base_model_prefix():
    """Llama 4's base_model_prefix is ``language_model``; its decoder is ``model``: every plan entry
    for the attention and dense MLP lands on ``model.layers.*`` (13 of 14 were dropped silently)."""
    from ndparallel.models.tp_plans import match_plan, model_tp_plan, tp_plan_problem, unmatched_keys

    config = shrink_model(transformers.Llama4TextConfig(moe_layers=[]), 2, 1).config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.base_model_prefix == "language_model"
    plan = model_tp_plan(model)
    assigned = match_plan(model, plan, strict=False)
    for name in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.0.feed_forward.down_proj",
        "model.embed_tokens",
        "lm_head",
    ):
        assert name in assigned, (name, sorted(assigned))
    assert tp_plan_problem(model) is None
    dropped = unmatched_keys(model, plan)  # the MoE entries: this model has no MoE layer
    assert dropped and all("expert" in k for k in dropped), dropped


def _llama4_positions_lost(setup, layout):
    """Training as before the fix: the attention sees only the position_ids its layer passes (Llama 4
    passes none), so it treats a packed row as one document."""
    from ndparallel.parallel.positions import PositionRecorder
    from ndparallel.tools.equivalence import train_under_layout

    PositionRecorder.positions = lambda self, kwargs: kwargs.get("position_ids")
    return train_under_layout(setup, layout)


def test_llama4_context_parallel_gets_document_positions():
    from ndparallel.testing import run_on_ranks
    from ndparallel.tools.agreement import assert_differs, assert_matches, one_process_reference
    from ndparallel.tools.equivalence import TrainSetup, train_under_layout

    config = shrink_model(transformers.Llama4TextConfig(), 1, 2).config
    setup = TrainSetup(
        config, steps=2, global_micro_batch=2, seq_len=32, optimizer="sgd", lr=0.1, packed_documents=True
    )
    ref = one_process_reference(setup)
    assert_matches(ref, run_on_ranks(train_under_layout, 2, setup, {"cp_size": 2})[0])
    # the negative control: the check can fail
    assert_differs(ref, run_on_ranks(_llama4_positions_lost, 2, setup, {"cp_size": 2})[0])


def test_family_outside_the_tested_set_is_checked_before_launch(monkeypatch):
    """Gemma (1) is not in the tested set: its shrunk copy under TP 2 equals one process (None);
    with its attention losing the document positions (patched, as a stand-in for a family the
    layout would train differently) the check refuses it in one line."""
    from ndparallel.config import TrainConfig
    from ndparallel.layout.config import ParallelismConfig
    from ndparallel.tools import family_check as fc

    cfg = TrainConfig(sequence_len=32, sequence_parallel=True)
    assert fc.family_check(cfg, ParallelismConfig(tp_size=2).resolve(2), transformers.GemmaConfig()) is None
    monkeypatch.setattr(fc, "is_tested_family", lambda config: False)
    pc = ParallelismConfig(cp_size=2).resolve(2)
    assert fc.family_check(cfg, pc, transformers.LlamaConfig()) is None
    from ndparallel.parallel.positions import PositionRecorder

    monkeypatch.setattr(PositionRecorder, "positions", lambda self, kwargs: None)  # plain causal
    problem = fc.family_check(cfg, pc, transformers.LlamaConfig())
    assert problem and "trains differently" in problem and "\n" not in problem, problem
    assert "--skip-family-check" in problem


def test_train_runs_the_family_check_unless_skipped(tmp_path, capsys, monkeypatch):
    """``train`` refuses (exit 2, one line) what the check refuses; ``--skip-family-check`` launches."""
    import ndparallel.tools.family_check as fc

    forbid_launch(monkeypatch)
    model = _save(tmp_path, "GemmaConfig")
    monkeypatch.setattr(fc, "family_check", lambda cfg, pc, hf: "model_type 'gemma' ... trains differently")
    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"base_model: {model}\ntokenizer: builtin:stdlib\ntokenizer_vocab_size: 259\n"
        "sequence_len: 32\ntensor_parallel_size: 2\ndatasets: [{path: builtin:stdlib, "
        f"max_bytes: 20000}}]\noutput_dir: {tmp_path / 'out'}\n"
        f"dataset_cache_dir: {tmp_path / 'cache'}\n"
    )
    args = ["train", config]
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "trains differently" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(AssertionError, match="ranks were launched"):
        run_cli(capsys, *args, "--skip-family-check")

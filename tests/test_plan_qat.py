"""The planner under QAT (``plan --qat``): with the quantisers recomputed in backward
(``techniques/qat.py``), a fake-quantised layer keeps a rounded bf16 copy of its weights (and inputs)
for backward. The constants in ``plan/memory/qat_memory.py`` are re-measured here on a tiny Llama
(the method of
``bench/qat_memory.py``) and must predict its saved bytes within 10 %; the memory model adds them
per layer (once under checkpointing); TP layouts are rejected as train refuses them (a config's
``qat:`` reaching the planner: ``tests/test_plan_from_config.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cli_helpers import run_cli
from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.cli.main import main
from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.memory.peak import estimate_memory
from ndparallel.plan.memory.qat_memory import layer_linear_counts, qat_layer_bytes
from ndparallel.plan.models import PRESETS, ModelSpec
from ndparallel.plan.settings import Settings

pytest.importorskip("torchao")
ROOT = Path(__file__).resolve().parents[1]
H100 = HW["h100-80gb"]
LLAMA8 = PRESETS["llama-3.1-8b"]


@pytest.mark.parametrize("fmt,frozen", [("int4/int8", False), ("int4/int8", True), ("float8/float8", False)])
def test_constants_predict_a_fresh_measurement(fmt, frozen):
    sys.path.insert(0, str(ROOT / "bench"))
    from qat_memory import SHAPES, layer_counts, layer_extra

    shape, tokens = SHAPES[1], 128
    spec = ModelSpec(
        "tiny",
        hidden=shape["hidden_size"],
        layers=3,
        heads=shape["num_attention_heads"],
        kv_heads=shape["num_key_value_heads"],
        intermediate=shape["intermediate_size"],
        vocab=512,
    )
    assert layer_linear_counts(spec) == layer_counts(shape)
    measured = layer_extra(shape, tokens, fmt, frozen)
    predicted = qat_layer_bytes(spec, fmt, tokens, frozen=frozen, compute_bytes=2)
    assert measured > 0 and abs(predicted - measured) <= 0.1 * measured, (predicted, measured)


def _memory(qat, checkpointing, **kw):
    s = Settings(
        sequence_len=4096,
        micro_batch_size=1,
        activation_checkpointing=checkpointing,
        chunked_loss=False,
        qat=qat,
        **kw,
    )
    return estimate_memory(LLAMA8, ParallelDims(dp_shard=8), s, H100)


def test_every_layer_keeps_its_share_without_checkpointing_one_with_it():
    tokens = 4096
    layer = qat_layer_bytes(LLAMA8, "int4", tokens, frozen=False, compute_bytes=2)
    weights, _ = layer_linear_counts(LLAMA8)
    assert layer == 2 * weights  # one rounded bf16 copy: 0.44 GB for one 8B layer
    off, on = _memory(None, False), _memory("int4", False)
    assert on.activations - off.activations >= LLAMA8.layers * layer  # every layer's, + the head's
    ac_off, ac_on = _memory(None, True), _memory("int4", True)
    assert 0 < ac_on.activations - ac_off.activations <= layer + 2 * LLAMA8.vocab * LLAMA8.hidden + 1
    assert ac_on.total - ac_off.total < on.total - off.total


def test_lora_keeps_only_the_rounded_copy():
    frozen = qat_layer_bytes(LLAMA8, "int4", 4096, frozen=True, compute_bytes=2)
    assert frozen == 2 * layer_linear_counts(LLAMA8)[0]


def test_tp_layouts_are_rejected_and_the_header_says_qat(capsys):
    assert (
        main(
            ["--base-model", "llama-3.1-8b", "--gpus", "8", "--qat", "int4/int8", "--show-rejected", "--json"]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["request"]["qat"] == "int4/int8"
    ranked = [r["layout"] for r in result["ranked"]]
    assert ranked and all(r["tp"] == 1 for r in ranked)
    assert any(c["code"] == "qat_layout" for r in result["rejected"] for c in r["rejections"])
    assert main(["--base-model", "llama-3.1-8b", "--gpus", "8", "--qat", "int4", "--top", "1"]) == 0
    assert "QAT int4" in capsys.readouterr().out


def test_unknown_format_is_one_line(capsys):
    code, _, err = run_cli(capsys, "plan", "--base-model", "llama-3.1-8b", "--gpus", "8", "--qat", "int8")
    assert code == 2 and "--qat int8" in err and "int4/int8" in err and "Traceback" not in err

"""Axolotl's own causal-LM examples, as written (tests/fixtures/axolotl_examples: the 198 SFT and
pre-training configs of axolotl-ai-cloud/axolotl@067b021's examples/, RL, reward and multimodal
ones left out), replayed through ndparallel's front door:

* every key of Axolotl's schema (``schema_keys.json``, extracted from that commit) is honoured,
  translated, accepted when empty, or refused with the fix — never a bare "unknown key";
* every refusal line of every example names its fix;
* the share of examples accepted unchanged, at the schema level and at the ``--dry-run`` level with
  a tiny model of each example's family (``models.yaml``) standing in for ``base_model``.

Refusals that belong to work done elsewhere (quantised bases and low-bit optimizers: QLoRA) are
counted apart as ``pending``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from axolotl_stand_ins import FIXTURES, model_types, stand_in
from cli_helpers import forbid_launch, run_cli
from ndparallel.axolotl import ConfigError, load_config, own_keys
from ndparallel.axolotl.keys import DATASET, FSDP, PLUGINS, TOP
from ndparallel.axolotl.translate import MAPPERS, translate
from ndparallel.config.datasets import DatasetConfig, SpecialTokens
from ndparallel.config.fields import FSDPConfig

EXAMPLES = sorted((FIXTURES / "examples").rglob("*.y*ml"))
SCHEMA = json.loads((FIXTURES / "schema_keys.json").read_text())
PENDING = re.compile(
    r"^'(load_in_4bit|load_in_8bit|adapter|optimizer: "
    r"\w*(8bit|4bit|paged)\w*|quantize_moe_experts|bnb_config_kwargs"
    r"|model_quantization_config\w*|gptq\w*|qat|quantization|nvfp4\w*|dsv4_fp\w*|nonexpert_quantization"
    r"|qlora_sharded_model_loading|gemma4_\w*_nonexpert)[':]"
)
"""Refusals of quantisation keys (GPTQ, QAT, MXFP4 / NVFP4 bases, an 8-bit full fine-tune), reported
apart: the rest of such an example is checked with them taken out."""
FIX = re.compile(
    r"\b(remove|use|set|add|give|download|put|upload|install|keep|fix|write|raise|lower|did you mean)\b"
)
LEGACY = {
    "debug",
    "test_value",
    "eta_min",
    "base_model_ignore_patterns",
    "sample_packing_seq_len_multiplier",
    "adam_eps",
    "gptq_groupsize",
    "gptq_model_v1",
    "gptq_disable_exllama",
}
"""Keys Axolotl's examples use that its schema no longer has (the table covers them too)."""


@pytest.fixture(autouse=True)
def _never_launch(monkeypatch):
    forbid_launch(monkeypatch)


def _keys(model) -> set[str]:
    out = set(model.model_fields)
    for f in model.model_fields.values():
        if f.validation_alias is not None and hasattr(f.validation_alias, "choices"):
            out |= {str(c) for c in f.validation_alias.choices}
    return out


def test_every_axolotl_key_is_classified():
    own = own_keys()
    axolotl = set(SCHEMA["top"]) | {k for args in SCHEMA["plugins"].values() for k in args}
    assert len(axolotl) > 450
    assert sorted(k for k in axolotl if k not in own and k not in TOP) == []
    assert sorted(k for k in TOP if k not in axolotl | LEGACY) == []  # the table holds only Axolotl's keys
    assert sorted(k for k in TOP if k in own and k not in MAPPERS) == []  # ours: only value translations
    assert sorted(k for k, r in TOP.items() if r.kind == "mapped" and k not in MAPPERS) == []
    datasets = _keys(DatasetConfig) | set(DATASET) | {"field"}
    assert sorted(k for k in SCHEMA["datasets"] if k not in datasets) == []
    from dataclasses import fields

    from ndparallel.data.instruct import InstructFormat

    assert sorted(set(SCHEMA["datasets.type"]) - {f.name for f in fields(InstructFormat)}) == []
    assert sorted(k for k in SCHEMA["fsdp_config"] if k not in _keys(FSDPConfig) | set(FSDP)) == []
    assert sorted(k for k in SCHEMA["special_tokens"] if k not in _keys(SpecialTokens)) == []
    assert {p.rsplit(".", 1)[-1] for p in PLUGINS} >= {"CutCrossEntropyPlugin", "LigerPlugin"}


@pytest.mark.parametrize("key", sorted(k for k, r in TOP.items() if r.kind == "noop"))
def test_noop_keys_empty_are_accepted_set_are_refused_with_the_fix(key):
    for empty in (None, False, "", [], {}):
        assert translate({key: empty}, own_keys()).problems == []
    default = SCHEMA["top"].get(key, SCHEMA["plugins"].get(_plugin_of(key), {}).get(key))
    if default not in (None, "<none>") and key != "use_swanlab":  # SwanLab's switch defaults to on
        assert translate({key: default}, own_keys()).problems == [], (key, default)
    problems = translate({key: "some-value-12345"}, own_keys()).problems
    assert len(problems) == 1 and problems[0].startswith(f"'{key}: some-value-12345'"), problems
    assert FIX.search(problems[0].split(":", 2)[-1]), problems


def _plugin_of(key: str) -> str:
    return next((p for p, args in SCHEMA["plugins"].items() if key in args), "")


@pytest.mark.parametrize(
    "raw, expected, note",
    [
        ({"bf16": "auto"}, {"bf16": False}, "bf16: auto -> false"),
        (
            {"gradient_checkpointing": True},
            {"fsdp_config": {"activation_checkpointing": True}},
            "-> fsdp_config.activation_checkpointing: true",
        ),
        (
            {
                "fsdp": ["full_shard", "auto_wrap"],
                "fsdp_config": {
                    "fsdp_offload_params": True,
                    "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                },
            },
            {"dp_shard_size": -1, "fsdp_config": {"cpu_offload": True, "layer_classes": "LlamaDecoderLayer"}},
            "legacy fsdp_ prefix dropped",
        ),
        ({"fsdp_version": 1}, {"fsdp_version": 2}, "fsdp_version: 1 -> FSDP2"),
        (
            {"deepspeed": "deepspeed_configs/zero3_bf16_cpuoffload_all.json"},
            {"dp_shard_size": -1, "fsdp_config": {"reshard_after_forward": True, "cpu_offload": True}},
            "ZeRO-3",
        ),
        ({"warmup_steps": 0.1}, {"warmup_ratio": 0.1}, "warmup_steps: 0.1 -> warmup_ratio"),
        ({"batch_size": 8, "micro_batch_size": 2}, {"gradient_accumulation_steps": 4}, "batch_size: 8"),
        (
            {"datasets": [{"path": "x", "message_field_role": "from", "message_field_content": "value"}]},
            {"datasets": [{"path": "x", "message_property_mappings": {"role": "from", "content": "value"}}]},
            "message_property_mappings",
        ),
        ({"attn_implementation": "xformers"}, {"attn_implementation": "sdpa"}, "xformers -> sdpa"),
        (
            {"max_packed_sequence_len": 2048, "sequence_len": 2048},
            {"sample_packing": True, "sequence_len": 2048},
            "max_packed_sequence_len: 2048 -> sample_packing: true",
        ),
        (
            {"tokens": {"pad_token": "<|padding|>", "eos_token": "<|endoftext|>"}},
            {"special_tokens": {"pad_token": "<|padding|>", "eos_token": "<|endoftext|>"}},
            "(older Axolotl's form)",
        ),
        (
            {"gradient_checkpointing": "offload"},
            {"activation_offloading": True, "fsdp_config": {"activation_checkpointing": True}},
            "offload -> activation_offloading: true",
        ),
        ({"activation_offloading": "legacy"}, {"activation_offloading": True}, "legacy -> true"),
        (
            {"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_rms_norm": True},
            {"compile": True},
            "liger_rms_norm: true -> torch_compile: true",
        ),
    ],
)
def test_renames_and_translations_say_what_they_became(raw, expected, note):
    t = (
        translate({"dp_shard_size": None, **raw}, own_keys())
        if "fsdp" not in raw and "deepspeed" not in raw
        else translate(raw, own_keys())
    )
    assert t.problems == []
    for key, value in expected.items():
        assert t.data[key] == value, (key, t.data)
    assert any(note in n for n in t.notes), t.notes


@pytest.mark.parametrize(
    "raw, expected",
    [
        (
            {"torch_compile": True, "torch_compile_backend": "eager"},
            {"compile": True, "compile_backend": "eager"},
        ),
        ({"dataset_prepared_path": "last_run_prepared"}, {"dataset_cache_dir": "last_run_prepared"}),
        (
            {"fsdp_config": {"offload_params": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}},
            {"fsdp_config": {"cpu_offload": True, "layer_classes": ["LlamaDecoderLayer"]}},
        ),
        (
            {"datasets": [{"path": "x", "type": "completion", "field": "body"}]},
            {"datasets": [{"path": "x", "type": "completion", "text_field": "body"}]},
        ),
    ],
)
def test_axolotl_names_become_the_typed_configs_own(raw, expected):
    """The typed config knows none of Axolotl's names: the front door renames them (silently: the
    same meaning) and a value the schema refuses is still named as the config wrote it."""
    t = translate({"dp_shard_size": None, **raw}, own_keys())
    assert t.problems == []
    for key, value in expected.items():
        assert t.data[key] == value, (key, t.data)


@pytest.mark.parametrize(
    "sets, named",
    [
        (["torch_compile=sometimes"], "'torch_compile': "),
        (["dataset_prepared_path=[1, 2]"], "'dataset_prepared_path': "),
        (["fsdp_config.offload_params=sometimes"], "'fsdp_config.offload_params': "),
    ],
)
def test_a_renamed_keys_bad_value_is_named_as_written(sets, named):
    from ndparallel.axolotl import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert named in str(e.value), str(e.value)


def test_a_renamed_key_and_its_new_name_must_agree():
    t = translate({"fsdp_config": {"offload_params": True, "cpu_offload": False}}, own_keys())
    assert t.problems == [
        "'fsdp_config.offload_params: true' and 'fsdp_config.cpu_offload: false' say different "
        "things; keep one"
    ]


def test_expert_parallel_without_degrees_shards_over_every_device():
    """Axolotl's EP examples give only expert_parallel_size (its ranks are the data-parallel ones):
    the dense layers are then sharded over every device, from which EP borrows its ranks."""
    t = translate({"expert_parallel_size": 4}, own_keys())
    assert t.problems == [] and t.data["dp_shard_size"] == -1 and "dp_replicate_size" not in t.data
    assert any("expert_parallel_size borrows its ranks" in n for n in t.notes), t.notes
    assert translate({}, own_keys()).data["dp_replicate_size"] == -1  # control: plain data parallel


def test_wrong_did_you_means_are_gone(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "base_model: tiny-llama\nmodel_type: AutoModelForCausalLM\nfp16: true\n"
        "lora_modules_to_save: [embed_tokens]\ndata_fil: x\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    text = str(e.value)
    assert (
        "save_dtype" not in text and "did you mean 'bf16'" not in text and "lora_target_modules'" not in text
    )
    assert "fp16" not in text  # fp16: true is honoured now (fp16 mixed precision: tests/test_fp16.py)
    assert "modules_to_save" not in text  # honoured (a LoRA field): neither refused nor "corrected"
    assert "unknown key 'data_fil'" in text  # a typo of no key at the top level: no suggestion that misleads


def test_empty_values_placeholders_and_lora_model_dir(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "base_model: tiny-llama\nlora_model_dir:\nlora_r:\nwandb_project:\nstrict: false\n"
        "evals_per_epoch:\nload_in_8bit: false\nfp16:\n"
    )
    loaded = load_config(cfg)
    assert loaded.lora_model_dir is None and loaded.lora_r == 8 and loaded.lora_fields_without_adapter() == []
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(empty)


def _schema_problems(path: Path) -> list[str]:
    try:
        load_config(path)
        return []
    except ConfigError as e:
        lines = str(e).splitlines()
        return [line.strip() for line in lines[1:]] if len(lines) > 1 else [str(e).split(": ", 1)[1]]


@pytest.fixture(scope="module")
def schema_results():
    return {str(p.relative_to(FIXTURES / "examples")): _schema_problems(p) for p in EXAMPLES}


def _report(name: str, results: dict[str, list[str]]) -> tuple[int, int]:
    accepted = sum(not lines for lines in results.values())
    modulo = sum(all(PENDING.match(line) for line in lines) for lines in results.values())
    print(
        f"\n{name}: {accepted}/{len(results)} accepted unchanged; {modulo}/{len(results)} "
        f"({100 * modulo / len(results):.1f} %) setting aside unsupported quantised bases"
    )
    return accepted, modulo


def test_examples_at_the_schema_level(schema_results):
    assert len(schema_results) == 198
    accepted, modulo = _report("schema", schema_results)
    assert accepted >= 182 and modulo >= 188, (
        "fewer Axolotl examples accepted than measured on 2026-12-01 (182 of 198)"
    )
    for name, lines in schema_results.items():
        for line in lines:
            assert (
                not re.fullmatch(r"unknown key '[^']*'(; remove it.*)?", line)
                or "did you mean" in line
                or line.split("'")[1].split(".")[-1] not in set(SCHEMA["top"]) | set(SCHEMA["datasets"])
            ), (name, line)
            assert FIX.search(line), (name, line)  # every refusal names its fix


NEUTRAL = (
    "load_in_4bit",
    "load_in_8bit",
    "bnb_config_kwargs",
    "quantize_moe_experts",
    "gptq",
    "qat",
    "quantization",
    "model_quantization_config",
    "model_quantization_config_kwargs",
    "nvfp4_merge_aware",
    "dsv4_fp4_grouped_mode",
    "qlora_sharded_model_loading",
)


def _neutralised(raw: dict) -> list[str]:
    """``--set`` overrides that take the pending keys out (to check the rest of such an example)."""
    sets = [f"{k}=null" for k in NEUTRAL if k in raw]
    if raw.get("adapter") == "qlora":
        sets.append("adapter=lora")
    if re.search(r"8bit|4bit|paged", str(raw.get("optimizer"))):
        sets.append("optimizer=adamw_torch")
    return sets


def test_examples_at_the_dry_run_level(schema_results, tmp_path_factory, capsys):
    """Each example with a tiny model of its family as base_model; examples refused only for pending
    keys are dry-run with those keys taken out."""
    root = tmp_path_factory.mktemp("stand_ins")
    families = model_types()
    results = {}
    for path in EXAMPLES:
        name = str(path.relative_to(FIXTURES / "examples"))
        raw = yaml.safe_load(path.read_text())
        pending_only = schema_results[name] and all(PENDING.match(x) for x in schema_results[name])
        if schema_results[name] and not pending_only:
            results[name] = schema_results[name]
            continue
        sets = [
            f"base_model={stand_in(root, families[raw['base_model']])}",  # a local stand-in: no Hub revision
            *[f"{k}=null" for k in ("revision_of_model", "model_revision") if k in raw],
            *(_neutralised(raw) if pending_only else []),
        ]
        if raw.get("load_in_4bit") and not pending_only:  # NF4 groups that fit the tiny stand-in's linears
            sets += ["nf4_block_size=2", "nf4_scaler_block_size=2"]
        if (
            (raw.get("qat") or {}).get("group_size") or 0
        ) > 64:  # QAT groups that fit the stand-in's 64-wide linears
            sets.append("qat.group_size=32")
        ranks = (
            ["--nproc-per-node", str(raw["expert_parallel_size"])]
            if raw.get("expert_parallel_size", 1) > 1
            and not any(k in raw for k in ("dp_shard_size", "dp_replicate_size", "tensor_parallel_size"))
            else []
        )
        code, _, err = run_cli(
            capsys,
            "train",
            path,
            "--dry-run",
            *ranks,  # EP examples: the GPUs they are written for
            *[a for s in sets for a in ("--set", s)],
        )
        lines = [x.strip() for x in err.strip().splitlines()]
        results[name] = [] if code == 0 else lines
        if code == 0 and pending_only:
            results[name] = schema_results[name]  # accepted once the pending keys are supported
    with capsys.disabled():
        accepted, modulo = _report("dry-run", results)
        for name, lines in sorted(results.items()):
            mine = [x for x in lines if not PENDING.match(x) and not x.endswith("problems:")]
            if mine:
                print(f"  refused {name}: {mine[0].removeprefix('ndparallel train: error: ')[:150]}")
    assert accepted >= 169 and modulo >= 172, (
        "fewer Axolotl examples pass --dry-run than measured on 2026-12-01 (169 of 198)"
    )


def test_docs_tables_are_generated_from_the_key_table():
    from ndparallel.axolotl.doc import PAGE, page

    root = Path(__file__).resolve().parents[1]
    assert (root / PAGE).read_text() == page(), f"{PAGE} is stale: python -m ndparallel.axolotl.doc"


def test_dry_run_explains_family_dependent_behaviour(tmp_path, capsys):
    """LFM2 (short convolutions between attention layers): the chunked loss of the CutCrossEntropy
    plugin resolves to the logits path, and packed samples are said to mix in the convolutions."""
    path = stand_in(tmp_path, "lfm2")
    example = FIXTURES / "examples" / "LiquidAI" / "lfm2-350m-fft.yaml"
    code, out, err = run_cli(capsys, "train", example, "--dry-run", "--set", f"base_model={path}")
    assert code == 0, err
    assert "chunked loss off (model_type 'lfm2' is not among the families with a plain LM head" in out
    assert "sample_packing: lfm2 also mixes tokens outside attention" in out
    code, _, err = run_cli(
        capsys, "train", example, "--dry-run", "--set", f"base_model={path}", "--set", "chunked_loss=true"
    )
    assert code == 2 and "chunked_loss: true, but the chunked loss would not be exact" in err

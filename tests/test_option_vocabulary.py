"""One vocabulary for run options (issue 48, item 1): an option's name is spelled in few modules,
and the planner's request carries its ``Settings`` instead of declaring their names again.

The spelling count is static (file text only): a module spells an option when its text has the
name as a whole word, or its command-line form (``tiled-mlp-num-shards``). The target is
``TARGET`` modules under ``src/`` — the schema, the options, the one place that uses it and the
planner's settings. ``OVER_TARGET`` states today's count of every name still above it; a new
spelling of any option fails here (raise a bound only with a reason), and a name brought down to
the target must leave the table.
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from pathlib import Path

from ndparallel.parallel import options
from ndparallel.plan.layout import Settings
from ndparallel.plan.search import PER_LAYOUT, PlanRequest, base_settings

SRC = Path(__file__).resolve().parents[1] / "src" / "ndparallel"
TARGET = 4

# 2026-12-06: counts raised by one or two where a module was split to keep files under 450 lines
# (plan/cli.py -> cli_arguments.py, axolotl/keys.py -> noop_keys.py and compute_keys.py, ...):
# the same spelling, now in two files.
BATCH_ARITHMETIC = {
    "seq_len": 26,
    "micro_batch": 55,  # 48 + preflight/host_memory (the config's batch as the planner's),
    # plan/sp_activations, tools/agreement, tools/saved_bytes (prose "micro-batch"),
    # plan/embedding_moment (split from memory.py at its line limit)
    "grad_accum": 17,  # + tools/agreement (fp16's second way: the rows as 2 accumulated micro-batches),
    # preflight/host_memory (a pipeline's micro-batches in flight)
    "global_batch": 11,
    "gpus_per_node": 14,
}
"""Not options but the batch arithmetic every layer computes with (local variables of the same
name count): a stated exception, not debt."""

OVER_TARGET = {
    # Debt of issue 48 item 1: each is spelled by the YAML schema, the runtime options, its users
    # (runtime and planner estimates), Settings, the plan CLI's flags and checks, its report (config
    # writer) and preflight's plan text. 2026-12-06: PlanRequest carries a Settings and the plan
    # flags map to Settings by field name both ways (plan/cli.py flag_settings / flag_defaults), so
    # plan/search.py, plan/cli.py and cli/plan_config.py no longer restate them. Later that day each
    # Settings field (and each search choice in PlanRequest) declares its own plan flag (plan/layout.py's
    # ``flag`` metadata), so the flags and their checks (plan/cli_arguments.py, plan/cli_checks.py) are
    # built from it, not restated; and cli/plan_config.py's merge takes every key of the plan's config
    # but the run's own (RUN_KEYS), so it no longer lists the planned ones; the step-level settings
    # are marked at their fields (plan/field_marks.py STEP), not listed in plan/compute.py.
    "ac_policy": 8,  # 4 + the runtime option (issue 50): config/fields, parallel/options,
    # techniques/selective_ac, axolotl/noop_keys (Axolotl's selective key names the fix)
    "activation_checkpointing": 17,  # 16 + techniques/selective_ac (its refusals name the fix)
    "activation_dtype": 7,
    "activation_offloading": 17,  # 15 + techniques/selective_ac (its refusal names the fix),
    # preflight/host_memory (the check before launch names the field)
    "chunk_tokens": 8,  # + plan/loss_memory (split from memory.py at its line limit)
    "comm_strategy": 10,
    "cp_strategy": 6,  # + plan/longest.py (--max-seq-len tries each strategy, names the one it keeps)
    "cpu_offload": 12,
    "fake_quant_after_n_steps": 5,
    "group_size": 6,
    "layer_classes": 14,
    "load_balance": 8,
    "lora_r": 21,  # + plan/embedding_moment (split from memory.py at its line limit)
    "lora_saved": 9,
    "loss_impl": 6,
    "loss_parallel": 14,
    "mixed_precision": 22,  # + plan/embedding_moment (split from memory.py at its line limit),
    # tools/agreement (fp16's second way)
    "optimizer_fused": 5,  # config/plan_settings: the one TrainConfig -> Settings step
    "pipeline_schedule": 8,
    "pipeline_virtual_stages": 7,
    "pp_schedule": 6,
    "pp_virtual": 7,
    "quantize_embedding": 5,
    "quantized_base": 8,
    "reshard_after_backward": 5,  # + plan/embedding_moment (split from memory.py at its line limit)
    "reshard_after_forward": 15,
    "sequence_parallel": 30,  # plan/sp_activations (the SP saved-shard model), plan/recompute_policies,
    # plan/layer_backward (split from memory.py at its line limit)
    "tiled_mlp": 17,  # techniques/__init__ (names the module tiled_mlp.py), techniques/selective_ac
    "tiled_mlp_num_shards": 8,
    "unsharded_grad_accumulation": 16,  # 15 + tools/simulate_predict (resolves the PP default)
    "virtual_stages": 7,  # 6 + plan/layout.Settings.from_options, the one options -> Settings step
    "weight_dtype": 10,
}

REQUEST_ONLY = {
    "model",
    "hardware",
    "gpus",
    "gpus_per_node",
    "settings",
    "global_batch",
    "host_mem_bytes",
    "pipeline",
    "pipeline_schedule",
    "pipeline_virtual_stages",
}
"""``PlanRequest`` fields that are not one layout's settings: what to plan for and what to search."""

OPTION_CLASSES = (
    options.FSDPOptions,
    options.TPOptions,
    options.CPOptions,
    options.LossOptions,
    options.CompileOptions,
    options.Float8Options,
    options.QATOptions,
    options.PipelineOptions,
    Settings,
    PlanRequest,
)


def option_names() -> set[str]:
    """Every option field's name that is a compound word (single words such as ``enabled`` or
    ``plan`` are everyone's vocabulary and cannot be counted)."""
    return {f.name for cls in OPTION_CLASSES for f in fields(cls) if "_" in f.name}


def spelling_modules(name: str, texts: dict[str, str]) -> list[str]:
    """The modules (of ``texts``: path -> source) that spell ``name`` or its flag form."""
    forms = "|".join(re.escape(n) for n in {name, name.replace("_", "-")})
    pattern = re.compile(rf"(?<![\w-])(?:--)?(?:{forms})(?![\w-])")
    return sorted(path for path, text in texts.items() if pattern.search(text))


def _sources() -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text() for p in SRC.rglob("*.py")}


def test_each_option_is_spelled_in_few_modules():
    texts = _sources()
    bounds = {**BATCH_ARITHMETIC, **OVER_TARGET}
    over, stale = [], []
    for name in sorted(option_names()):
        where = spelling_modules(name, texts)
        bound = bounds.get(name, TARGET)
        if len(where) > bound:
            over.append(f"{name}: {len(where)} modules > {bound} ({', '.join(where)})")
        if name in OVER_TARGET and len(where) <= TARGET:
            stale.append(f"{name}: {len(where)} modules, at the target: remove it from OVER_TARGET")
    assert over == [], "an option is spelled in more modules than stated:\n" + "\n".join(over)
    assert stale == [], "\n".join(stale)
    assert not set(bounds) - option_names(), "a bound names no option field any more"


def test_the_spelling_counter_finds_every_form():
    """Negative control: the name, its flag form and nothing longer or shorter."""
    texts = {
        "a.py": "x = cfg.tiled_mlp_num_shards",
        "b.py": "parser.add_argument('--tiled-mlp-num-shards')",
        "c.py": "tiled_mlp_num_shards_max = 1; my_tiled_mlp_num_shards = 2",
        "d.py": "tiled_mlp = True",
    }
    assert spelling_modules("tiled_mlp_num_shards", texts) == ["a.py", "b.py"]
    assert spelling_modules("tiled_mlp", texts) == ["d.py"]


def test_plan_request_carries_settings_not_their_names():
    """``PlanRequest`` declares no option of ``Settings`` again: its fields are what the request
    alone says, its ``settings``, and the search's per-layout choices (``PER_LAYOUT``)."""
    request = {f.name for f in fields(PlanRequest)}
    settings = {f.name for f in fields(Settings)}
    assert request - settings == REQUEST_ONLY
    assert request & settings == set(PER_LAYOUT)


def test_a_request_takes_each_option_by_its_name():
    from ndparallel.plan.hardware import get_preset
    from ndparallel.plan.models import PRESETS

    options = dict(
        seq_len=8192,
        mixed_precision="fp16",
        sequence_parallel=False,
        loss_parallel=False,
        cp_strategy="ulysses",
        loss_impl="full",
        loss_chunk_tokens=1024,
        lora_r=8,
        lora_saved=("embed",),
        tiled_mlp=True,
        tiled_mlp_num_shards=3,
        activation_offloading=True,
    )
    req = PlanRequest.of(PRESETS["llama-3.1-8b"], get_preset("h100-80gb"), 8, micro_batch=2, **options)
    assert {n: getattr(req.settings, n) for n in options} == options
    assert req.micro_batch == 2 and req.settings.micro_batch == 1  # the search's choice is the request's
    assert req.updated(seq_len=1024).settings == replace(req.settings, seq_len=1024)
    s = base_settings(req.updated(unsharded_grad_accumulation=True))
    assert s == replace(req.settings, unsharded_grad_accumulation=True)
    assert not base_settings(PlanRequest(req.model, req.hardware, 8)).unsharded_grad_accumulation  # auto: off

"""The resolved run as ``ndparallel train --dry-run`` prints it: layout, model, batch, precision,
speed options, steps, what each dataset is read as, and the notes said before launch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ndparallel.config import TrainConfig
from ndparallel.models.moe import config_num_experts
from ndparallel.plan.hardware import GiB
from ndparallel.preflight.host_memory import offloaded
from ndparallel.preflight.installed import tracker_extras
from ndparallel.preflight.pipeline_check import pipeline_summary
from ndparallel.runtime.extras import install_line
from ndparallel.techniques.tile_rule import tile_split
from ndparallel.tracking.credentials import tracker_problem


def describe_plan(
    cfg: TrainConfig,
    pc,
    hf,
    notes: Sequence[str] = (),
    summaries: Mapping[str, str] | None = None,
    meta=None,
) -> str:
    """The resolved run, as printed by ``--dry-run``: ``pc`` and ``hf`` as the checks resolved them,
    ``notes``, ``summaries`` and the meta model (``meta``) theirs (``checks.run_checks``; the
    max_steps note is said by the steps line; a summary not given is asked of its check here)."""
    from ndparallel.preflight.dry_checks import chunked_loss_state, qat_summary
    from ndparallel.preflight.model_check import check_adapter
    from ndparallel.preflight.qlora_check import check_quantized_base

    said = summaries or {}
    gbs = cfg.micro_batch_size * cfg.gradient_accumulation_steps * pc.dp_size
    lines = [
        f"layout       : {pc.describe()}  ({pc!r})",
        f"model        : {cfg.base_model}{f' @ {cfg.revision_of_model}' if cfg.revision_of_model else ''} "
        f"({hf.model_type}, {getattr(hf, 'num_hidden_layers', '?')} layers, hidden "
        f"{getattr(hf, 'hidden_size', '?')}, heads {getattr(hf, 'num_attention_heads', '?')}/"
        f"{getattr(hf, 'num_key_value_heads', '?')})",
        f"global batch : {gbs} sequences × {cfg.sequence_len} tokens = {gbs * cfg.sequence_len} tokens/step "
        f"(micro {cfg.micro_batch_size} × accum {cfg.gradient_accumulation_steps} × dp {pc.dp_size})",
        f"per rank     : {cfg.micro_batch_size} × {cfg.sequence_len // pc.cp_size} tokens per micro-batch"
        + (f" (sequence split over cp={pc.cp_size})" if pc.cp_enabled else ""),
        *_experts_lines(pc, hf),
        *([f"pipeline     : {pipeline_summary(cfg, pc, hf)}"] if pc.pp_enabled else []),
        f"fsdp         : {cfg.fsdp_config.model_dump()}",
        f"precision    : {_precision(cfg)}" + (f", fp8 linears ({cfg.fp8_recipe})" if cfg.fp8 else ""),
        f"speed        : chunked loss {chunked_loss_state(cfg, hf, meta)}, "
        f"compile {'on' if cfg.compile else 'off'}"
        + (f", loss parallel {_auto(cfg.loss_parallel)}" if pc.tp_enabled else ""),
        *(
            [f"adapter      : {said.get('adapter') or check_adapter(cfg, hf, pc.tp_size)}"]
            if cfg.adapter
            else []
        ),
        *(
            [f"quantised    : {said.get('quantised') or check_quantized_base(cfg, hf, pc)}"]
            if cfg.load_in_4bit
            else []
        ),
        *([f"qat          : {qat_summary(cfg)}"] if cfg.qat is not None else []),
        *([f"tp plan      : {_tp_plan_summary(cfg, hf, meta)}"] if pc.tp_enabled else []),
        *(
            [f"long context : {_long_context(cfg, pc, hf)}"]
            if cfg.tiled_mlp or cfg.activation_offloading
            else []
        ),
        f"steps        : {_steps(cfg)}; lr {cfg.learning_rate} "
        f"({cfg.lr_scheduler}, warmup "
        f"{cfg.warmup_steps if cfg.warmup_ratio is None else f'ratio {cfg.warmup_ratio:g}'})",
        f"data         : {_data_mode(cfg)}",
        *_datasets_read_as(cfg, pc.dims),
        f"output       : {cfg.output_dir}",
    ]
    lines += [f"note         : {n}" for n in notes if not n.startswith("max_steps")]

    trackers = cfg.trackers()
    if trackers:
        problem, missing = tracker_problem(cfg), install_line(tracker_extras(trackers))
        lines.insert(
            -1,
            f"trackers     : metrics.jsonl + {', '.join(trackers)}"
            + (f" ({missing})" if missing else "")
            + (f" (train would refuse here: {problem})" if problem else ""),
        )
    return "\n".join(lines)


def _experts_lines(pc, hf) -> list[str]:
    """The experts' placement of a mixture-of-experts model (``--dry-run``)."""

    experts = config_num_experts(hf)
    if experts is None:
        return []
    dims = pc.dims
    top_k = getattr(hf, "num_experts_per_tok", "?")
    where = (
        f"split over ep={dims.ep} ({experts // dims.ep} per rank, all-to-all dispatch), FSDP over "
        f"efsdp={dims.efsdp}"
        if dims.experts_split(True)
        else "sharded with the dense layers (FSDP)"
    )
    aux = getattr(hf, "router_aux_loss_coef", None) if getattr(hf, "output_router_logits", False) else None
    return [
        f"experts      : {experts} per MoE layer, top-{top_k}; {where}; load-balancing loss "
        + (f"× {aux} (global over the micro-batch)" if aux is not None else "off (output_router_logits)")
    ]


def _tp_plan_summary(cfg: TrainConfig, hf, meta) -> str:
    """How many plan entries shard which modules, and the entries that match none (dropped)."""
    from ndparallel.models.tp_plans import match_plan, resolve_tp_plan, unmatched_keys
    from ndparallel.preflight.model_check import shared_meta_model

    model = shared_meta_model(cfg, hf, meta)
    plan = resolve_tp_plan(model, cfg.tp_plan)
    dropped = unmatched_keys(model, plan)
    return (
        f"{len(plan)} entries ({'tp_plan' if cfg.tp_plan else 'the model' + chr(39) + 's own'}) on "
        f"{len(match_plan(model, plan, strict=False))} modules"
        + (f"; matching no module (dropped): {dropped}" if dropped else "")
    )


def _long_context(cfg: TrainConfig, pc, hf) -> str:
    """The memory options and what they hold per rank (docs/long_context.md)."""
    parts, hf = [], hf.get_text_config()
    if cfg.tiled_mlp:
        row = cfg.sequence_len // pc.cp_size // (pc.tp_size if cfg.sequence_parallel else 1)
        tiles, tile = tile_split(row, hf.hidden_size, cfg.tiled_mlp_num_shards)
        parts.append(f"tiled MLP ({tiles} tiles of ≤ {tile} tokens per row) and lean RMSNorms")
    if cfg.activation_offloading:
        parts.append(_offloading(cfg, pc, hf))
    return ", ".join(parts)


def _offloading(cfg: TrainConfig, pc, hf) -> str:
    """What offloading keeps in host memory, per rank at its peak (``host_memory.offloaded``)."""
    found = offloaded(cfg, pc, hf)
    if found is None:
        return "activation offloading (host memory not estimated: a model the planner cannot read)"
    what = (
        "layers' selective saved tensors but down_proj's output"
        if found.selective
        else "checkpointed layer inputs"
    )
    rank = "the first pipeline rank" if pc.pp_size > 1 else "each rank"
    return (
        f"activation offloading ({found.layers} {what}: {found.host_bytes / GiB:.2f} GiB of pinned host "
        f"memory on {rank} at its peak, {found.in_flight:.3g} micro-batch(es) in flight; the planner's)"
    )


def _datasets_read_as(cfg: TrainConfig, dims) -> list[str]:
    """Per dataset: the format it is read as and what it trains (``data/describe.py``), then its
    first trained sample, masked part marked, where its file and the tokenizer are on this machine
    (``data/first_sample.py``: one record read, nothing cached); the expected padded share of the
    computed tokens (``preflight/padding.py``)."""
    from ndparallel.data.dataset import DatasetSpec
    from ndparallel.data.describe import read_as

    if cfg.pretraining_dataset is not None or not cfg.datasets:
        return []
    from ndparallel.preflight.padding import local_tokenizer

    lines, tokenizer = [], local_tokenizer(cfg)
    for i, d in enumerate(cfg.datasets):
        where = f"datasets[{i}]"
        try:
            spec = DatasetSpec.from_any(d.model_dump(), where)
        except ValueError as e:
            lines.append(f"dataset      : {where}: refused by train: {e}")
            continue
        lines.append(f"dataset      : {read_as(spec, where, bool(cfg.train_on_inputs))}")
        lines.append(f"first sample : {where}: {_first_sample(cfg, spec, where, tokenizer)}")
    lines.append(f"padding      : {_padding(cfg, dims, tokenizer)}")
    return [*lines, "more samples : masked part marked: ndparallel preprocess CONFIG --show 4"]


def _padding(cfg: TrainConfig, dims, tokenizer) -> str:
    from ndparallel.preflight.padding import expected_padding

    if isinstance(tokenizer, str):
        return f"not estimated ({tokenizer})"
    try:
        return expected_padding(cfg, dims, tokenizer)
    except (ValueError, OSError, KeyError, TypeError) as e:  # the data's own errors: said above
        return f"not estimated: {' '.join(str(e).split())[:200]}"


def _first_sample(cfg: TrainConfig, spec, where: str, tokenizer) -> str:
    from ndparallel.data.first_sample import NotShown, first_sample

    if spec.raw:
        return "raw text, every token trained"
    if isinstance(tokenizer, str):
        return f"not shown here ({tokenizer}; `ndparallel preprocess CONFIG --show 1` where it is)"
    try:
        return first_sample(spec, where, tokenizer, cfg.data_options())
    except NotShown as e:
        return f"not shown ({e})"
    except (ValueError, OSError, KeyError, TypeError) as e:  # train refuses or names it: preprocess says how
        return f"not shown: {' '.join(str(e).split())[:300]}"


def _data_mode(cfg: TrainConfig) -> str:
    from ndparallel.data.dataset import DatasetSpec
    from ndparallel.data.prepare import concatenates

    if cfg.pretraining_dataset is not None:
        how = "attention per document" if cfg.sample_packing else "attention across documents"
        return (
            f"pretraining_dataset: streamed while training, documents concatenated and cut into "
            f"{cfg.sequence_len}-token blocks ({how}); every rank reads the stream"
        )
    specs = [DatasetSpec.from_any(d.model_dump()) for d in cfg.datasets]
    types = ", ".join(sorted({s.type or "text" for s in specs}))
    if concatenates(specs, cfg.sample_packing):
        return f"{types}: documents concatenated and cut into {cfg.sequence_len}-token blocks"
    how = "packed several per row (attention per sample)" if cfg.sample_packing else "one per row"
    if cfg.sample_packing and cfg.sample_packing_order == "multipack":
        fit = "next fit" if cfg.sample_packing_sequentially else "first fit"
        how = how.replace(
            "several per row", f"several per row each epoch ({fit} in the draw's order: Axolotl's multipack)"
        )
    elif cfg.sample_packing and cfg.sample_packing_sequentially:
        how = how.replace("several per row", "several per row in dataset order")
    masked = "every token trained" if cfg.train_on_inputs else "prompt tokens masked (-100)"
    pad = (
        "padded to sequence_len"
        if cfg.pads_to_sequence_len()
        else "each micro-batch cut after its longest row"
    )
    order = [
        *(["exact duplicates dropped"] if cfg.dataset_exact_deduplication else []),
        "rows in dataset order (curriculum_sampling)"
        if cfg.curriculum_sampling
        else "rows shuffled each epoch",
    ]
    return f"{types}: whole samples, {how}, {masked}, {pad}, {', '.join(order)}"


def _steps(cfg: TrainConfig) -> str:
    if cfg.max_steps is None:
        return f"{cfg.num_epochs:g} epochs"
    if "num_epochs" in cfg.model_fields_set:
        return f"max_steps {cfg.max_steps} (num_epochs {cfg.num_epochs:g} is ignored: max_steps wins)"
    return f"max_steps {cfg.max_steps}"


def _auto(flag: bool | None) -> str:
    return "auto (on where exact)" if flag is None else ("on" if flag else "off")


def _precision(cfg) -> str:
    name = cfg.compute_dtype_name()
    if name == "fp16":
        return (
            f"fp16 compute, fp32 master weights, dynamic loss scaling (from {cfg.loss_scale_init:g}, x2 "
            f"after "
            f"{cfg.loss_scale_growth_interval} finite steps, /2 and the step skipped on an overflow; one "
            f"host "
            "read per step)"
        )
    return "bf16 compute, fp32 master weights" if name == "bf16" else "fp32"

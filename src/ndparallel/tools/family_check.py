"""Before ``ndparallel train`` launches a model family the test suite has not trained on every layout
(``models.families.TESTED_FAMILIES``): train a shrunk copy of it (``tools.shrink``) under the run's
layout, each enabled dimension at size 2, and on one process, 2 SGD steps on rows packed with
several documents; the two must agree (losses and gradient norms to 1e-5 relative, parameters to
1e-6). Seconds on CPU ranks. An unknown family that the layout would train differently (or that
fails under it) is then refused with one line instead of silently training another model."""

from __future__ import annotations

import dataclasses

from ndparallel.models.families import TESTED_FAMILIES, is_tested_family
from ndparallel.runtime.multirank import RankFailure, run_on_ranks
from ndparallel.tools.agreement import reference_in_rank, verdict
from ndparallel.tools.equivalence import TrainSetup, train_under_layout
from ndparallel.tools.shrink import shrink_model


def shrunk_layout(pc) -> dict[str, int]:
    """The run's layout with each dimension it uses at size 2 (data-parallel replicas folded into
    FSDP: they change no family-specific code path)."""
    layout = {}
    if pc.dp_shard_size > 1 or pc.dp_replicate_size > 1:
        layout["dp_shard_size"] = 2
    if pc.tp_size > 1:
        layout["tp_size"] = 2
    if pc.cp_size > 1:
        layout["cp_size"] = 2
    if getattr(pc, "ep_size", 1) > 1:  # divides the shrunk dp_shard·cp·tp (a power of 2 >= 2)
        layout["ep_size"] = 2
    return layout


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    last = next((line for line in reversed(text) if line.strip() and not line.startswith(" ")), str(error))
    return " ".join(last.split())[:400]


def family_check(cfg, pc, hf) -> str | None:
    """None when ``hf``'s family is tested or its shrunk layout trains like one process; else the
    reason, one line. Forks CPU ranks: call it from a process without a process group."""
    if is_tested_family(hf):
        return None
    layout = shrunk_layout(pc)
    if not layout:
        return None

    name = getattr(hf.get_text_config() if hasattr(hf, "get_text_config") else hf, "model_type", "?")
    world = 1
    for v in layout.values():
        world *= v
    small = shrink_model(hf, layout.get("tp_size", 1), layout.get("cp_size", 1), layout.get("ep_size", 1))
    setup = TrainSetup(
        small.config,
        steps=2,
        global_micro_batch=2 * layout.get("dp_shard_size", 1),
        seq_len=16 * layout.get("cp_size", 1) * layout.get("tp_size", 1),
        optimizer="sgd",
        lr=0.1,
        packed_documents=True,
        parallel_kwargs=dict(
            fsdp_options=cfg.fsdp_options(),
            activation_options=cfg.activation_options(),
            tp_options=cfg.tp_options(),
            cp_options=cfg.cp_options(),
        ),
    )
    where = (
        f"model_type {name!r} is not among the families tested on every layout "
        f"({len(TESTED_FAMILIES)}: docs/families.md), and a shrunk copy of it"
    )
    try:
        ref = run_on_ranks(reference_in_rank, 1, dataclasses.replace(setup, parallel_kwargs={}))[0]
        got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=600)[0]
    except RankFailure as e:
        return f"{where} fails under this layout ({_one_line(e)}); use another layout, or --skip-family-check"
    result = verdict(ref, got, expect_equal=None)  # a decision: right layouts and faults both reach it
    if not result.ok:
        return (
            f"{where} trains differently under this layout than on one device ({result.line()}): "
            "use another layout (FSDP / data parallel), or --skip-family-check to train anyway"
        )
    return None

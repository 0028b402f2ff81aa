"""``optimizer: muon``: Axolotl's split (Muon for hidden matrices, AdamW for embeddings, head, 1-D),
and the same training on FSDP2, DP x FSDP, FSDP x TP and MoE expert layouts as on one process,
because each matrix is orthogonalised whole; the per-shard version (a negative control) is not.

Equal means the project's one rule (``tools.agreement``, docs/testing.md): Newton–Schulz runs in
fp32 here (``ns_dtype``) and is a smooth function of the normalised matrix, so the runs differ only
by the gradients' summation order, which the one-process reference's second way measures: no factor
of its own (measured 2026-12-06: ≤ 0.11 of the bound on the default MKL path and
``MKL_CBWR=COMPATIBLE``), while orthogonalising shards instead fails it ~3,000x. AdamW's eps is 1e-4
in these runs so that the AdamW-updated embeddings are compared as tightly (at 1e-8, fp32 noise on
their near-zero gradients becomes ~lr/10 steps, as in every AdamW layout test). With the default
bf16 NS (Axolotl's, torch's) layouts agree only to bf16 rounding (matrices ~6e-4 apart after 3 steps
at lr 1e-2 on FSDP 2)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_differs, assert_matches, model_floor, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, train_under_layout

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ckpt_train  # noqa: E402

SETUP = TrainSetup(
    preset_config("tiny-llama"),
    steps=3,
    global_micro_batch=4,
    seq_len=32,
    optimizer="muon",
    lr=1e-2,
    weight_decay=0.01,
    optimizer_options={"ns_dtype": torch.float32, "eps": 1e-4},
)
MOE = dataclasses.replace(SETUP, model_config=preset_config("tiny-qwen3-moe"))
MUON = {"optimizer": "muon", "optimizer_options": SETUP.optimizer_options}
ADAMW_NAMES = ("embed_tokens", "lm_head", "norm")


def _reference(setup: TrainSetup):
    return one_process_reference(setup)


def _matrix_diff(ref, got) -> tuple[float, float]:
    """Largest parameter difference over the Muon matrices, and over the AdamW parameters."""
    muon = [k for k in ref.params if not any(n in k for n in ADAMW_NAMES)]
    rest = [k for k in ref.params if k not in muon]
    assert muon and rest
    diff = {k: (ref.params[k] - got.params[k]).abs().max().item() for k in ref.params}
    return max(diff[k] for k in muon), max(diff[k] for k in rest)


def test_split_follows_axolotl():
    """Hidden matrices (and MoE experts, routers) -> Muon with decay; embeddings, head, norms -> AdamW
    without."""
    from transformers import AutoModelForCausalLM

    from ndparallel.optim.build import build_optimizer

    for preset in ("tiny-llama", "tiny-llama-tied", "tiny-qwen3-moe"):
        model = AutoModelForCausalLM.from_config(preset_config(preset))
        opt = build_optimizer(model, "muon", lr=0.02, weight_decay=0.01)
        names = {id(p): n for n, p in model.named_parameters()}
        got = {
            g["algorithm"]: ({names[id(p)] for p in g["params"]}, g["weight_decay"]) for g in opt.param_groups
        }
        adamw, muon = got["adamw"][0], got["muon"][0]
        assert got["muon"][1] == 0.01 and got["adamw"][1] == 0.0
        assert {n for n in names.values() if "embed_tokens" in n or "norm" in n} <= adamw
        assert not any("embed" in n or "lm_head" in n or "norm" in n for n in muon)
        assert "model.layers.0.self_attn.q_proj.weight" in muon and len(muon | adamw) == len(names)
        if preset == "tiny-qwen3-moe":
            assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"} <= muon
    with pytest.raises(ValueError, match="needs the model"):
        build_optimizer(model.parameters(), "muon")


def test_newton_schulz_orthogonalises_each_expert_matrix():
    from ndparallel.optim.muon import newton_schulz

    g = torch.randn(3, 48, 32, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(g, torch.float32)
    assert torch.allclose(out[1], newton_schulz(g[1], torch.float32), atol=1e-6)  # batched = one by one
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.5 and s.max() < 1.3, s  # singular values pulled to ~1 (NS's approximate U V^T)


@pytest.mark.parametrize(
    "layout,world",
    [
        ({"dp_shard_size": 2}, 2),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4),
        ({"dp_shard_size": 2, "tp_size": 2}, 4),
    ],
    ids=["fsdp2", "dp2xfsdp2", "fsdp2xtp2"],
)
def test_layouts_equal_one_process(layout, world):
    ref = _reference(SETUP)
    got = run_on_ranks(train_under_layout, world, SETUP, layout)[0]
    assert_matches(ref, got)  # losses, grad norms, every parameter (Muon matrices and AdamW ones)
    assert ref.result.losses[-1] < ref.result.losses[0]


def test_per_shard_orthogonalisation_differs():
    """The negative control: Newton–Schulz on each rank's shard (torch.optim.Muon on local tensors)."""
    ref = _reference(SETUP)
    got = run_on_ranks(
        train_under_layout, 2, dataclasses.replace(SETUP, fault="per-shard-muon"), {"dp_shard_size": 2}
    )[0]
    muon, _ = _matrix_diff(ref.result, got)
    assert muon > 1e-3, muon  # the Muon matrices move (measured 9e-3)
    assert assert_differs(ref, got).ratios["loss_rel"] > 1, "the losses too"


def test_moe_experts_under_expert_parallel_and_fsdp():
    """Expert weights (E, out, in): each expert matrix orthogonalised on its own; EP shards the
    expert dim (whole matrices per rank, nothing gathered), FSDP the rest."""
    ref = _reference(MOE)
    got = run_on_ranks(train_under_layout, 2, MOE, {"dp_shard_size": 2, "ep_size": 2})[0]
    assert_matches(ref, got)


def test_checkpoint_resumes_on_another_layout(tmp_path):
    """FSDP 2 saves Muon's momentum (sharded DTensors) and AdamW's moments after step 2; FSDP x TP
    resumes to step 4: its losses equal an uninterrupted one-process run's (fp32 NS, as above)."""
    ref = run_on_ranks(ckpt_train.train, 1, {}, str(tmp_path / "ref"), **MUON)[0]
    run_on_ranks(
        ckpt_train.train, 2, {"dp_shard_size": 2}, str(tmp_path / "run"), save_every=1, stop_after=2, **MUON
    )
    from ndparallel.checkpoint.io import read_dcp_metadata

    keys = list(read_dcp_metadata(tmp_path / "run" / "checkpoint-2").state_dict_metadata)
    assert any("momentum_buffer" in k and "q_proj" in k for k in keys), keys[:20]
    assert any("exp_avg" in k and "embed_tokens" in k for k in keys) and not any(
        "momentum_buffer" in k and "embed_tokens" in k for k in keys
    )
    resumed = run_on_ranks(
        ckpt_train.train, 4, {"dp_shard_size": 2, "tp_size": 2}, str(tmp_path / "run"), resume=True, **MUON
    )[0]
    assert sorted(resumed["losses"]) == [3, 4]
    # The rule's loss bound for this model and optimizer (measured on SETUP's 3 steps), its fp32
    # floor taken over the 4 steps here: a resume on another layout reorders sums, nothing more.
    bound = max(_reference(SETUP).bounds.limits["loss_rel"], model_floor(SETUP.model_config, 4))
    for step in (3, 4):
        rel = abs(resumed["losses"][step] - ref["losses"][step]) / abs(ref["losses"][step])
        print(f"step {step}: loss {rel:.1e} of bound {bound:.1e}")
        assert rel <= bound, (step, rel, bound, resumed, ref)


def test_planner_states_one_momentum_for_matrices_two_moments_for_the_rest():
    """70B on FSDP 8 x TP 2: Muon's states = 4 B x every parameter + 4 B more on the embedding and
    head units (AdamW's second moment); its step gathers the largest hidden matrix whole."""
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.hardware import PRESETS as HW
    from ndparallel.plan.memory.peak import estimate_memory
    from ndparallel.plan.models import PRESETS, fsdp_units
    from ndparallel.plan.muon_cost import newton_schulz_seconds, step_temporaries
    from ndparallel.plan.settings import Settings
    from ndparallel.plan.time.comms import unit_numels

    model, layout, hw = PRESETS["llama-3.1-70b"], ParallelDims(dp_shard=8, tp=2), HW["h100-80gb"]
    mem = {
        o: estimate_memory(model, layout, Settings(sequence_len=4096, optimizer=o), hw).optimizer
        for o in ("adamw", "muon", "sgd")
    }
    numels = unit_numels(model, layout.tp, layout.fsdp, layout)
    edge = sum(numels[u][1] * c for u, (c, _) in fsdp_units(model).items() if u in ("embed", "final"))
    assert mem["muon"] == pytest.approx(mem["adamw"] / 2 + 4 * edge)
    assert step_temporaries(model, layout) == 16 * 8192 * 28672  # the MLP matrix, whole
    # Newton-Schulz repeated on every rank: ~1.3e16 FLOPs per step at 70B (seconds on an H100)
    assert 10 < newton_schulz_seconds(model, layout, hw) < 30

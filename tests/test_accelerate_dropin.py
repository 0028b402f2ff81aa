"""Accelerate's own ND-parallel scripts (our copies under tests/accelerate_scripts/, written to the
same API, only the imports changed) run on CPU ranks and train exactly what our own loop trains
on one process: Accelerate's ``nd_parallel.py`` loop on FSDP×CP, HSDP, TP and FSDP×CP×TP.

Equal: the losses within the project's rule's fp32 floor (``agreement.model_floor``: log2(n) ulp
per step, n the parameter count); these loops have no second way to measure a noise above it."""

import json
import os
import warnings

import pytest
import torch

from accelerate_scripts import nd_parallel
from accelerate_scripts.reference import reference_losses
from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import model_floor

SEQ, STEPS, LR = 32, 3, 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(preset_config("tiny-llama")).save_pretrained(path)
    return str(path)


_refs: dict = {}


def _reference(model_dir, dp, micro=1):
    key = (dp, micro)
    if key not in _refs:
        _refs[key] = run_on_ranks(reference_losses, 1, model_dir, SEQ, dp, STEPS, LR, micro)[0]
    return _refs[key]


def _close(ref, got):
    return max(abs(a - b) / abs(a) for a, b in zip(ref, got)) <= model_floor(
        preset_config("tiny-llama"), len(ref)
    )


def _nd_parallel(argv):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nd_parallel.main(argv)


def _run_nd(model_dir, out_dir, layout: dict, *extra):
    world = 1
    argv = [
        "--model-name",
        model_dir,
        "--sequence-length",
        str(SEQ),
        "--num-steps",
        str(STEPS),
        "--save-dir",
        str(out_dir),
        "--dtype",
        "float32",
        "--mixed-precision",
        "no",
        "--learning-rate",
        str(LR),
        "--checkpoint-frequency",
        "2",
        *extra,
    ]
    for name, size in layout.items():
        argv += [f"--{name.replace('_', '-')}", str(size)]
        world *= size
    return run_on_ranks(_nd_parallel, world, argv, timeout_s=400)


@pytest.mark.parametrize(
    "layout",
    [
        {"dp_shard_size": 2, "cp_size": 2},
        {"dp_replicate_size": 2, "dp_shard_size": 2},
        {"tp_size": 2},
    ],
    ids=["fsdp2xcp2", "hsdp2x2", "tp2-transformers"],
)
def test_nd_parallel_script_equals_our_loop(model_dir, tmp_path, layout):
    results = _run_nd(model_dir, tmp_path, layout)
    dp = layout.get("dp_replicate_size", 1) * layout.get("dp_shard_size", 1)
    ref = _reference(model_dir, dp)
    assert all(r == results[0] for r in results), results  # every rank reports the same loss
    assert _close(ref, results[0]), (ref, results[0])
    # the script's own outputs: consolidated model, tracker file, (FSDP) checkpoint
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    lines = (tmp_path / "nd_parallel_training" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in lines] == pytest.approx(results[0])
    if layout.get("dp_shard_size", 1) > 1:
        assert (tmp_path / "checkpoint-2" / "COMPLETE").is_file()


@pytest.mark.slow
def test_nd_parallel_script_fsdp_cp_tp_8_ranks(model_dir, tmp_path):
    layout = {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2}
    results = _run_nd(model_dir, tmp_path, layout, "--no-transformers-tp")
    assert _close(_reference(model_dir, 2), results[0]), results[0]


def test_nd_parallel_script_reference_check_can_fail(model_dir, tmp_path):
    """Negative control: a different learning rate (a different training) fails the comparison."""
    results = _run_nd(model_dir, tmp_path, {"dp_shard_size": 2}, "--learning-rate", str(LR * 1.01))
    assert not _close(_reference(model_dir, 2), results[0])


# ------------------------------------------------------------------ the blog's snippet
def _blog(model_dir, sizes, save_dir):
    from accelerate_scripts import blog_snippet

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return blog_snippet.run(model_dir, sizes, save_dir, STEPS, SEQ, LR, grad_accum=2)


def _check_blog(model_dir, tmp_path, sizes):
    from safetensors.torch import load_file

    world = 1
    for v in sizes.values():
        world *= v
    got = run_on_ranks(_blog, world, model_dir, sizes, str(tmp_path), timeout_s=400)[0]
    dp = sizes.get("dp_replicate_size", 1) * sizes.get("dp_shard_size", 1)
    key = ("params", dp)
    if key not in _refs:
        _refs[key] = run_on_ranks(reference_losses, 1, model_dir, SEQ, dp, STEPS, LR, 2, True)[0]
    ref_losses, ref_params = _refs[key]
    assert _close(ref_losses, got), (ref_losses, got)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) <= set(ref_params) and len(saved) >= len(ref_params) - 1  # tied lm_head once
    assert max((saved[k] - ref_params[k]).abs().max().item() for k in saved) <= 1e-6


def test_blog_snippet_hsdp_with_accumulation(model_dir, tmp_path):
    _check_blog(model_dir, tmp_path, {"dp_replicate_size": 2, "dp_shard_size": 2})


@pytest.mark.slow
def test_blog_snippet_fsdp_cp_tp_8_ranks(model_dir, tmp_path):
    _check_blog(model_dir, tmp_path, {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2})


# ---------------------------------------------------------------- the CP guide's loop
def _cp_guide(model_dir, local_positions=False, strategy="alltoall"):
    from accelerate_scripts import cp_guide

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cp_guide.run(
            model_dir,
            {"dp_shard_size": 2, "cp_size": 2},
            STEPS,
            SEQ,
            LR,
            strategy=strategy,
            local_positions=local_positions,
        )


@pytest.mark.parametrize("strategy", ["alltoall", "allgather"])
def test_cp_guide_loop_without_position_ids_equals_our_loop(model_dir, strategy):
    got = run_on_ranks(_cp_guide, 4, model_dir, False, strategy)[0]
    assert _close(_reference(model_dir, 2), got), got


def test_cp_guide_positions_matter(model_dir):
    """Negative control: each shard's local positions (what the model would compute without the
    global ones) give a different loss, so the test above can fail."""
    got = run_on_ranks(_cp_guide, 4, model_dir, True)[0]
    assert not _close(_reference(model_dir, 2), got)


# ------------------------------------------- the real Accelerate, where it runs: one process
def _both_accelerators(logdir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import gpu_accelerate_compat as compat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {w: compat.run(w, "no", os.path.join(logdir, w)) for w in ("accelerate", "ndparallel")}


def test_same_loop_as_hugging_face_accelerate_on_one_process(tmp_path):
    """Accelerate's own Accelerator refuses ND layouts on CPU, but runs one process: the same loop
    (gradient accumulation, prepared optimizer + LR scheduler, trackers, get_state_dict +
    save_pretrained) gives the same losses, learning rate and saved model with both."""
    pytest.importorskip("accelerate")
    out = run_on_ranks(_both_accelerators, 1, str(tmp_path), timeout_s=400)[0]
    (la, lr_a, na), (ln, lr_n, nn_) = out["accelerate"], out["ndparallel"]
    assert _close(la, ln) and lr_a == lr_n and na == nn_, out

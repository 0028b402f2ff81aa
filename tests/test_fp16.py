"""fp16 mixed precision: fp32 master weights, fp16 compute, dynamic loss scaling whose overflow
decision is the same on every rank (``engine/loss_scale.py``, ``docs/precision.md``).

Equal means the project's one rule (``tools.agreement``, docs/testing.md). fp16 compute is not
bit-exact across layouts: each rank rounds its partial weight gradients (a sum over its own rows) to
fp16 before the fp32 reduction, so the layout changes which partial sums are rounded. The
one-process reference's second ways measure that rounding in this very setup, no factor of its own:
its rows reversed, and (fp16 only) its rows as two accumulated micro-batches, which rounds two
partial sums as FSDP 2 does — on ATen's unvectorised path the reversed rows alone measured 10x less
than FSDP 2's difference (grad norm 2.9e-6 against 3.3e-5: 1.5x the bound, 2026-12-06). Measured
with both: FSDP 2 / DP 2 × FSDP 2 at ≤ 0.13 of the bound on the default, ATen default / avx2 and
``MKL_CBWR=COMPATIBLE`` paths; the gradient all-reduce skipped under fp16 fails it 110-3,800x.
"""

import dataclasses
import json

import pytest
import torch

import faults
from ndparallel.axolotl import ConfigError, load_config
from ndparallel.engine.loss_scale import LossScaler
from ndparallel.engine.nonfinite import NonFiniteError
from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_differs, assert_matches, one_process_reference
from ndparallel.tools.equivalence import (
    TrainResult,
    TrainSetup,
    build_model,
    compare,
    make_global_batches,
    train_under_layout,
)

# init scale 2^10: the tiny model's first step overflows fp16 at torch's default 2^16 (its LM-head
# gradient sums ~115 tokens), which the overflow test covers on purpose; here every step applies.
FP16 = TrainSetup(
    preset_config("tiny-llama"),
    steps=3,
    global_micro_batch=4,
    seq_len=32,
    optimizer="sgd",
    lr=0.5,
    mixed_precision="fp16",
    loss_scale={"init_scale": 2.0**10},
)
FSDP2 = {"dp_shard_size": 2}
_ref: dict = {}


def reference():
    """The one-process fp16 run with its bounds (``agreement.one_process_reference``, memoised)."""
    return one_process_reference(FP16)


@pytest.mark.parametrize(
    "layout, world",
    [(FSDP2, 2), ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4)],
    ids=["fsdp2", "dp2_fsdp2"],
)
def test_fp16_layouts_train_as_one_process(layout, world):
    ref = reference()
    got = run_on_ranks(train_under_layout, world, FP16, layout)[0]
    assert_matches(ref, got)
    assert ref.result.loss_scales == got.loss_scales == [2.0**10] * 3  # no overflow, no growth yet
    # the fp16 run is not the fp32 one (the casts happen): fp16 rounding is visible in the loss
    fp32 = _ref.setdefault(
        "fp32", run_on_ranks(train_under_layout, 1, dataclasses.replace(FP16, mixed_precision="no"), None)[0]
    )
    assert compare(fp32, ref.result)["loss_rel"] > 1e-6


def test_the_fp16_check_can_fail(monkeypatch):
    """Negative control: FSDP 2 under fp16 without the gradient reduction is far outside the bounds."""
    reference()  # before the fault (one process: no gradient to reduce either way)
    faults.skip_grad_sync(monkeypatch)
    bad = run_on_ranks(train_under_layout, 2, FP16, FSDP2)[0]
    assert_differs(reference(), bad)


def test_an_overflow_on_one_rank_skips_that_step_on_every_rank():
    """An inf in the last rank's gradient shard at step 2 (a rank-local fp16 overflow): every rank
    skips step 2 and halves the scale; the parameters are those of a run without step 2's batch."""
    ranks = run_on_ranks(train_under_layout, 2, dataclasses.replace(FP16, fault="overflow-step-2"), FSDP2)
    assert [r.loss_scales for r in ranks] == [[1024.0, 512.0, 512.0]] * 2
    assert all(r.grad_norms[1] == float("inf") for r in ranks) and all(
        torch.isfinite(torch.tensor(r.grad_norms[0::2])).all() for r in ranks
    )
    batches = make_global_batches(FP16)
    without = run_on_ranks(
        train_under_layout, 2, dataclasses.replace(FP16, batches=[batches[0], batches[2]], steps=2), FSDP2
    )[0]
    got = ranks[0]
    applied = TrainResult([got.losses[0], got.losses[2]], [got.grad_norms[0], got.grad_norms[2]], got.params)
    # scaled by 512 instead of 1024 at that step: equal up to fp16 subnormals (7.6e-6 measured)
    skipped = dataclasses.replace(FP16, batches=[batches[0], batches[2]], steps=2)
    # = one process without step 2's batch: losses and parameters, as before the rule (the grad norm
    # is taken at another scale here, 512: other fp16 roundings of the scaled gradients)
    assert_matches(one_process_reference(skipped), applied, compared=("loss_rel", "param_abs"))
    assert compare(without, applied)["param_abs"] <= one_process_reference(skipped).bounds.limits["param_abs"]
    # step 2 applied changes them: 50x the bound, as before the rule (measured 99x)
    assert_differs(reference(), got, margin=50, compared=("param_abs",))


def _update_errors(setup, init, fp32) -> float:
    """Largest relative error (vs fp32) of the step's update of the attention q/k projections, whose
    gradients are the smallest of the tiny model (they underflow fp16 without scaling)."""
    run = run_on_ranks(train_under_layout, 1, setup, None)[0]
    keys = [k for k in init if "q_proj" in k or "k_proj" in k]
    return max(
        float((run.params[k] - fp32.params[k]).norm() / (fp32.params[k] - init[k]).norm()) for k in keys
    )


def test_the_scaler_really_scales():
    """Negative control of the scaling: scale 1 (never grown) loses the small gradients to fp16's
    underflow; scale 2^12 keeps them (measured: 4.1e-3 vs 4.1e-4 relative error of the q/k update)."""
    one = dataclasses.replace(FP16, steps=1, global_micro_batch=8, seq_len=64)
    init = {k: v.detach().float() for k, v in build_model(one).named_parameters()}
    fp32 = run_on_ranks(train_under_layout, 1, dataclasses.replace(one, mixed_precision="no"), None)[0]
    unscaled = _update_errors(
        dataclasses.replace(one, loss_scale={"init_scale": 1.0, "growth_interval": 10**9}), init, fp32
    )
    scaled = _update_errors(dataclasses.replace(one, loss_scale={"init_scale": 2.0**12}), init, fp32)
    assert unscaled > 4 * scaled, (unscaled, scaled)


def test_loss_scaler_grows_backs_off_and_stops_at_the_floor():
    s = LossScaler(init_scale=8.0, growth_interval=2, min_scale=2.0)
    one, inf = torch.tensor(1.0), torch.tensor(float("inf"))
    assert s.update(one, 1) and s.scale == 8.0
    assert s.update(one, 2) and s.scale == 16.0  # 2 good steps: doubled
    assert not s.update(torch.tensor(float("nan")), 3) and s.scale == 8.0 and s.good_steps == 0
    state = s.state_dict()
    t = LossScaler(min_scale=2.0)
    t.load_state_dict(state)
    assert (t.scale, t.good_steps, t.skipped) == (8.0, 0, 1)  # the skip count survives a resume
    assert not t.update(inf, 4) and t.scale == 4.0
    assert not t.update(inf, 5) and t.scale == 2.0
    with pytest.raises(NonFiniteError, match="^step 6: the fp16 gradients overflow even at loss scale 2 "):
        t.update(inf, 6)


def test_fp16_config_keys():
    """Axolotl's float16: true (beside fp16: false, as its examples write it) is fp16 mixed precision;
    bf16 with fp16 is refused in one line."""
    cfg = load_config(None, ["float16=true", "fp16=false", "base_model=tiny-llama"])
    assert cfg.fp16 and cfg.strategy_options().param_dtype == torch.float16
    assert any(n.startswith("float16: true -> fp16: true") for n in cfg._axolotl_notes)
    assert cfg.export_dtype() == torch.float16 and cfg.loss_scaler().scale == 2.0**16
    with pytest.raises(ConfigError, match="bf16 and fp16 are both true"):
        load_config(None, ["fp16=true", "bf16=true"])
    with pytest.raises(ConfigError, match="fp8 with fp16 is not supported"):
        load_config(None, ["fp16=true", "fp8=true"])


SMALL = [
    "datasets=[{path: 'builtin:stdlib', max_bytes: 200000}]",
    "tokenizer_vocab_size=512",
    "sequence_len=32",
    "base_model=tiny-llama",
    "dp_shard_size=2",
    "fp16=true",
    "max_steps=4",
    "save_steps=2",
    "save_final_model=false",
    "logging_steps=1",
    "loss_scale_init=1048576",
    "loss_scale_growth_interval=1",
    # QLoRA (Axolotl's openllama-3b/qlora.yml is fp16): a 4-bit NF4 base, fp16 compute, LoRA masters fp32
    "adapter=qlora",
    "load_in_4bit=true",
    "nf4_block_size=32",
    "nf4_scaler_block_size=4",
    "lora_target_linear=true",
]


def _train(overrides):
    from ndparallel.training.trainer import run_training

    torch.compiler.set_stance("force_eager")  # torchao's NF4 ops compile otherwise (~20 s per run here)
    run_training(load_config(None, overrides))
    return True


def _rows(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_trainer_logs_the_scale_and_resume_continues_it(tmp_path):
    """``ndparallel train`` with fp16 (QLoRA on FSDP 2): the scale is logged each log step and saved in
    checkpoints; resuming from step 2 continues with the same scale and losses as the uninterrupted
    run. (2^20 with growth every step: overflows and growth both happen in 4 steps.)"""
    import shutil

    out = tmp_path / "run"
    common = [*SMALL, f"dataset_cache_dir={tmp_path / 'cache'}", f"output_dir={out}"]
    run_on_ranks(_train, 2, common)
    full = _rows(out)
    scales = [r["loss_scale"] for r in full]
    assert len(set(scales)) > 1 and full[-1]["overflow_skips"] >= 1, full
    shutil.rmtree(out / "checkpoint-4")
    (out / "metrics.jsonl").unlink()
    run_on_ranks(_train, 2, [*common, "resume_from_checkpoint=auto"])
    resumed = _rows(out)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [(r["loss"], r["loss_scale"]) for r in resumed] == [(r["loss"], r["loss_scale"]) for r in full[2:]]


def test_the_planner_counts_fp16_as_bf16():
    """Same bytes (2-byte activations and gathered weights, fp32 masters and reductions) and the same
    tensor-core peak; fp32 differs (the control)."""
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.hardware import PRESETS as HW
    from ndparallel.plan.memory.peak import estimate_memory
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.search.evaluation import estimate
    from ndparallel.plan.settings import Settings

    model, hw = PRESETS["tiny"], HW["h100-80gb"]
    got = {
        mp: (
            estimate_memory(
                model, ParallelDims(dp_shard=2, tp=2), Settings(sequence_len=256, mixed_precision=mp), hw
            ),
            estimate(
                model, ParallelDims(dp_shard=2, tp=2), Settings(sequence_len=256, mixed_precision=mp), hw, 8
            ),
        )
        for mp in ("bf16", "fp16", "fp32")
    }
    assert got["fp16"][0] == got["bf16"][0] != got["fp32"][0]
    assert got["fp16"][1].time == got["bf16"][1].time


def _facade(tmp):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.accelerator.handlers import GradScalerKwargs

    acc = Accelerator(
        ParallelismConfig(dp_shard_size=2),
        mixed_precision="fp16",
        kwargs_handlers=[GradScalerKwargs(init_scale=2.0**40, growth_interval=10**9)],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FP16.model_config)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))

    def full():
        return torch.cat([p.detach().full_tensor().flatten().float() for p in model.parameters()])

    def step():
        acc.backward(model(input_ids=x, labels=x).loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return acc.optimizer_step_was_skipped, acc.scaler.scale

    start = full()
    overflowed = step()  # loss x 2^40 overflows fp16 on every rank
    unchanged = bool(torch.equal(full(), start))
    acc.scaler.scale = 2.0**8
    applied = step()
    changed = not torch.equal(full(), start)
    acc.save_state(str(tmp))
    acc.scaler.scale = 1.0
    acc.load_state(str(tmp))
    return overflowed, unchanged, applied, changed, acc.scaler.scale


def test_accelerator_fp16_skips_overflows_and_saves_the_scale(tmp_path):
    """The Accelerate facade: mixed_precision="fp16" scales in backward, unscales in clip_grad_norm_,
    skips an overflowed step on both ranks (parameters unchanged), applies a finite one (they
    change), and save_state / load_state keep the scale."""
    got = run_on_ranks(_facade, 2, tmp_path / "state")
    assert got == [((True, 2.0**39), True, (False, 2.0**8), True, 2.0**8)] * 2

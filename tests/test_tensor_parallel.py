"""Tensor parallel (TP 2, sequence parallel, loss parallel, transformers' own TP path) equals one
process: fp32, 3 AdamW steps, per-step loss (relative) and global grad norm compared under the
project's one rule (``tools.agreement``: this file's own one-process training, run a second time with
every batch's rows reversed, measures the noise; docs/testing.md)."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from ndparallel.models.presets import preset_config
from ndparallel.models.tp_plans import TPPlanError, resolve_tp_plan
from ndparallel.parallel.options import TPOptions
from ndparallel.parallel.tp.tensor import validate_tensor_parallel
from ndparallel.testing import RankFailure, run_on_ranks
from ndparallel.tools.agreement import Reference, assert_differs, assert_matches, measured_bounds
from ndparallel.tools.equivalence import TrainResult

STEPS = 3


def _model(preset: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(preset_config(preset), dtype=torch.float32)


def _batches(vocab: int, batch: int = 2, seq: int = 16):
    """Pre-shifted labels with some ignored tokens; explicit position_ids."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        labels[0, :3] = -100
        pos = torch.arange(seq).unsqueeze(0).expand(batch, -1).contiguous()
        out.append((ids, labels, pos))
    return out


def _train(model, batches, options: TPOptions | None = None):
    """STEPS of AdamW; returns (losses, grad norms). Loss = token CE sum / non-ignored tokens.
    Also asserts every DTensor gradient has its parameter's placements (no Partial left over)."""
    from torch.distributed.tensor import DTensor

    from ndparallel.parallel.tp.tensor import loss_parallel_context

    # lr 1e-3: AdamW turns rounding noise on near-zero gradients into ~lr-sized steps (it divides by sqrt(v))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for ids, labels, pos in batches:
        logits = model(input_ids=ids, position_ids=pos).logits
        n_tokens = (labels != -100).sum()
        with loss_parallel_context(options):
            loss = (
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    labels.reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                )
                / n_tokens
            )
            loss.backward()
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                assert p.grad.placements == p.placements, (name, p.grad.placements, p.placements)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
        losses.append(full(loss).item())
        norms.append(full(norm).item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def _tp_rank(model, batches, options: TPOptions):
    """On each rank: TP over all ranks, train, report losses/norms and structural facts."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ndparallel.layout.config import ParallelismConfig
    from ndparallel.parallel.tp.tensor import apply_tensor_parallel, is_tensor_parallel

    model = copy.deepcopy(model)
    tp_mesh = ParallelismConfig(tp_size=dist.get_world_size()).build_device_mesh("cpu")["tp"]
    assert not is_tensor_parallel(model)
    apply_tensor_parallel(model, tp_mesh, options)
    assert is_tensor_parallel(model)
    facts = {
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "meshes": {id(p.device_mesh) for p in model.parameters()} == {id(tp_mesh)},
        "tied": model.lm_head.weight is model.get_input_embeddings().weight,
        "placement_embed": str(model.get_input_embeddings().weight.placements),
    }
    losses, norms = _train(model, batches, options)
    return losses, norms, facts


def _reference(model, batches) -> Reference:
    """One process's run of ``_train`` with the rule's bounds: the second way is the same training
    with every batch's rows reversed (equal in real arithmetic; its difference is the noise)."""

    def one(b):
        m = copy.deepcopy(model)
        losses, norms = _train(m, b)
        return TrainResult(losses, norms, {n: p.detach().clone() for n, p in m.named_parameters()})

    first, second = one(batches), one([tuple(t.flip(0) for t in step) for step in batches])
    return Reference(first, measured_bounds(SimpleNamespace(model_config=model.config), first, second))


def _assert_close(ref: Reference, got):
    assert_matches(ref, TrainResult(*got, params=None))  # losses and grad norms per step


def _check_tp(preset, options, world=2):
    model = _model(preset)
    batches = _batches(model.config.vocab_size)
    ref = _reference(model, batches)
    results = run_on_ranks(_tp_rank, world, model, batches, options)
    for losses, norms, facts in results:
        _assert_close(ref, (losses, norms))
        assert facts["all_dtensor"] and facts["meshes"], facts
        assert facts["tied"] == model.config.tie_word_embeddings, facts
    return results


FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-llama-tied", "tiny-qwen3"]


@pytest.mark.parametrize("preset", FAMILIES)
def test_tp2_equals_one_process(preset):
    _check_tp(preset, TPOptions())


@pytest.mark.parametrize(
    "preset,sp,lp",
    [
        ("tiny-llama-tied", True, False),
        ("tiny-llama-tied", False, True),
        ("tiny-llama-tied", True, True),
        ("tiny-qwen3", True, True),
        ("tiny-mistral", True, True),
        ("tiny-qwen2", True, False),
    ],
    ids=["llama-tied-sp", "llama-tied-lp", "llama-tied-sp+lp", "qwen3-sp+lp", "mistral-sp+lp", "qwen2-sp"],
)
def test_sequence_and_loss_parallel_equal_one_process(preset, sp, lp):
    _check_tp(preset, TPOptions(sequence_parallel=sp, loss_parallel=lp))


def test_tp4_with_four_kv_heads():
    # the presets have 2 KV heads; TP 4 needs 4
    model_preset = "tiny-llama"
    torch.manual_seed(0)
    cfg = preset_config(model_preset, num_key_value_heads=4)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    batches = _batches(cfg.vocab_size)
    ref = _reference(model, batches)
    for losses, norms, _ in run_on_ranks(_tp_rank, 4, model, batches, TPOptions(sequence_parallel=True)):
        _assert_close(ref, (losses, norms))


def test_user_plan_override_and_tied_embeddings_on_vocab():
    # A user plan (keys relative to the base model are accepted); embedding and lm_head both on vocab
    plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "embed_tokens": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    }
    results = _check_tp("tiny-llama-tied", TPOptions(plan=plan))
    assert results[0][2]["placement_embed"] == "(Shard(dim=0),)"


def _incompatible_tie_rank(model):
    from ndparallel.layout.config import ParallelismConfig
    from ndparallel.parallel.tp.tensor import apply_tensor_parallel

    mesh = ParallelismConfig(tp_size=2).build_device_mesh("cpu")["tp"]
    plan = {"model.embed_tokens": "embedding_colwise", "lm_head": "colwise_gather_output"}
    apply_tensor_parallel(model, mesh, TPOptions(plan=plan))


def test_tied_embeddings_with_incompatible_plan_is_a_clear_error():
    with pytest.raises(RankFailure, match="tied parameters .* different tp shardings"):
        run_on_ranks(_incompatible_tie_rank, 2, _model("tiny-llama-tied"))


# ------------------------------------------------------------------ transformers' own TP path
def _hf_tp_rank(path, batches):
    from torch.distributed.tensor import DTensor

    from ndparallel.layout.config import ParallelismConfig
    from ndparallel.parallel.tp.tensor import (
        apply_tensor_parallel,
        distribute_leftover_params,
        is_tensor_parallel,
    )

    tp_mesh = ParallelismConfig(tp_size=2).build_device_mesh("cpu")["tp"]
    model = AutoModelForCausalLM.from_pretrained(
        path, tp_plan="auto", device_mesh=tp_mesh, dtype=torch.float32
    )
    assert is_tensor_parallel(model)
    plain_before = sum(not isinstance(p, DTensor) for p in model.parameters())
    distribute_leftover_params(model, tp_mesh)
    assert apply_tensor_parallel(model, tp_mesh) is model  # detected: not sharded twice
    facts = {
        "plain_before": plain_before,
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "tied": model.lm_head.weight is model.get_input_embeddings().weight,
    }
    losses, norms = _train(model, batches)
    return losses, norms, facts


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_transformers_tp_path_equals_one_process(preset, tmp_path):
    import warnings

    model = _model(preset)
    model.save_pretrained(tmp_path)
    batches = _batches(model.config.vocab_size)
    ref = _reference(model, batches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_on_ranks(_hf_tp_rank, 2, str(tmp_path), batches)
    for losses, norms, facts in results:
        _assert_close(ref, (losses, norms))
        assert facts["plain_before"] > 0 and facts["all_dtensor"], facts
        assert facts["tied"] == model.config.tie_word_embeddings


# -------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "overrides,tp,message",
    [
        ({}, 4, r"^num_key_value_heads=2 is not divisible by tp_size=4: use tp_size in \{1,2\}$"),
        ({}, 3, r"num_attention_heads=4 is not divisible by tp_size=3: use tp_size in \{1,2\}"),
        (
            {"intermediate_size": 100, "num_attention_heads": 8, "num_key_value_heads": 8},
            8,
            r"^intermediate_size=100 is not divisible by tp_size=8: use tp_size in \{1,2,4\}$",
        ),
        ({"vocab_size": 250}, 4, r"vocab_size=250 is not divisible by tp_size=4: .*pad_to_multiple_of=4"),
    ],
)
def test_invalid_tp_sizes_name_field_and_fix(overrides, tp, message):
    with pytest.raises(ValueError, match=message):
        validate_tensor_parallel(preset_config("tiny-llama", **overrides), tp, TPOptions())


def test_valid_tp_sizes_pass():
    for tp in (1, 2):
        validate_tensor_parallel(preset_config("tiny-qwen3"), tp, TPOptions())
    # a user plan that does not shard the vocabulary does not need a divisible vocab
    plan = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    validate_tensor_parallel(preset_config("tiny-llama", vocab_size=255), 2, TPOptions(plan=plan))
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        validate_tensor_parallel(preset_config("tiny-llama"), 0)


def test_model_without_plan_names_what_to_supply():
    cfg = preset_config("tiny-llama")
    cfg.base_model_tp_plan = None
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(TPPlanError, match=r"TPOptions\(plan=.*`tp_plan` key of the YAML.*colwise"):
        resolve_tp_plan(model)
    assert resolve_tp_plan(model, {"lm_head": "colwise"}) == {"lm_head": "colwise"}


def test_model_plan_is_read_from_hf_config():
    plan = resolve_tp_plan(_model("tiny-qwen3"))
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"


def _sp_input_errors_rank(model):
    from ndparallel.layout.config import ParallelismConfig
    from ndparallel.parallel.tp.tensor import apply_tensor_parallel

    apply_tensor_parallel(
        model, ParallelismConfig(tp_size=2).build_device_mesh("cpu")["tp"], TPOptions(sequence_parallel=True)
    )
    errors = []
    ids = torch.randint(0, 256, (2, 16))
    pad = torch.ones_like(ids)
    pad[:, :3] = 0
    for kwargs in ({"input_ids": ids[:, :15]}, {"input_ids": ids, "attention_mask": pad}):
        try:
            model(**kwargs)
        except ValueError as e:
            errors.append(str(e))
    with torch.no_grad():  # all-ones mask and missing position_ids are handled
        ok = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape
    return errors, tuple(ok)


def test_sequence_parallel_input_errors():
    errors, shape = run_on_ranks(_sp_input_errors_rank, 2, _model("tiny-llama"))[0]
    assert "sequence length 15 is not divisible by tp_size=2" in errors[0]
    assert "does not support padding attention masks" in errors[1]
    assert shape == (2, 16, 256)


def test_the_check_can_fail():
    """Negative control: Qwen3's per-head q_norm/k_norm declared plainly 'replicate' (gradients not
    summed over tp) must be caught by the grad-norm comparison."""
    from ndparallel.models.tp_plans import model_tp_plan

    model = _model("tiny-qwen3")
    plan = model_tp_plan(model)
    plan["model.layers.*.self_attn.q_norm"] = plan["model.layers.*.self_attn.k_norm"] = "replicate"
    batches = _batches(model.config.vocab_size)
    ref = _reference(model, batches)
    losses, norms, _ = run_on_ranks(_tp_rank, 2, model, batches, TPOptions(plan=plan))[0]
    assert_differs(ref, TrainResult(losses, norms, None), margin=3)  # as before the rule: 3x its bound


def _embedding_gradient(padding_idx):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    from ndparallel.parallel.tp.styles import VocabParallelEmbedding

    torch.manual_seed(0)
    full = torch.randn(64, 8)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    emb = torch.nn.Embedding(64, 8, padding_idx=padding_idx)
    emb.weight.data.copy_(full)
    parallelize_module(emb, mesh, VocabParallelEmbedding(Replicate()))
    ids = torch.tensor([[0, 5, 31, 32, 63, 5, 40]])
    out = emb(ids)
    upstream = torch.arange(out.numel(), dtype=torch.float32).view_as(out)
    (out * upstream).sum().backward()
    ref_w = full.clone().requires_grad_()
    ref = F.embedding(ids, ref_w, padding_idx)
    (ref * upstream).sum().backward()
    g = emb.weight.grad
    local = g.to_local()
    return (
        torch.equal(out, ref.detach()),
        torch.equal(g.full_tensor(), ref_w.grad),
        tuple(local.shape),
        local.untyped_storage().nbytes(),
        tuple(g.placements),
    )


@pytest.mark.parametrize("padding_idx", [None, 5, 40])
def test_vocab_parallel_embedding_gradient_is_the_local_rows(padding_idx):
    """The lookups equal the full embedding's, the weight gradient equals it, and each tp rank holds
    (and allocates) only its rows' gradient — torch's RowwiseParallel embedding allocates the whole
    vocabulary's on every rank."""
    for same_out, same_grad, shape, nbytes, placements in run_on_ranks(_embedding_gradient, 2, padding_idx):
        assert same_out and same_grad
        assert shape == (32, 8) and nbytes == 32 * 8 * 4 and str(placements[0]) in ("S(0)", "Shard(dim=0)")

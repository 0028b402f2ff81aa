"""``fsdp_config.ac_policy: selective`` (``techniques/selective_ac.py``): under TP + sequence parallel
a decoder layer keeps at most Megatron's bound, measured as the bench measures it; the planner's
selective model is that measurement; what it cannot combine with is refused naming the fix. (Its
training equals one process: ``tests/test_tensor_parallel_compositions.py``.)"""

import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from ndparallel.config.schema import TrainConfig
from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import ActivationOptions
from ndparallel.parallel.parallelize import apply_activation_memory
from ndparallel.techniques.offload import offloader_of
from ndparallel.techniques.selective_ac import selective_policy_problem
from ndparallel.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from sp_activation_memory import _measure_all, _planned, _planned_split  # noqa: E402

SHAPE = dict(
    hidden_size=128,
    intermediate_size=448,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=256,
    max_position_embeddings=64,
)
"""Llama-3's shape in small (f = 3.5·h, GQA 2:1, a·d = h), measured with 2 rows of 48 tokens."""
SEQ = 48
MODES = {1: ("selective", "selective_offload"), 2: ("shards", "selective", "selective_offload")}


@pytest.fixture(scope="module")
def layer0():
    """Bytes per token layer 0 keeps (``per_token``: on the device; ``host_per_token``: offloaded),
    (tp, mode) -> measurement, as the bench measures them: bf16, tp 1 and rank 0 of a fake tp-2
    world (real shapes and kernels), every mode in one child process."""
    jobs = [(tp, mode, SHAPE, 2, SEQ, "cpu") for tp, modes in MODES.items() for mode in modes]
    return dict(zip([(j[0], j[1]) for j in jobs], run_on_ranks(_measure_all, 1, jobs)[0]))


def test_layer_keeps_at_most_megatrons_bound_under_tp_sp_selective(layer0):
    """Korthikanti et al. (2022) count ``34·s·b·h/t`` bytes per layer under sequence parallel +
    selective recompute (16-bit activations, the ``s²`` softmax recomputed). A fused attention
    kernel keeps no ``s²`` tensor but an fp32 log-sum-exp per query head and token (``4·a/t``),
    which their count has no term for: the bound is ``(34·h + 4·a)/t``. The shape is Llama-3's in
    small (f = 3.5·h, GQA 2:1, a·d = h), bf16, rank 0 of a fake tp-2 world (real shapes and
    kernels). Saving the block inputs as shards alone stays above it; with the selective policy
    the layer keeps what the planner says, to the byte, and at most the bound."""
    h, a, tp = SHAPE["hidden_size"], SHAPE["num_attention_heads"], 2
    shards, selective = layer0[(tp, "shards")], layer0[(tp, "selective")]
    bound = (34 * h + 4 * a) / tp
    assert shards["per_token"] > bound, shards
    assert selective["per_token"] <= bound, (selective, bound)
    assert selective["attention_s2_per_token"] == 0
    assert selective["per_token"] == _planned(SHAPE, tp, "selective", SEQ)
    assert shards["per_token"] == _planned(SHAPE, tp, "shards", SEQ)


def test_runtime_path_checkpoints_every_norm_and_mlp():
    """What the equivalence tests run is the policy (they would pass without it): through
    ``apply_activation_memory`` every norm of each layer (Qwen3's q/k norms too) and each MLP is
    swapped, nothing else, and the gradients are bitwise those of the plain model."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3"))
    plain = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3"))
    plain.load_state_dict(model.state_dict())
    options = ActivationOptions(activation_checkpointing=True, ac_policy="selective")
    apply_activation_memory(model, options, torch.device("cpu"))
    swapped = [n for n, m in model.named_modules() if type(m).__name__.startswith("Recomputed")]
    assert len(swapped) == 2 * (4 + 1), swapped  # 2 layers × (4 norms + the MLP)
    ids = torch.randint(0, 256, (2, 16))
    for m in (model, plain):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_offloading_moves_what_the_selective_layer_keeps_to_the_host(layer0):
    """``activation_offloading`` with the selective policy (Meta's 405B layout needs it, docs/planner.md):
    under TP + SP (rank 0 of a fake tp-2 world, as above) layer 0 keeps on the device only the
    output of ``down_proj``'s collective that the policy keeps (``e·h/t`` per token); the rest of what
    it kept without offloading is in host memory (plus RoPE's cos and sin, model-level, once per
    forward). Without TP nothing stays on the device."""
    h, e = SHAPE["hidden_size"], 2
    rope = 2 * e * SHAPE["head_dim"]  # cos and sin per token, offloaded by the first layer
    for tp, residue in ((1, 0), (2, e * h / 2)):
        kept, offloaded = layer0[(tp, "selective")], layer0[(tp, "selective_offload")]
        assert offloaded["per_token"] == residue, (tp, offloaded)
        assert offloaded["host_per_token"] == kept["per_token"] - residue + rope, (tp, kept, offloaded)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_planners_offload_split_is_what_the_runtime_moves(layer0, tp):
    """The planner's (device, host) bytes per token of layer 0 (``plan/memory/activations.py:
    offload_split_per_token``, RoPE's cos and sin on the host) are the measured ones, to the byte.
    Under TP o_proj's input is a DTensor view of the attention output's storage with a version
    counter of its own: sent once (a version check sent it twice until 2026-12-06)."""
    device, host = _planned_split(SHAPE, tp, "selective_offload", SEQ)
    assert layer0[(tp, "selective_offload")]["per_token"] == device
    assert layer0[(tp, "selective_offload")]["host_per_token"] == host


def test_runtime_path_offloads_with_the_selective_policy():
    """Through ``apply_activation_memory``: gradients bitwise those of the plain model, every
    saved storage offloaded came back once per backward, and none is held after it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3"))
    plain = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3"))
    plain.load_state_dict(model.state_dict())
    options = ActivationOptions(
        activation_checkpointing=True, ac_policy="selective", activation_offloading=True
    )
    apply_activation_memory(model, options, torch.device("cpu"))
    offloader = offloader_of(model)
    ids = torch.randint(0, 256, (2, 16))
    for m in (model, plain):
        m(input_ids=ids, labels=ids).loss.backward()
    stats = offloader.stats
    assert stats.offloaded > 2 * 8 and stats.restored == stats.offloaded, stats  # > 8 storages a layer
    assert stats.host_bytes == 0 and stats.peak_host_bytes > 0, stats
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


def _stage_offloaders() -> list[int]:
    """On a rank of PP 2 × Interleaved1F1B (2 stages per rank): the offloader of each stage."""
    from ndparallel.engine.engine import Engine
    from ndparallel.layout.config import ParallelismConfig
    from ndparallel.parallel.options import PipelineOptions, StrategyOptions
    from ndparallel.tools.equivalence import TrainSetup, build_model

    activation = ActivationOptions(
        activation_checkpointing=True, ac_policy="selective", activation_offloading=True
    )
    pipe = PipelineOptions(schedule="Interleaved1F1B")
    engine = Engine(ParallelismConfig(pp_size=2), StrategyOptions(activation=activation, pipeline=pipe))
    model = engine.parallelize(build_model(TrainSetup(preset_config("tiny-llama", num_hidden_layers=4))))
    return [id(offloader_of(lm)) for lm in engine.pipeline_of(model).lms()]


def test_a_ranks_pipeline_stages_share_one_offloader():
    """Each stage is parallelised on its own; one host-memory budget (80 % of the host's available
    memory over the node's ranks) must bound all of a rank's stages, not each of them."""
    for ids in run_on_ranks(_stage_offloaders, 2):
        assert len(ids) == 2 and len(set(ids)) == 1, ids


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(ac_policy="selective"), "needs activation_checkpointing: true"),
        (dict(activation_checkpointing=True, ac_policy="selective", tiled_mlp=True), "use one of them"),
    ],
)
def test_refused_combinations_name_the_fix(options, message):
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    with pytest.raises(ValueError, match=message):
        apply_activation_memory(model, ActivationOptions(**options), torch.device("cpu"))


def test_compile_is_refused():
    options = ActivationOptions(activation_checkpointing=True, ac_policy="selective")
    assert "turn compile off" in selective_policy_problem(options, compiled=True)
    assert selective_policy_problem(options) is None


def test_mixture_of_experts_is_refused():
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3-moe"))
    options = ActivationOptions(activation_checkpointing=True, ac_policy="selective")
    with pytest.raises(ValueError, match="gated MLP .* use ac_policy: full"):
        apply_activation_memory(model, options, torch.device("cpu"))


def test_config_needs_checkpointing_for_a_policy():
    base = {"base_model": "tiny-llama", "datasets": [{"path": "x.jsonl", "type": "completion"}]}
    with pytest.raises(ValidationError, match="set activation_checkpointing: true"):
        TrainConfig(**base, fsdp_config={"ac_policy": "selective"})
    cfg = TrainConfig(**base, fsdp_config={"activation_checkpointing": True, "ac_policy": "selective"})
    assert cfg.activation_options().ac_policy == "selective"

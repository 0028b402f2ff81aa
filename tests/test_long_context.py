"""The long-context memory options train the same model as one process (fp32, SGD; the project's
rule, ``tools.agreement``): sequence-tiled MLP (with the lean norms) and activation offloading, on
one process, under FSDP 2 × CP 2 (every CP strategy), TP 2 + sequence parallel, LoRA and compile;
selective activation checkpointing on one process and under FSDP 2 × CP 2.
Non-vacuity: the tiles are counted (the MLP really ran per tile, under TP its collectives per
tile), the offloaded layer inputs are counted, and a deliberately wrong restore fails the check."""

import dataclasses

import pytest
import torch

from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import ActivationOptions, CPOptions, TPOptions
from ndparallel.techniques.technique_options import CompileOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, train_under_layout

BASE = TrainSetup(
    preset_config("tiny-llama"),
    steps=2,
    global_micro_batch=4,
    seq_len=32,
    optimizer="sgd",
    lr=0.5,
    max_grad_norm=1.0,
    packed_documents=True,
)
TILED = dict(tiled_mlp=True, tiled_mlp_num_shards=3)  # 3 tiles of a 32- (or 8-) token row: uneven
BOTH = dict(TILED, activation_checkpointing=True, activation_offloading=True)
SELECTIVE = dict(activation_checkpointing=True, ac_policy="selective")  # techniques/selective_ac.py


def _check(layout, world, setup=BASE, **parallel_kwargs):
    setup = dataclasses.replace(setup, parallel_kwargs=parallel_kwargs)
    got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=400)[0]
    assert_matches(one_process_reference(setup), got)


@pytest.mark.parametrize(
    "options",
    [
        TILED,
        dict(TILED, activation_checkpointing=True),
        dict(activation_checkpointing=True, activation_offloading=True),
        BOTH,
        SELECTIVE,
    ],
    ids=["tiled", "tiled+ac", "ac+offload", "tiled+ac+offload", "selective-ac"],
)
def test_one_process(options):
    _check(None, 1, activation_options=ActivationOptions(**options))


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_fsdp2_cp2(strategy):
    _check(
        {"dp_shard_size": 2, "cp_size": 2},
        4,
        activation_options=ActivationOptions(**BOTH),
        cp_options=CPOptions(comm_strategy=strategy),
    )


@pytest.mark.parametrize("offloading", [False, True], ids=["device", "offloaded"])
def test_selective_ac_fsdp2_cp2(offloading):
    options = ActivationOptions(**SELECTIVE, activation_offloading=offloading)  # offloaded: all a layer saves
    _check({"dp_shard_size": 2, "cp_size": 2}, 4, activation_options=options)


def test_tp2_sequence_parallel_cp2():
    _check(
        {"tp_size": 2, "cp_size": 2},
        4,
        activation_options=ActivationOptions(**BOTH),
        tp_options=TPOptions(sequence_parallel=True, loss_parallel=True),
    )


def test_lora_fsdp2():
    setup = dataclasses.replace(BASE, adapter={"r": 4, "alpha": 8, "target_linear": True})
    _check({"dp_shard_size": 2}, 2, setup=setup, activation_options=ActivationOptions(**BOTH))


def _train_counting_graphs(setup, layout):
    import torch._dynamo

    torch._dynamo.reset()
    result = train_under_layout(setup, layout)
    return result, torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)


def test_compile_fsdp2():
    setup = dataclasses.replace(
        BASE,
        parallel_kwargs={
            "activation_options": ActivationOptions(**BOTH),
            "compile_options": CompileOptions(enabled=True, backend="aot_eager"),
        },
    )
    got, graphs = run_on_ranks(_train_counting_graphs, 2, setup, {"dp_shard_size": 2}, timeout_s=600)[0]
    assert_matches(one_process_reference(setup), got)
    assert graphs >= 1, "nothing was compiled"


def test_compile_tp2_sequence_parallel():
    """TP + SP with the tiled MLP: the attention compiled, the tiled MLP eager (tracing its per-tile
    DTensor call recursed without end in torch 2.13's AOT autograd: ``techniques/compile.py``)."""
    setup = dataclasses.replace(
        BASE,
        parallel_kwargs={
            "activation_options": ActivationOptions(**TILED),
            "tp_options": TPOptions(sequence_parallel=True),
            "compile_options": CompileOptions(enabled=True, backend="aot_eager"),
        },
    )
    got, graphs = run_on_ranks(_train_counting_graphs, 2, setup, {"tp_size": 2}, timeout_s=600)[0]
    assert_matches(one_process_reference(setup), got)
    assert graphs >= 1, "nothing was compiled"


# ------------------------------------------------------------------ the hooks fire as intended
def _collectives(setup, layout):
    from ndparallel.runtime.comm_profile import CommProfiler

    with CommProfiler() as prof:
        train_under_layout(setup, layout)
    calls: dict = {}
    for (_dim, op, _bytes), n in prof.total_calls().items():
        calls[op] = calls.get(op, 0) + n
    return calls


def test_fsdp_gathers_once_per_layer_and_tp_collectives_run_per_tile():
    """FSDP2: the same all-gathers and reduce-scatters with 3 tiles as without (a layer is gathered
    once, not per tile). TP + SP: the MLP's all-gather / reduce-scatter run once per tile."""
    plain = dataclasses.replace(BASE, parallel_kwargs={})
    tiled = dataclasses.replace(BASE, parallel_kwargs={"activation_options": ActivationOptions(**TILED)})
    fsdp = [run_on_ranks(_collectives, 2, s, {"dp_shard_size": 2})[0] for s in (plain, tiled)]
    assert fsdp[0] == fsdp[1], fsdp
    sp = dict(tp_options=TPOptions(sequence_parallel=True))
    # unpacked rows: transformers' own packed-row mask fails under sequence parallel without CP
    tp = [
        run_on_ranks(
            _collectives,
            2,
            dataclasses.replace(s, packed_documents=False, parallel_kwargs={**s.parallel_kwargs, **sp}),
            {"tp_size": 2},
        )[0]
        for s in (plain, tiled)
    ]
    # Per layer and step the MLP's all-gather of its input and reduce-scatter of its output each run
    # once per tile in the forward (T instead of 1) and in the tiles' recompute (T more), and their
    # backward mirrors once per tile (T instead of 1): 3T - 2 extra calls of each kind.
    # Untiled, SP saves the MLP's input as its sequence shard and all-gathers it again in backward
    # (parallel/tp/sp_saves.py); the tiles recompute their MLP from the saved input instead, so the
    # tiled run makes that one backward all-gather per layer and step fewer.
    tiles, layers, steps = 3, BASE.model_config.num_hidden_layers, BASE.steps
    regather = layers * steps
    assert tp[1]["all_gather"] - tp[0]["all_gather"] == (3 * tiles - 2) * layers * steps - regather, tp
    assert tp[1]["reduce_scatter"] - tp[0]["reduce_scatter"] == (3 * tiles - 2) * layers * steps, tp


def _tile_lengths(num_tiles, seq):
    from transformers import AutoModelForCausalLM

    from ndparallel.techniques.tiled_mlp import apply_tiled_mlp

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BASE.model_config)
    apply_tiled_mlp(model, num_tiles)
    seen = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    model(input_ids=torch.randint(0, 256, (2, seq))).logits.sum().backward()
    return seen


def test_tiles_are_real():
    # forward 3 tiles (no autograd), backward 3 recomputed tiles; default: ceil(seq / hidden)
    assert _tile_lengths(3, 32) == [11, 11, 10, 11, 11, 10]
    assert _tile_lengths(None, 130) == [44, 44, 42, 44, 44, 42]  # hidden 64 -> 3 tiles


# ---------------------------------------------------------------------- offloading bookkeeping
def _offloaded_grads(transfers=None, budget=None, steps=2):
    from transformers import AutoModelForCausalLM

    from ndparallel.techniques.offload import ActivationOffloader, OffloadedCheckpoint

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BASE.model_config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    offloader = None
    if transfers is not False:
        offloader = ActivationOffloader(transfers, max_host_bytes=budget)
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = OffloadedCheckpoint(
                offloader, layer._gradient_checkpointing_func
            )
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters()], offloader


def test_offload_counts_and_frees_host_memory():
    ref, _ = _offloaded_grads(transfers=False)
    grads, off = _offloaded_grads()
    assert max((a - b).abs().max().item() for a, b in zip(ref, grads)) == 0.0
    layer_input = 2 * 40 * 64 * 4  # batch × seq × hidden × fp32
    s = off.stats
    assert (s.offloaded, s.restored, s.prefetched) == (4, 4, 2), s  # 2 layers × 2 steps, 1 prefetch per step
    assert s.offloaded_bytes == 4 * layer_input and s.peak_host_bytes == 2 * layer_input, s
    assert s.host_bytes == 0, s  # every host copy freed with its graph


def test_offload_budget_keeps_the_rest_on_device():
    ref, _ = _offloaded_grads(transfers=False, steps=1)
    with pytest.warns(UserWarning, match="budget"):
        grads, off = _offloaded_grads(budget=2 * 40 * 64 * 4, steps=1)
    assert (off.stats.offloaded, off.stats.kept_on_device) == (1, 1), off.stats
    assert max((a - b).abs().max().item() for a, b in zip(ref, grads)) == 0.0


class _SwappedRestores:
    """A broken transfer: every restore returns the previously offloaded tensor (wrong layer)."""

    device_type = "cpu"

    def __init__(self):
        from ndparallel.techniques.offload import HostTransfers

        self.inner, self.last = HostTransfers(), None

    def to_host(self, x):
        return self.inner.to_host(x)

    def to_device(self, host, device):
        out, self.last = (self.last if self.last is not None else host), host
        return out, None

    def wait(self, event):
        pass


def test_a_wrong_restore_is_caught():
    ref, _ = _offloaded_grads(transfers=False, steps=1)
    grads, _ = _offloaded_grads(_SwappedRestores(), steps=1)
    assert max((a - b).abs().max().item() for a, b in zip(ref, grads)) > 1e-3


# ------------------------------------------------------------------ refused before launch, one line
@pytest.mark.parametrize(
    "text, fragment",
    [
        ("activation_offloading: true\n", "set fsdp_config.activation_checkpointing: true"),
        (
            "activation_offloading: disk\nfsdp_config: {activation_checkpointing: true}\n",
            "'disk' is not supported",
        ),
        ("tiled_mlp_num_shards: 4\n", "tiled_mlp_num_shards is set but tiled_mlp is not"),
        ("tiled_mlp: true\ntiled_mlp_num_shards: 0\n", "'tiled_mlp_num_shards': must be >= 1"),
        (
            "tiled_mlp: true\nfsdp_config: {layer_classes: [LlamaDecoderLayer, LlamaMLP]}\n",
            "names the MLP (LlamaMLP)",
        ),
    ],
)
def test_bad_long_context_config(tmp_path, capsys, text, fragment):
    from cli_helpers import run_cli

    path = tmp_path / "cfg.yaml"
    path.write_text("base_model: tiny-llama\n" + text)
    code, _, err = run_cli(capsys, "train", str(path), "--dry-run")
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_moe_blocks_are_refused():
    from transformers import MixtralConfig, MixtralForCausalLM

    from ndparallel.techniques.tiled_mlp import apply_tiled_mlp

    with torch.device("meta"):
        model = MixtralForCausalLM(
            MixtralConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                vocab_size=64,
            )
        )
    with pytest.raises(ValueError, match="mixture-of-experts|no `mlp`"):
        apply_tiled_mlp(model)

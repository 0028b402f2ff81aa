"""Accelerate's Accelerator methods and attributes, with Accelerate's semantics, on CPU ranks:
process helpers, collectives, gradient accumulation through the prepared optimizer / scheduler /
loader, saving (save_pretrained on every layout, save_model, save_state), trackers, CP input
checks, and the mesh starting its own process group."""

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks


def _tiny_model(seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(preset_config("tiny-llama"))


# ------------------------------------------------------------------ processes, collectives
def _surface(tmp):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    r = acc.process_index
    out = {
        "sum": acc.reduce(torch.tensor([float(r)])).item(),  # Accelerate's default: "sum"
        "max": acc.reduce(torch.tensor([float(r)]), "max").item(),
        "gather": acc.gather(torch.tensor(r)).tolist(),
        "padded": acc.pad_across_processes(torch.arange(r + 1)).shape[0],
    }
    with acc.split_between_processes(list(range(10))) as part:
        out["split"] = part
    with acc.split_between_processes(torch.arange(10), apply_padding=True) as part:
        out["split_padded"] = part.tolist()
    with acc.main_process_first():
        with open(os.path.join(tmp, "order.txt"), "a") as f:
            f.write(f"{r}\n")
    acc.wait_for_everyone()
    out["first"] = open(os.path.join(tmp, "order.txt")).read().split()[0]
    out["on_main"] = acc.on_main_process(lambda: "ran")()
    out["on_last"] = acc.on_last_process(lambda: "ran")()
    if r == 1:
        acc.set_trigger()
    out["trigger"], out["trigger_again"] = acc.check_trigger(), acc.check_trigger()
    out["attrs"] = (
        str(acc.distributed_type),
        acc.is_fsdp2,
        acc.is_last_process,
        acc.mixed_precision,
        acc.tensor_parallel_rank,
        acc.data_parallel_shard_rank,
        acc.context_parallel_rank,
        acc.state.num_processes,
        acc.parallelism_config.get_device_mesh() is acc.torch_device_mesh,
    )
    # gather_for_metrics: 7 samples, 2 per dp rank per step -> every sample exactly once
    loader = acc.prepare(DataLoader(list(range(7)), batch_size=2))
    seen = []
    for batch in loader:
        seen += acc.gather_for_metrics(batch).tolist()
    out["metrics_seen"] = seen
    assert dist.get_world_size() == 4
    return out


def test_process_helpers_and_collectives(tmp_path):
    out = run_on_ranks(_surface, 4, str(tmp_path))
    assert [o["sum"] for o in out] == [6.0] * 4 and out[0]["max"] == 3.0
    assert out[0]["gather"] == [0, 1, 2, 3] and out[0]["padded"] == 4
    assert [o["split"] for o in out] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [o["split_padded"] for o in out] == [[0, 1, 2], [3, 4, 5], [6, 7, 7], [8, 9, 9]]
    assert out[0]["first"] == "0"
    assert [o["on_main"] for o in out] == ["ran", None, None, None]
    assert [o["on_last"] for o in out] == [None, None, None, "ran"]
    assert all(o["trigger"] and not o["trigger_again"] for o in out)
    assert out[3]["attrs"] == ("FSDP", True, True, "no", 1, 1, 0, 4, True)
    assert all(sorted(o["metrics_seen"]) == list(range(7)) for o in out), out[0]["metrics_seen"]


# --------------------------------------------------------------- gradient accumulation
def _accumulation():
    from torch.utils.data import DataLoader

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2), gradient_accumulation_steps=2)
    model = _tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = [torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    loader = DataLoader(data, batch_size=1)  # 3 batches per dp rank: the 3rd ends the loader
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    first = next(model.parameters())
    events = []
    for batch in loader:
        before = first.detach().full_tensor().clone()
        with acc.accumulate(model):
            acc.backward(model(input_ids=batch, labels=batch).loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        changed = not torch.equal(before, first.detach().full_tensor())
        events.append((acc.sync_gradients, changed, round(sched.get_last_lr()[0], 6)))
    return events


def test_prepared_optimizer_scheduler_and_loader_follow_accumulation():
    events = run_on_ranks(_accumulation, 2)[0]
    # micro-batch 1: no step; 2: step (scheduler advanced dp_size=2 times); 3: last batch -> step
    assert events == [(False, False, 0.1), (True, True, 0.025), (True, True, 0.00625)], events


# ------------------------------------------------------------------------------ saving
def _save(layout, out_dir):
    from safetensors.torch import load_file

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(**layout))
    model = _tiny_model()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = acc.prepare(model)
    model.save_pretrained(os.path.join(out_dir, "plain"))  # collective: every rank calls it
    acc.unwrap_model(model).save_pretrained(
        os.path.join(out_dir, "accelerate_way"),
        state_dict=acc.get_state_dict(model),
        is_main_process=acc.is_main_process,
    )
    acc.save_model(model, os.path.join(out_dir, "bin"), max_shard_size="100KB", safe_serialization=False)
    acc.wait_for_everyone()
    if not acc.is_main_process:
        return None
    diffs = {}
    for name in ("plain", "accelerate_way"):
        got = load_file(os.path.join(out_dir, name, "model.safetensors"))
        diffs[name] = max((got[k] - want[k]).abs().max().item() for k in got), len(got)
    files = sorted(os.listdir(os.path.join(out_dir, "bin")))
    return diffs, files


@pytest.mark.parametrize(
    "layout",
    [
        {"dp_shard_size": 2},
        {"tp_size": 2},
        {"dp_replicate_size": 2},
        {"cp_size": 2},
        {"dp_shard_size": 2, "tp_size": 2},
    ],
    ids=["fsdp", "tp", "dp", "cp", "fsdp_tp"],
)
def test_save_pretrained_on_a_prepared_model_writes_the_full_model(layout, tmp_path):
    from transformers import AutoModelForCausalLM

    world = 1
    for v in layout.values():
        world *= v
    diffs, files = run_on_ranks(_save, world, layout, str(tmp_path))[0]
    model = _tiny_model()
    n_params = len(model.state_dict()) - int(model.config.tie_word_embeddings)  # tied: written once
    assert diffs == {"plain": (0.0, n_params), "accelerate_way": (0.0, n_params)}, diffs
    shards = [f for f in files if f.startswith("pytorch_model-") and f.endswith(".bin")]
    assert "pytorch_model.bin.index.json" in files and len(shards) > 1, files  # 100KB shards of a 430KB model
    AutoModelForCausalLM.from_pretrained(tmp_path / "bin")


class _Counter:
    def __init__(self):
        self.n = torch.tensor(0)

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"].clone()


def _save_state(tmp):
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.utils import ProjectConfiguration

    acc = Accelerator(
        parallelism_config=ParallelismConfig(dp_shard_size=2),
        project_config=ProjectConfiguration(project_dir=tmp, automatic_checkpoint_naming=True),
    )
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    counter = _Counter()
    acc.register_for_checkpointing(counter)
    x = torch.randint(0, 256, (1, 8))
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    counter.n = torch.tensor(7)
    path = acc.save_state(safe_serialization=True)
    loss_then = model(input_ids=x, labels=x).loss.item()
    opt.step()  # change the weights, then restore
    counter.n = torch.tensor(0)
    acc.load_state()
    return path, int(counter.n), abs(model(input_ids=x, labels=x).loss.item() - loss_then), acc.save_iteration


def test_save_state_with_registered_objects_and_automatic_naming(tmp_path):
    path, n, diff, iteration = run_on_ranks(_save_state, 2, str(tmp_path))[0]
    assert (
        path.endswith(os.path.join("checkpoints", "checkpoint_0"))
        and n == 7
        and diff == 0.0
        and iteration == 1
    )


def _failed_save_keeps_the_previous(tmp):
    """``total_limit=1``: a save that fails mid-write (every rank's DCP files written, then the disk
    is full) must leave the previous checkpoint complete and loadable; a retry then succeeds and
    only then rotates the old one away. (The error is raised on every rank, as a full shared disk
    does, so the ranks stay in step for the rest of the test.)"""
    import ndparallel.checkpoint.state as state
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.checkpoint import validate_checkpoint
    from ndparallel.utils import ProjectConfiguration

    acc = Accelerator(
        parallelism_config=ParallelismConfig(dp_shard_size=2),
        project_config=ProjectConfiguration(project_dir=tmp, automatic_checkpoint_naming=True, total_limit=1),
    )
    model = _tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, 256, (1, 8))
    first = acc.save_state()
    loss_then = model(input_ids=x, labels=x).loss.item()
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    real = state.rng_state

    def disk_full():
        raise OSError(28, "No space left on device")

    state.rng_state = disk_full  # called right after the DCP files are written
    try:
        acc.save_state()
        raised = False
    except OSError:
        raised = True
    finally:
        state.rng_state = real
    acc.wait_for_everyone()
    after_failure = sorted(p.name for p in (Path(tmp) / "checkpoints").iterdir())
    intact = validate_checkpoint(first) == []
    acc.load_state(first)
    restored = abs(model(input_ids=x, labels=x).loss.item() - loss_then)
    second = acc.save_state()  # the retry overwrites the half-written folder, then rotates
    acc.wait_for_everyone()
    final = sorted(p.name for p in (Path(tmp) / "checkpoints").iterdir() if not p.name.startswith("."))
    return raised, after_failure, intact, restored, Path(second).name, final


def test_failed_save_state_keeps_the_previous_checkpoint(tmp_path):
    raised, after_failure, intact, restored, second, final = run_on_ranks(
        _failed_save_keeps_the_previous, 2, str(tmp_path)
    )[0]
    assert raised and intact and restored == 0.0
    assert after_failure == ["checkpoint_0", "checkpoint_1"]  # the old one was not deleted first
    assert second == "checkpoint_1" and final == ["checkpoint_1"]  # rotated once the new one completed


def _every_rank_checks_before_rank0_empties(tmp):
    """Rank 1 is slow to look at the target directory; rank 0 may empty it only once it has."""
    import time

    import ndparallel.checkpoint.state as state
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    acc.prepare(_tiny_model())
    target = Path(tmp) / "ckpt"
    acc.save_state(str(target))  # the directory exists: the next save checks, then empties it
    checked, real_check, real_prepare = (
        Path(tmp) / f"checked-{acc.process_index}",
        state.check_target_dir,
        state.prepare_dir,
    )
    seen = []

    def slow_check(directory):
        if acc.process_index == 1:
            time.sleep(0.5)
        real_check(directory)
        checked.touch()

    def prepare(directory):
        seen.append(sorted(p.name for p in Path(tmp).glob("checked-*")))
        real_prepare(directory)

    state.check_target_dir, state.prepare_dir = slow_check, prepare
    try:
        acc.save_state(str(target))
    finally:
        state.check_target_dir, state.prepare_dir = real_check, real_prepare
    return seen


def test_every_rank_checks_the_target_before_rank0_empties_it(tmp_path):
    """A peer listing the old checkpoint while rank 0 removed it failed (FileNotFoundError, seen
    once in a full run): rank 0 empties the directory only after every rank has checked it."""
    seen = run_on_ranks(_every_rank_checks_before_rank0_empties, 2, str(tmp_path))
    assert seen[0] == [["checked-0", "checked-1"]] and seen[1] == []


# ----------------------------------------------------------------------------- trackers
class _Recorder:
    pass


def _trackers(tmp):
    from ndparallel import Accelerator
    from ndparallel.utils import GeneralTracker

    class Recorder(GeneralTracker):
        name, requires_logging_directory = "recorder", False

        def __init__(self):
            super().__init__()
            self.calls = []

        def store_init_configuration(self, values):
            self.calls.append(("config", values))

        def log(self, values, step=None, **kwargs):
            self.calls.append(("log", values, step))

    rec = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accelerator(log_with=["clearml", rec], project_dir=tmp)  # clearml: not installed here
    acc.init_trackers("proj", config={"lr": 0.1})
    acc.log({"loss": torch.tensor(1.5)}, step=3)
    jsonl = acc.get_tracker("jsonl")
    acc.end_training()
    missing = [str(w.message) for w in caught if "clearml" in str(w.message)]
    return missing, rec.calls, type(jsonl).__name__


def test_trackers_jsonl_always_missing_one_warned_custom_called(tmp_path):
    missing, calls, jsonl = run_on_ranks(_trackers, 1, str(tmp_path))[0]
    assert len(missing) == 1 and "not installed" in missing[0]
    assert calls == [("config", {"lr": 0.1}), ("log", {"loss": torch.tensor(1.5)}, 3)]
    record = json.loads((tmp_path / "proj" / "metrics.jsonl").read_text())
    assert record["loss"] == 1.5 and record["step"] == 3 and jsonl == "JSONLTracker"
    assert json.loads((tmp_path / "proj" / "config.json").read_text()) == {"lr": 0.1}


# ------------------------------------------------------------------------ CP input checks
def _cp_errors(case):
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(cp_size=2))
    model = acc.prepare(_tiny_model())
    x = torch.randint(0, 256, (1, 16))
    labels = x.clone()
    with acc.maybe_context_parallel(buffers=[x, labels], buffer_seq_dims=[1, 1]):
        if case == "unsharded_positions":
            model(input_ids=x, position_ids=torch.arange(16)[None])
        else:
            model(input_ids=x, labels=labels)


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("unsharded_positions", "position_ids have length 16 but the sharded inputs 8"),
        ("unshifted_labels", "labels` without `shift_labels`"),
    ],
)
def test_cp_inputs_that_would_silently_change_the_loss_are_errors(case, fragment):
    with pytest.raises(Exception, match=fragment):
        run_on_ranks(_cp_errors, 2, case)


# --------------------------------------------------------------------- mesh and group
def _mesh_starts_group(second_port):
    import torch.distributed as dist

    from ndparallel import ParallelismConfig
    from ndparallel.runtime.distributed import shutdown

    # Every rank's gloo connections are up before any rank closes its own: a rank that leaves
    # init_process_group first and destroys its group at once closes a connection a slower peer is
    # still making ("connectFullMesh failed ... Connection closed by peer", seen under load).
    dist.barrier()
    shutdown()  # as in a fresh torchrun process: env vars set, no process group yet
    os.environ["MASTER_PORT"] = second_port
    mesh = ParallelismConfig(dp_shard_size=2).build_device_mesh("cpu")
    return dist.is_initialized(), dist.get_world_size(), tuple(mesh.shape)


def test_build_device_mesh_starts_the_process_group_under_torchrun():
    from ndparallel.runtime.multirank import free_port

    port = str(free_port())
    assert run_on_ranks(_mesh_starts_group, 2, port)[0] == (
        True,
        2,
        (1, 1, 2, 1, 1),
    )  # (pp, dp_replicate, dp_shard, cp, tp)


def _transformers_tp_whole_world(path):
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    acc.prepare(model)


def test_transformers_tp_over_a_larger_world_says_what_to_do(tmp_path):
    _tiny_model().save_pretrained(tmp_path)
    with pytest.raises(Exception, match="Load the model without tp_plan"):
        run_on_ranks(_transformers_tp_whole_world, 4, str(tmp_path))


def _autocast_and_profile(tmp):
    from ndparallel import Accelerator
    from ndparallel.utils import AutocastKwargs, ProfileKwargs

    acc = Accelerator(mixed_precision="bf16", kwargs_handlers=[ProfileKwargs(output_trace_dir=tmp)])
    a = torch.randn(4, 4)
    with acc.autocast():
        inside = (a @ a).dtype
    with acc.autocast(AutocastKwargs(enabled=False)):
        disabled = (a @ a).dtype
    with acc.profile() as prof:
        a @ a
    return inside, disabled, prof is not None, sorted(os.listdir(tmp))


def test_autocast_and_profile(tmp_path):
    inside, disabled, profiled, files = run_on_ranks(_autocast_and_profile, 1, str(tmp_path))[0]
    assert (inside, disabled, profiled, files) == (torch.bfloat16, torch.float32, True, ["profile_0.json"])


def _rank0_only_loading(path):
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.checkpoint.save_pretrained import full_state_dict
    from ndparallel.parallel.parallelize import is_meta
    from ndparallel.utils import FullyShardedDataParallelPlugin

    acc = Accelerator(
        parallelism_config=ParallelismConfig(dp_shard_size=2),
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True),
    )
    if acc.is_main_process:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:  # what cpu_ram_efficient_loading gives the other ranks (transformers < 5.x; any missing key in 5.x)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    loaded_meta = is_meta(model)
    model = acc.prepare(model)
    state = full_state_dict(model)
    x = torch.arange(16)[None] % 200
    loss = model(input_ids=x, labels=x).loss.item()  # same input on both ranks: rotary buffers too
    if not acc.is_main_process:
        return loaded_meta, None, loss
    want = _tiny_model().state_dict()
    return loaded_meta, max((state[k] - want[k]).abs().max().item() for k in want), loss


def test_cpu_ram_efficient_loading_broadcasts_rank0_weights(tmp_path):
    """Accelerate's cpu_ram_efficient_loading: the weights exist on rank 0 only (the others hold a
    meta model); prepare broadcasts them into every rank's shards, non-persistent buffers rebuilt."""
    _tiny_model().save_pretrained(tmp_path)
    (meta0, diff, loss0), (meta1, _, loss1) = run_on_ranks(_rank0_only_loading, 2, str(tmp_path))
    x = torch.arange(16)[None] % 200
    want = _tiny_model()(input_ids=x, labels=x).loss.item()
    assert (meta0, meta1, diff) == (False, True, 0.0)
    assert abs(loss0 - want) < 1e-6 and abs(loss1 - want) < 1e-6, (loss0, loss1, want)

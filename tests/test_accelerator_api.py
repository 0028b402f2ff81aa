"""The Accelerate-compatible surface: prepare with loaders/schedulers, reduce, gather_for_metrics,
print, the plain `acc.backward(model(**batch).loss)` path, and argument errors."""

import pytest
import torch

from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks


def _utilities():
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(ParallelismConfig(dp_shard_size=2, tp_size=2))
    rank = dist.get_rank()
    reduced_sum = acc.reduce(torch.tensor([float(rank)]), "sum").item()
    reduced_mean = acc.reduce(torch.tensor([float(rank)]), "mean").item()
    # tp peers (ranks 0,1 and 2,3) hold the same samples: gather over dp only, in dp-rank order
    gathered = acc.gather_for_metrics(torch.tensor([acc.dp_rank * 10.0])).tolist()
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    sched_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(sched_opt, 1)
    loader, sched2 = acc.prepare(loader, sched)
    seen = [int(x) for (batch,) in loader for x in batch]
    return {
        "sum": reduced_sum,
        "mean": reduced_mean,
        "gathered": gathered,
        "seen": seen,
        "sched_same": sched2.scheduler is sched,
        "dp_rank": acc.dp_rank,
        "tp_rank": acc.rank_in("tp"),
        "main": acc.is_main_process,
    }


def test_utilities_on_fsdp2_x_tp2():
    out = run_on_ranks(_utilities, 4)
    assert [o["sum"] for o in out] == [6.0] * 4
    assert [o["mean"] for o in out] == [1.5] * 4
    assert all(o["gathered"] == [0.0, 10.0] for o in out)
    assert [o["main"] for o in out] == [True, False, False, False]
    # the loader is sharded over dp: tp peers see the same samples, dp ranks disjoint halves
    by_dp = {}
    for o in out:
        by_dp.setdefault(o["dp_rank"], []).append(o["seen"])
    assert all(len({tuple(s) for s in v}) == 1 for v in by_dp.values())
    assert sorted(by_dp[0][0] + by_dp[1][0]) == list(range(8))
    assert all(o["sched_same"] for o in out)


def _accelerate_style_losses(layout):
    """Accelerate's habit: per-rank mean loss from the model, plain acc.backward(loss)."""
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(ParallelismConfig(**layout))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randint(0, 256, (4, 16), generator=g)  # every row has the same token count
        rows = x.shape[0] // acc.dp_size
        local = x[acc.dp_rank * rows : (acc.dp_rank + 1) * rows]
        loss = model(input_ids=local, labels=local).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses


def test_plain_backward_matches_one_process_for_equal_length_rows():
    ref = run_on_ranks(_accelerate_style_losses, 1, {})[0]
    got = run_on_ranks(_accelerate_style_losses, 2, {"dp_shard_size": 2})[0]
    assert all(abs(a - b) / a < 1e-5 for a, b in zip(ref, got)), (ref, got)


def _bad_accelerator(kwargs):
    from ndparallel import Accelerator

    Accelerator(**kwargs)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"mixed_precision": "fp8"}, "mixed_precision='fp8' is not supported"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
    ],
)
def test_bad_arguments(kwargs, fragment):
    with pytest.raises(Exception, match=fragment):
        run_on_ranks(_bad_accelerator, 1, kwargs)


def _optimizer_after_step():
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(ParallelismConfig(dp_shard_size=2))
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 256, (1, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    acc.prepare(model, opt)


def test_optimizer_that_already_stepped_is_refused():
    with pytest.raises(Exception, match="already holds state"):
        run_on_ranks(_optimizer_after_step, 2)

"""DP-sharded deterministic loader: disjoint ranks, union == 1-rank batch, seeds, epochs, resume."""

import itertools

import pytest
import torch

from ndparallel.data import IGNORE_INDEX, PackedLoader, global_batch, make_batch

N, S = 50, 8


def blocks(n=N, s=S):
    """Block i holds i*1000 + arange(s+1): the first token identifies the block."""
    return (torch.arange(n).unsqueeze(1) * 1000 + torch.arange(s + 1)).int()


def ids(batch):
    return (batch["input_ids"][:, 0] // 1000).tolist()


def test_make_batch_shift_and_positions():
    b = make_batch(blocks(3))
    assert {k: tuple(v.shape) for k, v in b.items()} == {
        k: (3, S) for k in ("input_ids", "shift_labels", "position_ids")
    }
    assert all(v.dtype == torch.long for v in b.values())
    assert torch.equal(b["shift_labels"][:, :-1], b["input_ids"][:, 1:])
    assert torch.equal(b["shift_labels"], blocks(3)[:, 1:].long())
    assert torch.equal(b["position_ids"], torch.arange(S).expand(3, S))
    padded = torch.tensor([[5, 6, 7, IGNORE_INDEX, IGNORE_INDEX]])
    p = make_batch(padded)
    assert p["input_ids"].tolist() == [[5, 6, 7, 0]] and p["shift_labels"].tolist() == [[6, 7, -100, -100]]


@pytest.mark.parametrize("dp_size,mbs", [(1, 3), (2, 2), (4, 3), (5, 1)])
def test_ranks_disjoint_equal_length_drop_remainder(dp_size, mbs):
    loaders = [PackedLoader(blocks(), mbs, dp_rank=r, dp_size=dp_size, seed=3) for r in range(dp_size)]
    assert {len(ld) for ld in loaders} == {N // (dp_size * mbs)}
    seen = [[i for b in ld for i in ids(b)] for ld in loaders]
    flat = [i for s in seen for i in s]
    assert len(flat) == len(set(flat)) == len(loaders[0]) * dp_size * mbs


@pytest.mark.parametrize("dp_size,mbs,grad_accum", [(1, 2, 1), (2, 2, 3), (4, 1, 2), (3, 2, 2)])
def test_union_over_ranks_is_the_one_rank_batch(dp_size, mbs, grad_accum):
    data = blocks()
    loaders = [PackedLoader(data, mbs, dp_rank=r, dp_size=dp_size, seed=7) for r in range(dp_size)]
    one_rank = PackedLoader(data, dp_size * mbs, seed=7)
    steps = 2 * len(one_rank) // grad_accum + 1  # crosses epoch boundaries
    for step in range(steps):
        ref = global_batch(data, step, micro_batch_size=mbs, dp_size=dp_size, grad_accum=grad_accum, seed=7)
        assert len(ref) == grad_accum and ref[0]["input_ids"].shape == (dp_size * mbs, S)
        per_rank = [ld.step_micro_batches(step, grad_accum) for ld in loaders]
        for m in range(grad_accum):
            for key in ref[m]:
                assert torch.equal(torch.cat([per_rank[r][m][key] for r in range(dp_size)]), ref[m][key])
                for r in range(dp_size):  # rank r holds rows [r*B, (r+1)*B)
                    assert torch.equal(per_rank[r][m][key], ref[m][key][r * mbs : (r + 1) * mbs])
    # iterating the loaders gives the same stream as the step helper
    for r, ld in enumerate(loaders):
        stream = [b for _ in range(2) for b in ld]
        expected = [one_rank.micro_batch(k)["input_ids"][r * mbs : (r + 1) * mbs] for k in range(len(stream))]
        assert all(torch.equal(b["input_ids"], e) for b, e in zip(stream, expected))


def test_deterministic_by_seed_and_differs_per_epoch():
    a, b, c = (PackedLoader(blocks(), 5, seed=s) for s in (1, 1, 2))
    ea = [ids(x) for x in a]
    assert ea == [ids(x) for x in b]
    assert ea != [ids(x) for x in c]
    second = [ids(x) for x in a]  # next epoch
    assert second != ea and sorted(sum(second, [])) == sorted(sum(ea, []))
    assert a.epoch == 2 and a.position == 0
    a.set_epoch(0)
    assert [ids(x) for x in a] == ea
    assert [ids(x) for x in PackedLoader(blocks(), 5, shuffle=False)][0] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("stop", [0, 3, 11, 12, 13, 17])
def test_resume_equals_uninterrupted(stop):
    mbs, dp = 2, 2  # 12 micro-batches per epoch: stop=11/17 saves at / after an epoch end
    full = PackedLoader(blocks(), mbs, dp_rank=1, dp_size=dp, seed=5)
    ref = [ids(b) for b in itertools.islice(itertools.chain.from_iterable(full for _ in range(3)), 30)]
    first = PackedLoader(blocks(), mbs, dp_rank=1, dp_size=dp, seed=5)
    stream = itertools.chain.from_iterable(first for _ in range(3))
    got = [ids(b) for b in itertools.islice(stream, stop)]
    state = first.state_dict()
    resumed = PackedLoader(blocks(), mbs, dp_rank=1, dp_size=dp, seed=5)
    resumed.load_state_dict(state)
    got += [
        ids(b) for b in itertools.islice(itertools.chain.from_iterable(resumed for _ in range(3)), 30 - stop)
    ]
    assert got == ref


def test_resume_across_dp_layout_keeps_sample_position():
    one = PackedLoader(blocks(), 4, seed=0)
    it = iter(one)
    next(it), next(it)  # 8 samples consumed
    two = [PackedLoader(blocks(), 2, dp_rank=r, dp_size=2, seed=0) for r in range(2)]
    for ld in two:
        ld.load_state_dict(one.state_dict())
    assert ids(next(iter(two[0]))) + ids(next(iter(two[1]))) == ids(next(it))
    moved = one.with_dp(1, 3)
    assert moved.dp_size == 3 and moved.position == 1 and moved.state_dict()["samples_in_epoch"] == 12
    with pytest.raises(ValueError, match="multiple of"):
        one.with_dp(0, 2)  # 12 samples is not a whole number of 16-row global micro-batches


def test_errors():
    with pytest.raises(ValueError, match="fewer than dp_size"):
        PackedLoader(blocks(5), 3, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank"):
        PackedLoader(blocks(), 1, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="sequence_len"):
        PackedLoader(torch.zeros(10, dtype=torch.int32), 1)
    state = PackedLoader(blocks(), 1, seed=1).state_dict()
    with pytest.raises(ValueError, match="same data"):
        PackedLoader(blocks(), 1, seed=2).load_state_dict(state)
    state["samples_in_epoch"] = 3
    with pytest.raises(ValueError, match="multiple of"):
        PackedLoader(blocks(), 2, seed=1).load_state_dict(state)

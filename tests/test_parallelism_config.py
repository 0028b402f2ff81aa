import pytest

from ndparallel import ParallelismConfig, ParallelismConfigError


def test_defaults_and_properties():
    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, cp_size=1)
    assert pc.total_size == 8 and pc.dp_size == 4 and pc.fsdp_size == 2
    assert pc.dp_replicate_enabled and pc.dp_shard_enabled and pc.tp_enabled and not pc.cp_enabled
    assert pc.active_dims == ("dp_replicate", "dp_shard", "tp")
    assert "dp_replicate=2" in repr(pc) and "8 ranks" in repr(pc)
    assert pc.describe() == "HSDP 2×2 + TP 2"
    assert ParallelismConfig().describe() == "single device"


def test_fill_from_world():
    pc = ParallelismConfig(dp_shard_size=-1, tp_size=2).resolve(8)
    assert pc.dp_shard_size == 4 and pc.total_size == 8
    pc = ParallelismConfig(dp_replicate_size=-1, dp_shard_size=2).resolve(8)
    assert pc.dp_replicate_size == 4


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"tp_size": 0}, "tp_size=0 is invalid"),
        ({"cp_size": -1}, "cp_size=-1"),
        ({"dp_shard_size": 2.5}, "dp_shard_size must be an integer"),
        ({"dp_shard_size": "two"}, "dp_shard_size must be an integer"),
        ({"dp_shard_size": -1, "dp_replicate_size": -1}, "only one of"),
        ({"tp_size": True}, "tp_size must be an integer"),
    ],
)
def test_invalid_sizes_name_the_field(kwargs, fragment):
    with pytest.raises(ParallelismConfigError, match=fragment):
        ParallelismConfig(**kwargs)


def test_product_mismatch_message():
    pc = ParallelismConfig(2, 2, 2, 2)
    with pytest.raises(ParallelismConfigError) as e:
        pc.resolve(8)
    msg = str(e.value)
    assert "2×2×2×2" in msg and "16 ranks" in msg and "world has 8" in msg


def test_fill_not_divisible():
    with pytest.raises(ParallelismConfigError, match="do not divide"):
        ParallelismConfig(dp_shard_size=-1, tp_size=3).resolve(8)


def test_unresolved_total_size_is_an_error():
    with pytest.raises(ParallelismConfigError, match="resolve"):
        _ = ParallelismConfig(dp_shard_size=-1).total_size


def test_env_vars_ours_and_accelerates(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("NDPARALLEL_CP_SIZE", "2")
    pc = ParallelismConfig()
    assert (pc.dp_replicate_size, pc.dp_shard_size, pc.cp_size, pc.tp_size) == (1, 4, 2, 2)
    monkeypatch.setenv("NDPARALLEL_TP_SIZE", "4")  # ours wins over Accelerate's
    assert ParallelismConfig().tp_size == 4
    assert ParallelismConfig(tp_size=1).tp_size == 1  # explicit beats env


def test_env_var_not_integer(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "x")
    with pytest.raises(ParallelismConfigError, match="PARALLELISM_CONFIG_CP_SIZE"):
        ParallelismConfig()


def test_accelerate_names_and_handlers(monkeypatch):
    from ndparallel.utils import TorchContextParallelConfig

    pc = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=2, tp_size=2)
    assert pc.dp_dim_names == ["dp_replicate", "dp_shard"] and pc.non_dp_dim_names == ["tp", "cp"]
    assert pc.dp_cp_dim_names == ["dp_replicate", "dp_shard", "cp"] and pc.dp_shard_cp_dim_names == [
        "dp_shard",
        "cp",
    ]
    assert pc.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"] and pc.active_mesh_dims == [
        "dp_replicate",
        "dp_shard",
        "tp",
        "cp",
    ]
    assert (pc.data_parallel_size, pc.non_data_parallel_size, pc.sp_size, pc.cp_backend) == (4, 4, 1, "torch")
    assert pc.cp_handler.cp_comm_strategy == "allgather" and pc.tp_handler is not None
    assert ParallelismConfig().dp_cp_dim_names == [] and ParallelismConfig().cp_handler is None
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    assert ParallelismConfig(cp_size=2).cp_handler.strategy == "ring"
    assert (
        ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig("allgather")).cp_handler.strategy
        == "allgather"
    )
    with pytest.raises(ParallelismConfigError, match="sp_size=2.*cp_size=2"):
        ParallelismConfig(sp_size=2)
    with pytest.raises(ValueError, match="pass a device_type"):
        ParallelismConfig().get_device_mesh()


def test_sequence_parallel_from_the_tp_handler_or_the_environment(monkeypatch):
    """ndparallel's own ``TorchTensorParallelConfig.sequence_parallel``: given, or read from
    ``NDPARALLEL_SEQUENCE_PARALLEL`` by the handler a ``ParallelismConfig`` with ``tp_size > 1`` makes."""
    from ndparallel.utils import TorchTensorParallelConfig

    assert ParallelismConfig(tp_size=2).tp_handler.sequence_parallel is False
    monkeypatch.setenv("NDPARALLEL_SEQUENCE_PARALLEL", "1")
    assert ParallelismConfig(tp_size=2).tp_handler.sequence_parallel is True
    assert TorchTensorParallelConfig(sequence_parallel=False).sequence_parallel is False  # given wins
    monkeypatch.setenv("NDPARALLEL_SEQUENCE_PARALLEL", "yes")
    with pytest.raises(ValueError, match="NDPARALLEL_SEQUENCE_PARALLEL='yes' is not a flag"):
        ParallelismConfig(tp_size=2)


def _one_process_mesh():
    import os

    import torch.distributed as dist

    from ndparallel.runtime.distributed import shutdown

    shutdown()
    for var in ("RANK", "WORLD_SIZE"):
        os.environ.pop(var)
    pc = ParallelismConfig()
    mesh = pc.get_device_mesh("cpu")  # no group, no torchrun: a one-rank group, like a plain script
    return dist.get_world_size(), tuple(mesh.shape), pc.get_device_mesh() is mesh


def test_build_mesh_starts_a_one_rank_group_outside_torchrun():
    from ndparallel.testing import run_on_ranks

    assert run_on_ranks(_one_process_mesh, 1)[0] == (
        1,
        (1, 1, 1, 1, 1),
        True,
    )  # (pp, dp_replicate, dp_shard, cp, tp)

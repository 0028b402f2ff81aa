"""Accelerate's constructor arguments, plugins, handlers and ``accelerate launch`` environment
variables: each mapped onto ndparallel's options, or refused with a message naming it (resolution
happens before any process group exists, so these tests need no ranks)."""

import warnings

import pytest
import torch

from ndparallel.accelerator import arguments
from ndparallel.accelerator.core import Accelerator
from ndparallel.parallel.options import CPOptions, TPOptions
from ndparallel.techniques.technique_options import CompileOptions
from ndparallel.utils import (
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchDynamoPlugin,
    TorchTensorParallelConfig,
    TorchTensorParallelPlugin,
)

_NAMES = [n for n in Accelerator.__init__.__code__.co_varnames[1 : Accelerator.__init__.__code__.co_argcount]]


def _resolve(**kwargs):
    args = {n: None for n in _NAMES}
    args.update(
        device_placement=True,
        split_batches=arguments.UNSET,
        gradient_accumulation_steps=1,
        cpu=False,
        step_scheduler_with_optimizer=True,
        fsdp_options=None,
        activation_options=None,
        tp_options=None,
        cp_options=None,
        loss_options=None,
        compile_options=None,
        float8_options=None,
        qat_options=None,
        device=None,
        timeout_s=None,
    )
    args.update(kwargs)
    return arguments.resolve(args)


def test_all_21_accelerate_arguments_in_accelerates_order():
    accelerate = pytest.importorskip("accelerate")
    import inspect

    theirs = list(inspect.signature(accelerate.Accelerator.__init__).parameters)[1:]
    assert len(theirs) == 21 and _NAMES == theirs


def test_fsdp_plugin_maps_onto_fsdp_options():
    s = _resolve(
        fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            reshard_after_forward=False,
            cpu_offload=True,
            activation_checkpointing=True,
            state_dict_type="SHARDED_STATE_DICT",
            mixed_precision_policy={"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16},
        )
    )
    o = s.fsdp_options
    assert (o.reshard_after_forward, o.cpu_offload, s.activation_options.activation_checkpointing) == (
        False,
        True,
        True,
    )
    assert o.layer_classes == ("LlamaDecoderLayer",) and o.reduce_dtype == torch.bfloat16
    assert s.param_dtype == torch.bfloat16


def test_dynamo_settings_become_regional_compile(monkeypatch):
    with pytest.raises(ValueError, match="dynamo mode"):
        TorchDynamoPlugin(backend="inductor", mode="max-autotune")
    assert _resolve(dynamo_backend="inductor").compile_options == CompileOptions(
        enabled=True, backend="inductor"
    )
    assert not _resolve(dynamo_backend="no").compile_options.enabled
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    assert _resolve().compile_options.enabled


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"fsdp_version": 1}, "fsdp_version=1 is not supported.*fsdp_version=2"),
        ({"auto_wrap_policy": "size_based_wrap"}, "size_based_wrap.*transformer_based_wrap"),
        ({"sharding_strategy": "HYBRID_SHARD"}, "HYBRID_SHARD.*dp_replicate_size"),
        ({"ignored_modules": ["x"]}, "ignored_modules"),
        (
            {"activation_checkpointing": True, "activation_checkpointing_offload": True},
            "activation_checkpointing_offload",
        ),
        ({"forward_prefetch": True}, "forward_prefetch"),
        (
            {"mixed_precision_policy": {"param_dtype": torch.bfloat16, "output_dtype": torch.float32}},
            "output_dtype",
        ),
    ],
)
def test_fsdp_plugin_refuses_what_it_cannot_honour(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        FullyShardedDataParallelPlugin(**{"fsdp_version": 2, **kwargs})


def test_sharding_strategy_shard_grad_op_is_no_reshard():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (
            FullyShardedDataParallelPlugin(
                fsdp_version=2, sharding_strategy="SHARD_GRAD_OP"
            ).reshard_after_forward
            is False
        )


def test_accelerate_launch_environment_is_honoured(monkeypatch):
    """What `accelerate launch --config-file` exports for an ND-parallel FSDP2 config."""
    env = {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
        "FSDP_OFFLOAD_PARAMS": "false",
        "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
        "PARALLELISM_CONFIG_CP_SIZE": "2",
        "PARALLELISM_CONFIG_TP_SIZE": "1",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
        "PARALLELISM_CONFIG_CP_BACKEND": "torch",
        "PARALLELISM_CONFIG_SP_SIZE": "1",
        "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed",
        "PARALLELISM_CONFIG_CP_COMM_STRATEGY": "alltoall",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = _resolve()
    assert s.mixed_precision == "bf16" and s.param_dtype == torch.bfloat16
    assert s.activation_options.activation_checkpointing and not s.fsdp_options.reshard_after_forward
    assert s.fsdp_options.layer_classes == ("LlamaDecoderLayer",)
    assert s.parallelism_config.to_dict() == {
        "dp_replicate_size": 1,
        "dp_shard_size": 2,
        "cp_size": 2,
        "tp_size": 1,
    }
    assert s.cp_options.comm_strategy == "ring"  # Accelerate's "alltoall" rotation
    assert s.gradient_state_plugin.num_steps == 4


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "deepspeed"),
        ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "fp8"),
        (
            {"PARALLELISM_CONFIG_SP_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true"},
            "sp_size=2.*cp_size",
        ),
        (
            {"PARALLELISM_CONFIG_CP_BACKEND": "deepspeed", "ACCELERATE_USE_PARALLELISM_CONFIG": "true"},
            "cp_backend",
        ),
        (
            {
                "PARALLELISM_CONFIG_CP_SIZE": "2",
                "PARALLELISM_CONFIG_CP_COMM_STRATEGY": "ulysses",
                "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
            },
            "cp_comm_strategy='ulysses'",
        ),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "fsdp_version=1"),
    ],
)
def test_launch_settings_that_cannot_be_honoured_are_refused(monkeypatch, env, fragment):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=fragment):
        _resolve()


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"deepspeed_plugin": object()}, "deepspeed_plugin"),
        ({"megatron_lm_plugin": object()}, "megatron_lm_plugin"),
        (
            {"dynamo_backend": "inductor", "compile_options": CompileOptions(enabled=True)},
            "both ask for torch.compile",
        ),
        ({"mixed_precision": "fp8"}, "fp8"),
        ({"mixed_precision": "int4"}, "mixed_precision='int4'"),
        ({"kwargs_handlers": [object()]}, "kwargs_handlers: object is not supported"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
        ({"rng_types": ["xla"]}, "rng_types"),
        (
            {"dataloader_config": DataLoaderConfiguration(split_batches=True), "split_batches": True},
            "not both",
        ),
    ],
)
def test_constructor_arguments_that_cannot_be_honoured(kwargs, fragment):
    with pytest.raises((ValueError, TypeError), match=fragment):
        _resolve(**kwargs)


def test_handlers_and_small_configs():
    assert (
        GradScalerKwargs(init_scale=1024.0).build().scale == 1024.0
    )  # fp16's loss scaler (tests/test_fp16.py)
    assert GradScalerKwargs(enabled=False).build() is None
    with pytest.raises(ValueError, match="enable_async_tp"):
        TorchTensorParallelConfig(enable_async_tp=True)
    sp = ParallelismConfig(tp_size=2, tp_handler=TorchTensorParallelConfig(sequence_parallel=True))
    assert _resolve(parallelism_config=sp).tp_options.sequence_parallel
    assert not _resolve(parallelism_config=ParallelismConfig(tp_size=2)).tp_options.sequence_parallel
    with pytest.warns(UserWarning, match="tp_options.sequence_parallel=False is used"):
        assert not _resolve(parallelism_config=sp, tp_options=TPOptions()).tp_options.sequence_parallel
    with pytest.raises(ValueError, match="dispatch_batches"):
        DataLoaderConfiguration(dispatch_batches=True)
    from datetime import timedelta

    s = _resolve(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=90))])
    assert s.timeout_s == 90
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = _resolve(torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2))
    assert s.parallelism_config.tp_size == 2
    assert _resolve(parallelism_config=ParallelismConfig(cp_size=2)).cp_options.comm_strategy == "ring"
    pc = ParallelismConfig(cp_size=2, cp_handler=TorchContextParallelConfig("allgather"))
    assert _resolve(parallelism_config=pc).cp_options.comm_strategy == "allgather"
    with pytest.warns(UserWarning, match="cp_options.comm_strategy='ring' is used"):
        assert (
            _resolve(parallelism_config=pc, cp_options=CPOptions("ring")).cp_options.comm_strategy == "ring"
        )


_LAUNCH_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_offload_params: false
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
mixed_precision: bf16
num_machines: 1
num_processes: 4
parallelism_config:
  parallelism_config_cp_size: 2
  parallelism_config_dp_replicate_size: 1
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 1
  parallelism_config_cp_comm_strategy: alltoall
rdzv_backend: static
use_cpu: true
"""


@pytest.mark.slow
def test_real_accelerate_launch_config_file(tmp_path):
    """The real `accelerate launch --config_file` (an ND-parallel FSDP2 config like Accelerate's
    examples/torch_native_parallelism/configs/nd.yaml): layout, mixed precision, activation
    checkpointing, wrap class, reshard and CP strategy all reach a bare ``Accelerator()``."""
    import json
    import os
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate CLI is not installed")
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "cfg.yaml").write_text(_LAUNCH_CONFIG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            "accelerate",
            "launch",
            "--config_file",
            str(tmp_path / "cfg.yaml"),
            str(root / "tests" / "accelerate_scripts" / "launch_probe.py"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    probe = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and probe, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert json.loads(probe[0][6:]) == {
        "layout": {"dp_replicate_size": 1, "dp_shard_size": 2, "cp_size": 2, "tp_size": 1},
        "mixed_precision": "bf16",
        "activation_checkpointing": True,
        "reshard_after_forward": False,
        "layer_classes": ["LlamaDecoderLayer"],
        "cp": "ring",
        "device": "cpu",
        "world": 4,
    }

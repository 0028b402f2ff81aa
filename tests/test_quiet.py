"""runtime/quiet.py drops the named library lines by logger and message, and nothing else."""

import logging

from ndparallel.runtime.quiet import quiet_library_noise


def test_library_noise_dropped_by_logger_and_message(caplog):
    quiet_library_noise()
    quiet_library_noise()  # idempotent: one filter per logger
    assert len(logging.getLogger("torchao").filters) == 1
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning(
            "<enum 'X'> is an Enum subclass and is now natively supported by torch.compile"
        )
        logging.getLogger("torchao").warning("another torchao warning")  # kept: not the known line
        logging.getLogger("ndparallel.x").warning("Failed to load our.so")  # ours: never filtered
    assert [r.getMessage() for r in caplog.records] == ["another torchao warning", "Failed to load our.so"]


def test_output_origin_tells_ndparallel_from_a_library():
    """``output_origin.py``, the quiet tests' judge: a line ndparallel prints (itself or through
    rich) is its own; a library's warning, a library's log record and bytes written straight to the
    descriptor (as C++ code does) are not, whatever they say."""
    import os
    import warnings

    from output_origin import recorded_output

    ours = {"__name__": "ndparallel.somewhere"}
    theirs = {"__name__": "somelib.module"}
    early = logging.getLogger("somelib.early")  # its handler made before, as torch's is at import
    early.addHandler(logging.StreamHandler())
    early.propagate = False
    with recorded_output() as output, warnings.catch_warnings():
        warnings.simplefilter("always")
        exec("print('step 1: loss 2.0')", ours)
        exec("from rich.console import Console\nConsole(width=80).print('a table row')", ours)
        exec("import warnings\nwarnings.warn('step 1: loss 2.0 is deprecated')", theirs)
        exec("import logging\nlogging.getLogger('somelib').warning('a library logs')", theirs)
        early.warning("an early handler's record")
        os.write(2, b"[W1207 ProcessGroupGloo.cpp:42] a C++ warning\n")
        exec("print('step 2: loss 1.0', flush=True)", ours)
    foreign = output.foreign()
    assert "step 1: loss 2.0" in output.own and "a table row" in output.own, output.own
    assert any("is deprecated" in line for line in foreign), foreign
    assert "a library logs" in foreign and "[W1207 ProcessGroupGloo.cpp:42] a C++ warning" in foreign
    assert "an early handler's record" in foreign
    assert not any(line.startswith(("step", "a table")) for line in foreign), foreign


def test_the_trainer_doors_import_in_silence():
    """``from ndparallel.trl import ...`` (which imports ``ndparallel.transformers``) prints
    nothing: transformers' Trainer imports torchao, whose "Failed to load ... .so" and pytree lines
    a user of the door did not ask for."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("trl")
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}  # the suite's; transformers says it
    proc = subprocess.run(
        [sys.executable, "-c", "import ndparallel.trl"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


def _step_recording_warnings(setup, layout):
    import warnings

    from ndparallel.tools.equivalence import train_under_layout

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_under_layout(setup, layout)
    return [f"{w.filename}: {w.message}" for w in caught]


def test_python_api_ranks_print_no_library_line():
    """A Python-API run (the Accelerator on FSDP 2 × TP 2: prepare, steps, gathering the
    parameters) warns and logs nothing from a library: the ranks' engines drop what the command
    line drops (FSDP2's "returned a view tensor", DTensor's "sequential all_gather", torchao's)."""
    from ndparallel.models.presets import preset_config
    from ndparallel.parallel.options import TPOptions
    from ndparallel.testing import run_on_ranks
    from ndparallel.tools.equivalence import TrainSetup
    from output_origin import recorded_output

    setup = TrainSetup(
        preset_config("tiny-llama"),
        steps=1,
        global_micro_batch=4,
        seq_len=32,
        optimizer="sgd",
        lr=0.5,
        parallel_kwargs={"tp_options": TPOptions()},
    )
    with recorded_output() as output:
        caught = run_on_ranks(_step_recording_warnings, 4, setup, {"dp_shard_size": 2, "tp_size": 2})
    assert caught == [[]] * 4, caught
    assert output.foreign() == [], output.foreign()

"""Run by ``accelerate launch --config-file``: an ``Accelerator()`` with no arguments reports what it
took from the launcher's environment (rank 0 prints one ``PROBE {json}`` line)."""

import json

from ndparallel import Accelerator

acc = Accelerator()
if acc.is_main_process:
    print(
        "PROBE",
        json.dumps(
            {
                "layout": acc.parallelism_config.to_dict(),
                "mixed_precision": acc.mixed_precision,
                "activation_checkpointing": acc.activation_options.activation_checkpointing,
                "reshard_after_forward": acc.fsdp_options.reshard_after_forward,
                "layer_classes": list(acc.fsdp_options.layer_classes or ()),
                "cp": acc.cp_options.comm_strategy,
                "device": acc.device.type,
                "world": acc.num_processes,
            }
        ),
        flush=True,
    )
acc.end_training()

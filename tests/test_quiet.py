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

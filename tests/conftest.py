"""Shared fixtures. ``torch`` and ``transformers`` are imported once here so that the forked ranks
of ``ndparallel.testing.run_on_ranks`` start in ~0.1 s instead of re-importing them."""

import os

# The suite runs on CPU/gloo ranks even on a machine with GPUs: an Accelerator built in a test (or
# a `ndparallel train` it starts) reads this instead of picking the visible GPUs.
os.environ["NDPARALLEL_DEVICE"] = "cpu"

import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401

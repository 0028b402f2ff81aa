"""Shared fixtures. ``torch`` and ``transformers`` are imported once here so that the forked ranks
of ``ndparallel.testing.run_on_ranks`` start in ~0.1 s instead of re-importing them."""

import torch  # noqa: F401
import transformers  # noqa: F401

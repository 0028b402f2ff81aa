"""The ``Accelerator`` facade (Hugging Face Accelerate's API over ndparallel's strategies), split
by concern: ``core`` assembles the class; ``arguments`` / ``plugins`` / ``handlers`` resolve its
arguments; ``preparing`` and ``wrappers`` are ``prepare``; ``processes``, ``collectives``,
``stepping``, ``context``, ``saving`` and ``tracking`` hold the methods."""

from ndparallel.accelerator.core import Accelerator

__all__ = ["Accelerator"]

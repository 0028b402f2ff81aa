"""``TrainingArguments``: transformers' own, field for field, except that ndparallel starts the
process group (its timeouts, its device choice, ranks tied to their launcher) before transformers
sets up its devices on it. ``parallelism_config`` takes ndparallel's ``ParallelismConfig``; left
unset it is read from the ``PARALLELISM_CONFIG_*`` / ``NDPARALLEL_*`` environment variables when
``accelerate launch`` or ``ndparallel launch`` set them (the door's Accelerator does that).

``parallel_arguments(SomeArguments)`` is the same change for any ``TrainingArguments`` subclass (TRL's
configs): ``ParallelArguments`` mixed in first."""

from __future__ import annotations

import functools
import os
from functools import cached_property

import transformers

from ndparallel.runtime.distributed import init_distributed
from ndparallel.transformers.door_refusals import refuse_unsupported


class ParallelArguments:
    """Mix into a ``TrainingArguments`` subclass (first base): what the door cannot honour is refused
    as the arguments are built, and ndparallel starts the process group."""

    def __post_init__(self):
        refuse_unsupported(self)
        super().__post_init__()

    def __reduce_ex__(self, protocol):
        """A class ``parallel_arguments`` made has no importable name of its own: its instances are
        pickled (``training_args.bin``) by the class it was made from, and rebuilt through
        ``parallel_arguments`` (the same class again)."""
        made_from = getattr(type(self), "_made_from", None)
        if made_from is None:
            return super().__reduce_ex__(protocol)
        return rebuilt_arguments, (made_from,), self.__dict__.copy()

    @cached_property
    def _setup_devices(self):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched ranks: the group, ndparallel's way
            init_distributed("cpu" if self.use_cpu else None, float(self.ddp_timeout))
        return transformers.TrainingArguments._setup_devices.func(self)


class TrainingArguments(ParallelArguments, transformers.TrainingArguments):
    """transformers' ``TrainingArguments`` for ``ndparallel.transformers.Trainer`` (any field it
    cannot honour on a layout is refused when the trainer is built, naming the field)."""


@functools.cache
def parallel_arguments(arguments_class: type) -> type:
    """``arguments_class`` (a ``TrainingArguments`` subclass, e.g. TRL's ``SFTConfig``) with
    ``ParallelArguments`` mixed in first; the same class each time it is asked."""
    if not (
        isinstance(arguments_class, type) and issubclass(arguments_class, transformers.TrainingArguments)
    ):
        raise TypeError(f"parallel_arguments takes a TrainingArguments subclass, got {arguments_class!r}")
    if issubclass(arguments_class, ParallelArguments):
        return arguments_class
    return type(
        arguments_class.__name__,
        (ParallelArguments, arguments_class),
        {"__module__": __name__, "__doc__": arguments_class.__doc__, "_made_from": arguments_class},
    )


def rebuilt_arguments(arguments_class: type):
    """An empty instance of ``parallel_arguments(arguments_class)``, for unpickling (its fields follow)."""
    cls = parallel_arguments(arguments_class)
    return cls.__new__(cls)

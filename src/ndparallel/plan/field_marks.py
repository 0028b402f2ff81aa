"""What a field of the planner's ``Settings`` (``plan/settings.py``) or ``PlanRequest``
(``plan/search/evaluation.py``) says of itself besides its value, as dataclass field metadata: the
``ndparallel plan`` flag that sets it (``flag``; the adapter's: ``adapter``), the ``--explain`` key
that pins it (``pin``), and whether it is a setting of the optimizer step (``STEP``)."""

from __future__ import annotations

from collections.abc import Callable

GROUPS = (
    "batch, checkpointing and precision",
    "communication and kernels",
    "adapters and quantisation",
    "long context",
    "pipeline",
)
"""The ``ndparallel plan --help`` groups of the run's flags, in their order."""
BATCH, COMMS, ADAPTERS, LONG_CONTEXT, PIPELINE = GROUPS


def flag(help: str | None = None, group: str = BATCH, **how) -> dict:
    """A field's metadata (``Settings``, ``PlanRequest``): the ``ndparallel plan`` flag that sets it
    (``plan/cli/parser.py`` adds every one, ``plan/cli/flag_checks.py`` checks them): ``--FIELD``, or
    ``--no-FIELD`` for a switch on by default. ``how``: argparse's ``choices`` / ``metavar`` /
    ``nargs`` / ``const`` / ``default`` (else ``DEFAULT_SETTINGS``' value, a request's field's);
    ``name``: the flag's own name; ``positive``: a whole number >= 1; ``needs``: the field whose flag
    it needs; ``given``: records ``<field>_given`` when named; ``refuses``: (argument, value, why)
    it cannot be given with. ``group``: its ``--help`` group (``GROUPS``)."""
    return {"flag": {"help": help, "group": group, **how}}


STEP = {"step": True}
"""A field's metadata: a setting of the optimizer step or of accumulation, which the cost of one
forward and backward does not read (``plan/time/compute.py``'s ``STEP_FIELDS``; its default: a neutral
step)."""


def adapter(help: str | None = None, **how) -> dict:
    """A field's metadata (``Settings``): a setting of the adapter, which ``ndparallel plan``'s
    adapter flags decide together (``plan/cli/main.py``'s ``build_request``: ``--adapter``, the rank, the
    tables trained in full), not one flag each. ``help``: the field's own flag, ``--FIELD``, added
    after ``--adapter`` and needing it, None (not given) by default; ``how``: argparse's ``type``."""
    return {"adapter": {"help": help, **how} if help else None}


def whole(key: str, text: str) -> int:
    """An ``--explain`` key's value (``pin``) as a whole number."""
    return int(text)


def on_off(key: str, text: str) -> bool:
    """An ``--explain`` key's value (``pin``) as a switch: on / off (true / false, 1 / 0)."""
    if text.lower() not in ("on", "off", "true", "false", "1", "0"):
        raise ValueError(f"{key}={text!r}: use on or off")
    return text.lower() in ("on", "true", "1")


def pin(*aliases: str, read: Callable[[str, str], object] = whole) -> dict:
    """A field's metadata (``PlanRequest``'s choices per layout): ``ndparallel plan --explain``'s
    key that pins it (``plan/cli/parser.py``'s ``parse_layout``), the field's name or one of
    ``aliases``, its value ``read(key, text)`` (``whole``, ``on_off``)."""
    return {"pin": (aliases, read)}

"""What a field of the planner's ``Settings`` (``plan/settings.py``) or ``PlanRequest``
(``plan/search.py``) says of itself besides its value, as dataclass field metadata: the
``ndparallel plan`` flag that sets it (``flag``), and whether it is a setting of the optimizer step
(``STEP``)."""

from __future__ import annotations

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
    (``plan/cli_arguments.py`` adds every one, ``plan/cli_checks.py`` checks them): ``--FIELD``, or
    ``--no-FIELD`` for a switch on by default. ``how``: argparse's ``choices`` / ``metavar`` /
    ``nargs`` / ``const`` / ``default`` (else ``DEFAULT_SETTINGS``' value, a request's field's);
    ``name``: the flag's own name; ``positive``: a whole number >= 1; ``needs``: the field whose flag
    it needs; ``given``: records ``<field>_given`` when named; ``refuses``: (argument, value, why)
    it cannot be given with. ``group``: its ``--help`` group (``GROUPS``)."""
    return {"flag": {"help": help, "group": group, **how}}


STEP = {"step": True}
"""A field's metadata: a setting of the optimizer step or of accumulation, which the cost of one
forward and backward does not read (``plan/compute.py``'s ``STEP_FIELDS``; its default: a neutral
step)."""

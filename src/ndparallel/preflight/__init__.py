"""Everything ``ndparallel train`` checks and says before a rank starts, as one list of named checks
run in one pass (``checks``: ``CHECKS``, ``run_checks``) by ``train``, ``--dry-run`` and ``verify``.
The helpers the checks call: the model (``model_check``), a quantised base (``qlora_check``), what
needs the model but no data (``dry_checks``), pipeline stages (``pipeline_check``), what lives on
this machine (``local``), the world size and device (``world``), and the notes — fields that differ
from Axolotl (``compat``), the data (``data_notes``). ``plan_text`` prints the resolved run for
``--dry-run``. Above the trainer: it reads the typed config and the trainer's build steps, and
nothing below it knows it exists."""

"""Everything ``ndparallel train`` checks and says before a rank starts: the layout against the model
and the machine (``checks``), the model (``model_check``), a quantised base (``qlora_check``), the
data (``data_notes``), the notes of a dry run (``dry_checks``) and the resolved plan it prints
(``plan_text``). Above the trainer: it reads the typed config and the trainer's build steps, and
nothing below it knows it exists."""

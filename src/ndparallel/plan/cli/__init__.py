"""``ndparallel plan``: the one flag table (``flags.py``), the parser it builds, the checks of the
values, the request the flags give, and the output (tables, JSON, ``--explain``, a written config)."""

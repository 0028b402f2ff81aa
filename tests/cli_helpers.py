"""Running the ``ndparallel`` command line in the pytest process (fast: no interpreter start-up)."""

from __future__ import annotations


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """``ndparallel ARGS`` in-process: (exit code, stdout, stderr). What the test printed before
    (its own setup, progress bars) is dropped first."""
    from ndparallel.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def forbid_launch(monkeypatch) -> None:
    """Make starting ranks fail the test at once (a case that must be refused before launch), with
    no Hub access and no inherited rank variables."""
    import ndparallel.runtime.launch as launch

    def refuse(*a, **k):
        raise AssertionError(f"ranks were launched: {a}")

    monkeypatch.setattr(launch, "relaunch_self", refuse)
    monkeypatch.setattr(launch, "run_here", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

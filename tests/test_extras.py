"""A feature asked for without its optional extra is one line naming the extra (``pip install
'ndparallel[lora]'``), exit 2 before any rank starts, no traceback — from ``train``, ``verify``,
``plot`` and the Python API alike; a feature not asked for needs none (a run without matplotlib
trains and says once that it skips the PNG). Packages are hidden as an uninstalled one looks to
``import`` and ``importlib.util.find_spec`` (``sys.modules[name] = None``); the installed wheel
without extras runs every command in ``scripts/wheel_check.py``."""

from __future__ import annotations

import sys

import pytest

from cli_helpers import forbid_launch, run_cli
from ndparallel.runtime.extras import MissingExtra

CONFIG = "base_model: tiny-llama\ndatasets: [{path: 'builtin:stdlib', max_bytes: 20000}]\nsequence_len: 32\n"


def _hide(monkeypatch, *modules):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    forbid_launch(monkeypatch)
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG + f"output_dir: {tmp_path / 'out'}\n")
    return path


@pytest.mark.parametrize(
    "hidden, sets, needs, extras",
    [
        (["peft"], ["adapter=lora"], "adapter: lora needs peft", "lora"),
        (
            ["torchao"],
            ["adapter=qlora", "load_in_4bit=true"],
            "adapter: qlora with load_in_4bit needs torchao",
            "qlora",
        ),
        (["torchao"], ["fp8=true"], "fp8: true needs torchao", "fp8"),
        (["torchao"], ["qat={weight_dtype: int4, group_size: 16}"], "qat needs torchao", "qat"),
        (["torchao"], ["optimizer=adamw_8bit"], "optimizer: adamw_8bit needs torchao", "qlora"),
        (
            ["peft", "torchao", "wandb"],
            ["adapter=lora", "fp8=true", "wandb_project=p", "wandb_mode=offline"],
            "adapter: lora needs peft; fp8: true needs torchao; the wandb tracker needs wandb",
            "lora,fp8,trackers",
        ),
    ],
    ids=["lora", "qlora", "fp8", "qat", "lowbit-optimizer", "three-at-once"],
)
def test_train_without_the_extra_is_one_line_naming_it(cfg, capsys, monkeypatch, hidden, sets, needs, extras):
    _hide(monkeypatch, *hidden)
    code, out, err = run_cli(capsys, "train", cfg, *[a for s in sets for a in ("--set", s)])
    line = f"ndparallel train: error: {needs}, not installed here: pip install 'ndparallel[{extras}]'"
    assert (code, err.strip()) == (2, line), out + err


def test_verify_and_dry_run_say_the_same(cfg, capsys, monkeypatch):
    _hide(monkeypatch, "peft")
    for command in (["verify"], ["train", "--dry-run"]):
        code, _, err = run_cli(capsys, *command[:1], cfg, *command[1:], "--set", "adapter=lora")
        assert code == 2 and err.strip().endswith("pip install 'ndparallel[lora]'"), (command, err)
        assert len(err.strip().splitlines()) == 1, err


def test_plot_without_matplotlib(tmp_path, capsys, monkeypatch):
    """``ndparallel plot`` asked for: refused in one line; after ``train`` (not asked for): said
    once that the PNG is skipped, and how to draw it later."""
    from ndparallel.cli.commands import _plot_curves

    _hide(monkeypatch, "matplotlib")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens_per_s": 10}\n')
    code, _, err = run_cli(capsys, "plot", tmp_path)
    assert (code, err.strip()) == (
        2,
        "ndparallel plot: error: the loss curve needs matplotlib, not installed here: "
        "pip install 'ndparallel[plot]'",
    )
    _plot_curves(tmp_path)
    out = capsys.readouterr().out
    assert out == (
        f"loss curve: skipped: no matplotlib here (pip install 'ndparallel[plot]', then `ndparallel plot "
        f"{tmp_path}`)\n"
    )
    assert not (tmp_path / "metrics.png").exists()


def test_python_api_raises_an_import_error_naming_the_extra(monkeypatch, tmp_path):
    import torch

    from ndparallel.models.adapters import lora_config
    from ndparallel.models.quantized import NF4Config, quantize_linears
    from ndparallel.optim.build import build_optimizer
    from ndparallel.techniques.float8 import apply_float8
    from ndparallel.techniques.technique_options import Float8Options
    from ndparallel.tools.plot import plot_run

    _hide(monkeypatch, "peft", "torchao", "matplotlib")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    calls = {
        "lora": lambda: lora_config(r=4),
        "qlora": lambda: quantize_linears(model, NF4Config()),
        "fp8": lambda: apply_float8(model, Float8Options(enabled=True, emulate=True)),
        "plot": lambda: plot_run(tmp_path),
    }
    for extra, call in calls.items():
        with pytest.raises(ImportError, match=rf"pip install 'ndparallel\[{extra}\]'$") as e:
            call()
        assert isinstance(e.value, MissingExtra) and "\n" not in str(e.value)
    with pytest.raises(ImportError, match=r"optimizer: adamw_8bit needs torchao.*'ndparallel\[qlora\]'$"):
        build_optimizer(model, "adamw_8bit", lr=1e-3)


def test_any_command_turns_a_missing_extra_into_one_line(capsys, monkeypatch):
    """A package of an extra imported deep inside a command (e.g. export of a LoRA run's
    checkpoint without peft): the command line says the one line, exit 2."""
    import ndparallel.cli.commands as commands

    def export(argv):
        raise MissingExtra("LoRA needs peft, not installed here: pip install 'ndparallel[lora]'")

    monkeypatch.setattr(commands, "run_export", export)
    code, out, err = run_cli(capsys, "export", "a", "b")
    assert (code, out, err) == (
        2,
        "",
        "ndparallel export: error: LoRA needs peft, not installed here: pip install 'ndparallel[lora]'\n",
    )

"""Online trackers need credentials and a reachable server: checked before any rank starts.

Without them W&B's ``wandb.init`` raises on the main rank after start-up (``UsageError: No API
key configured``, Axolotl's behaviour too), killing the other ranks; an MLflow or SwanLab server
that cannot be reached hangs or fails there the same way. ``tracker_problem`` says so in one line
with the fix (an offline mode, a login); ``tracker_notes`` says where an offline tracker writes.
"""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from ndparallel.runtime.network import reachable

WANDB_HOST = "https://api.wandb.ai"
SWANLAB_HOST = "https://api.swanlab.cn"


def tracker_problem(cfg, env: Mapping[str, str] | None = None) -> str | None:
    """The first online tracker of ``cfg`` without credentials or unreachable, as one line."""
    env = os.environ if env is None else env
    names = cfg.trackers()
    if "wandb" in names and wandb_mode(cfg, env) in ("online", "shared"):
        base = env.get("WANDB_BASE_URL", WANDB_HOST)
        if not env.get("WANDB_API_KEY") and not _netrc_has(urlparse(base).hostname or "", env):
            return (
                "wandb_project is set (W&B online) but this machine has no W&B API key (WANDB_API_KEY unset, "
                f"no {urlparse(base).hostname} entry in {_netrc_path(env)}): run `wandb login` (or set "
                "WANDB_API_KEY), or set wandb_mode: offline (`wandb sync` uploads the run later) or disabled"
            )
        if not reachable(base):
            return (
                f"wandb_project is set (W&B online) but {base} cannot be reached from here: set wandb_mode: "
                "offline (`wandb sync` uploads the run later), or fix the network / WANDB_BASE_URL"
            )
    if "mlflow" in names:
        uri = cfg.mlflow_tracking_uri or env.get("MLFLOW_TRACKING_URI") or ""
        if uri.startswith(("http://", "https://")) and not reachable(uri):
            return (
                f"mlflow_tracking_uri={uri!r} cannot be reached from here: start the tracking server, or "
                "remove mlflow_tracking_uri to log to ./mlruns (a local file store)"
            )
    if "swanlab" in names and (cfg.swanlab_mode or env.get("SWANLAB_MODE") or "cloud") in ("cloud", "online"):
        if not env.get("SWANLAB_API_KEY") and not (Path.home() / ".swanlab" / ".netrc").is_file():
            return (
                "swanlab_project is set (SwanLab cloud) but this machine has no SwanLab API key "
                "(SWANLAB_API_KEY unset, no ~/.swanlab/.netrc): run `swanlab login`, or set swanlab_mode: "
                "offline (`swanlab sync` uploads it later) or local"
            )
    return None


def tracker_notes(cfg, env: Mapping[str, str] | None = None) -> list[str]:
    """Where trackers that write locally put the run (said once before launch)."""
    env = os.environ if env is None else env
    names, notes = cfg.trackers(), []
    if "mlflow" in names and not (cfg.mlflow_tracking_uri or env.get("MLFLOW_TRACKING_URI")):
        notes.append(
            "mlflow: no mlflow_tracking_uri, so runs are logged to ./mlruns (a local file store) in "
            "the directory train starts from"
        )
    return notes


def wandb_mode(cfg, env: Mapping[str, str]) -> str:
    """The mode W&B will run in: the config's, else ``WANDB_MODE``, else online."""
    return cfg.wandb_mode or env.get("WANDB_MODE") or "online"


def _netrc_path(env: Mapping[str, str]) -> str:
    return env.get("NETRC") or str(Path.home() / ".netrc")


def _netrc_has(host: str, env: Mapping[str, str]) -> bool:
    path = _netrc_path(env)
    try:
        return bool(host) and netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False

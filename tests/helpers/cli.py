"""The command line in a test: in this process (a subprocess costs ~10 s of imports here), or as a subprocess
(kills, signals, several processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]


def in_process(*args: str, model: Optional[type] = None, quiet: bool = False) -> Any:
    """``moco-lightning *args`` in this process (``model``: the CLI over that module class, e.g.
    ``LinearClassifier``; default the pretraining methods, MoCo unless the config names another); the CLI object.
    ``quiet``: warnings ignored."""
    from moco_lightning import MoCo, Pretraining
    from moco_lightning.cli import run_cli

    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        if model is None:
            return run_cli(Pretraining, list(args), default_model=MoCo)
        return run_cli(model, list(args))


def built(config: Any, *overrides: str) -> Any:
    """The CLI of ``moco-lightning fit --config config *overrides`` built (model, datamodule, Trainer), not run."""
    from moco_lightning import MoCo, Pretraining
    from moco_lightning.cli import make_cli

    return make_cli(Pretraining, ["--config", str(config), *overrides], MoCo, run=False)


def cli_main(*args: str) -> int:
    """``moco-lightning *args`` through its ``main`` in this process (every command: export, evaluate, linear...);
    its exit code."""
    from moco_lightning.cli import main

    try:
        main(list(args))
    except SystemExit as e:
        return e.code
    return 0


def subprocess_env(**extra: str) -> dict:
    """A subprocess's environment: the tests' helpers importable (config class paths ``helpers.callbacks...``), one
    thread (runs with other thread counts sum their floats in another order: not bit-equal), unbuffered output."""
    return dict(os.environ, PYTHONPATH=str(ROOT / "tests"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)


def run(args: list, cwd: Any = None, timeout: int = 240, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``args`` as a subprocess (``moco-lightning ...`` as ``python -m moco_lightning ...`` when it starts with
    "moco-lightning"), its output captured."""
    if args and args[0] == "moco-lightning":
        args = [sys.executable, "-m", "moco_lightning", *args[1:]]
    return subprocess.run(args, cwd=cwd, env=env or subprocess_env(), capture_output=True, text=True, timeout=timeout)

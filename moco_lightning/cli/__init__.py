"""The ``moco-lightning`` command: Lightning's CLI over the pretraining modules (:class:`MoCo` unless the config's
``model: class_path:`` names another: ``moco_lightning.MoCoV3``, ``.SimCLR``, ``.BYOL``, ``.SwAV``...) and any
datamodule.

    moco-lightning fit --config configs/quickstart.yaml
    moco-lightning fit --config configs/quickstart.yaml --ckpt_path last     # resume the newest run
    moco-lightning fit --config configs/byol_fashion_mnist.yaml             # another method: its config's class_path
    moco-lightning fit --config configs/moco_v2.yaml --data.init_args.data_dir /data/imagenet
    python -m moco_lightning fit --print_config
    moco-lightning export --ckpt last.ckpt --out backbone.pt

What it adds to LightningCLI:

- ``--ckpt_path last`` resumes the newest run under the logger's ``save_dir/name`` (its ``last.ckpt``) and keeps
  logging into that run's ``version_N``. Lightning alone looks for "last" only in the new run's own folder, finds
  nothing and silently starts from scratch. With no earlier run it says so in one line and starts a new one.
- Resuming with model settings that differ from the checkpoint's: a structural one (backbone, width, K, dim...)
  is an error naming each; any other is replaced by the checkpoint's value (what Lightning does) with a warning
  naming each, instead of silently.
- A bad setting or input ends with its message alone (``error: ...``, exit code 2); ``MOCO_LIGHTNING_DEBUG=1``
  shows the traceback.
- ``fit`` ends with a table of the final metrics (and the count of unreadable images skipped, if any).

Every command lives here: ``fit`` and the other Lightning subcommands (``app``), ``evaluate``, ``export``, ``embed``
and ``linear``, each a module with a ``main(argv)``, dispatched from :data:`COMMANDS`. Imports: everything; nothing
imports the CLI (the computation each command runs is importable without it).
"""

from __future__ import annotations

import sys
from typing import Optional

from moco_lightning.cli.app import (
    REFUSED,
    SUBCOMMANDS,
    MoCoCLI,
    final_metrics_table,
    from_config,
    make_cli,
    run_cli,
)
from moco_lightning.cli.messages import (
    CLI_HELP,
    COMMANDS,
    bad_choice,
    condense_parser_error,
    known_classes,
    missing_argument,
    yaml_error,
)
from moco_lightning.cli.resume import check_checkpoint_class, newest_readable, resolve_last_checkpoint
from moco_lightning.modules.distributed import end_process_group

__all__ = [
    "CLI_HELP",
    "COMMANDS",
    "REFUSED",
    "SUBCOMMANDS",
    "MoCoCLI",
    "bad_choice",
    "check_checkpoint_class",
    "condense_parser_error",
    "end_process_group",
    "final_metrics_table",
    "from_config",
    "known_classes",
    "main",
    "make_cli",
    "missing_argument",
    "newest_readable",
    "resolve_last_checkpoint",
    "run_cli",
    "yaml_error",
]


def _linear(argv: list[str], args: Optional[list[str]]) -> None:
    from moco_lightning.cli.linear import main as linear_main

    if args is None:  # LightningCLI reads the command line itself: without the subcommand's name
        sys.argv = [sys.argv[0], *argv]
    return linear_main(None if args is None else argv, prog="moco-lightning linear")


def _pretraining(args: Optional[list[str]]) -> None:
    from moco_lightning.methods.base import Pretraining
    from moco_lightning.methods.moco import MoCo

    try:
        run_cli(Pretraining, args, default_model=MoCo)
    finally:
        end_process_group()


def main(args: Optional[list[str]] = None) -> None:
    """``moco-lightning <command> ...``: one of :data:`COMMANDS`, else LightningCLI over the pretraining methods."""
    import importlib

    argv = sys.argv[1:] if args is None else args
    command = argv[0] if argv else None
    if command == "linear":
        return _linear(argv[1:], args)
    if command in COMMANDS:
        return importlib.import_module(COMMANDS[command]).main(argv[1:])
    return _pretraining(args)

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
"""

from __future__ import annotations

import sys
from typing import Optional

from ..distributed import end_process_group
from .app import (
    REFUSED,
    SUBCOMMANDS,
    MoCoCLI,
    final_metrics_table,
    from_config,
    make_cli,
    run_cli,
)
from .messages import CLI_HELP, bad_choice, condense_parser_error, known_classes, missing_argument, yaml_error
from .resume import check_checkpoint_class, newest_readable, resolve_last_checkpoint

__all__ = [
    "CLI_HELP",
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


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["export"]:
        from ..export import main as export_main

        return export_main(argv[1:])
    if argv[:1] == ["evaluate"]:
        from .evaluate import main as evaluate_main

        return evaluate_main(argv[1:])
    if argv[:1] == ["embed"]:
        from ..embed import main as embed_main

        return embed_main(argv[1:])
    if argv[:1] == ["linear"]:
        from .linear import main as linear_main

        if args is None:  # LightningCLI reads the command line itself: without the subcommand's name
            sys.argv = [sys.argv[0], *argv[1:]]
        return linear_main(None if args is None else argv[1:], prog="moco-lightning linear")
    from ..base import Pretraining
    from ..moco import MoCo

    try:
        run_cli(Pretraining, args, default_model=MoCo)
    finally:
        end_process_group()

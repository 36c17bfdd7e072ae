"""``ckpt_path`` read weights-only and checked before the weights meet the module."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from moco_lightning.training.checkpoint_io import load_checkpoints_safely


class SafeCheckpoints(Callback):
    """``setup`` (before the Trainer restores a ``ckpt_path``): the Trainer reads checkpoints through
    :func:`~moco_lightning.training.checkpoint_io.read_checkpoint` (``weights_only=True``), and a module that checks
    checkpoints (``check_checkpoint``: the class that wrote it, its structure, its format, the processes of a run cut
    mid-epoch) checks each as it is read, before Lightning loads its weights. With a checkpoint IO of the user's
    own, the check runs at ``on_load_checkpoint`` instead (after the weights)."""

    def __init__(self) -> None:
        self._reads = False  # the Trainer's checkpoint IO is ours: it checks as it reads

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        check = getattr(pl_module, "check_checkpoint", None)
        self._reads = load_checkpoints_safely(trainer, check and (lambda ckpt: check(ckpt, trainer.state.fn == "fit")))

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        check = getattr(pl_module, "check_checkpoint", None)
        if check is not None and not self._reads:
            check(checkpoint, trainer.state.fn == "fit")

"""A non-finite loss stops every rank before a checkpoint holds the bad weights
(:mod:`moco_lightning.training.nan_guard`: the step records a flag on the device; this callback reads them)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback


class NanStop(Callback):
    """Reads the module's :class:`~moco_lightning.training.nan_guard.NanGuard` (``pl_module.nan_guard``) at its check
    steps (after the step that logs, at least every ``MAX_UNREAD``), before every checkpoint and at the end of
    training, carrying the preemption's signal in the same all-reduce; refuses to save non-finite weights."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.nan_guard.reset()
        pl_module.nan_guard.watching = True  # the steps record their flags (nobody reads them without this callback)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if pl_module.nan_guard.due:
            pl_module.nan_guard.check(pl_module.preemption.signum)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        pl_module.nan_guard.check(pl_module.preemption.signum)
        bad = [name for name, p in pl_module.named_parameters() if not torch.isfinite(p).all()]
        if bad:
            raise FloatingPointError(
                f"{type(pl_module).__name__}: refusing to write a checkpoint with non-finite weights in {bad[:5]}"
            )

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        pl_module.nan_guard.check(pl_module.preemption.signum)
        pl_module.nan_guard.watching = False

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        pl_module.nan_guard.reset()
        pl_module.nan_guard.watching = False

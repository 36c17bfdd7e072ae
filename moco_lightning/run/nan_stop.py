"""A non-finite loss stops every rank before a checkpoint holds the bad weights
(:mod:`moco_lightning.training.nan_guard`): after each step this callback records the loss's flag on the device, and
reads the flags at the check steps. The training step itself does nothing for it (``on_nan="skip"`` aside, which must
read each loss before the backward)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback


class NanStop(Callback):
    """Records each step's flag in the module's :class:`~moco_lightning.training.nan_guard.NanGuard`
    (``pl_module.nan_guard``) and reads the flags at its check steps (after the step that logs, at least every
    ``MAX_UNREAD``), before every checkpoint and at the end of training, carrying the preemption's signal in the same
    all-reduce; refuses to save non-finite weights."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.nan_guard.reset()
        pl_module.nan_guard.watching = True  # SaveOnSignal: the signal rides on this callback's all-reduce

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._where = f"at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {batch_idx})"
        # read on the host only when Lightning reads its logged metrics: every log_every_n_steps steps (at most 100)
        every = min(max(1, trainer.log_every_n_steps), pl_module.nan_guard.MAX_UNREAD)
        self._check = (trainer.global_step + 1) % every == 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        guard = pl_module.nan_guard
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs  # None: a batch skipped (on_nan="skip")
        if guard.on_nan == "raise" and isinstance(loss, torch.Tensor):
            guard.record(loss, self._where, pl_module.nan_hints, pl_module.split_batch(batch)[0], self._check)
        if guard.due:
            guard.check(pl_module.preemption.signum)

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

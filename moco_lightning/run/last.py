"""``last.ckpt`` holds the run's last step (a subclass's ``on_train_end`` without ``super()`` cannot drop it)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from moco_lightning import _lightning


class LastCheckpoint(Callback):
    """``on_train_end``: the last step checked as finished (a module hook that did not run says so), then every
    ``ModelCheckpoint(save_last=...)`` whose last save is older than this step saves ``last.ckpt`` now (Lightning saves
    it at the end only if it never saved one: a run checkpointed every N steps ended with an earlier step)."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        check = getattr(pl_module, "check_step_finished", None)
        if check is not None:
            check()
        _lightning.save_last_now(trainer)

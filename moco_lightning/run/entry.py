"""``checkpoint["moco_lightning"]``, written by a callback (a subclass's ``on_save_checkpoint`` without ``super()``
cannot drop it)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from moco_lightning.training import run_state


class CheckpointEntry(Callback):
    """``on_save_checkpoint``: the step being saved finished first (a callback's save at step N runs before the
    module's ``on_train_batch_end``: the checkpoint then holds N momentum updates and N steps' keys), then the
    library's entry (:func:`~moco_lightning.training.run_state.save_state`: format, versions, the class that wrote
    it, the momentum copies, the evaluation transform, every rank's RNG states, the schedules' plan)."""

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        run_state.save_state(pl_module, checkpoint)

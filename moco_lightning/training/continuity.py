"""What every module of the library does so that a stopped run continues as if it had not stopped: the loggers keep
their history (:mod:`moco_lightning.training.log_history`), an epoch that a ``max_steps`` stop cut short is re-opened,
and the run's last step is in ``last.ckpt`` whatever the saving interval."""

from __future__ import annotations

from typing import Any

from moco_lightning import _lightning
from moco_lightning.training.log_history import keep_history, read_csv_history


class Continuing:
    """Mixed into the library's LightningModules (before ``LightningModule``)."""

    _csv_history: list = []  # CSV loggers' rows of the run a checkpoint continues (read before Lightning deletes them)

    def prepare_data(self) -> None:
        self._csv_history = read_csv_history(self.trainer)  # a resumed run keeps them (continue_history)

    def continue_history(self, checkpoint: dict) -> None:
        """At the restore of ``checkpoint``: a cut epoch re-opened, the loggers' history before its step kept."""
        _lightning.reopen_cut_epoch(checkpoint)
        trainer: Any = _lightning.attached_trainer(self)
        if trainer is not None:
            keep_history(trainer, self._csv_history, checkpoint.get("global_step", 0))
        self._csv_history = []

    def on_train_end(self) -> None:
        _lightning.save_last_now(self.trainer)  # the run's last step in last.ckpt, whatever the saving interval

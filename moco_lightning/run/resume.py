"""A resumed run continues as if it had not stopped (:mod:`moco_lightning.training.run_state`,
:mod:`moco_lightning.training.log_history`)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from moco_lightning import _lightning
from moco_lightning.training import run_state
from moco_lightning.training.log_history import keep_history, read_csv_history


class ExactResume(Callback):
    """- ``attach`` (the module's ``configure_callbacks``, before the Trainer's set-up creates the loggers' writers):
      the CSV loggers' rows read before Lightning's writer deletes them;
    - ``on_load_checkpoint``: an epoch a ``max_steps`` stop cut short re-opened, the loggers' history before the
      checkpoint's step kept, and what the run resumes (this rank's RNG states, the schedules' plan) handed to the
      module (``pl_module.resume_state``: its ``configure_optimizers`` reads the plan);
    - ``on_train_start``: the RNG states set, the training loader at its next batch, the schedules continued
      (another length or global batch re-planned, with a warning).

    A tuner's own checkpoint (``lr_find``, ``scale_batch_size``) restores the module it saved a moment before: not a
    resumed run, nothing of the above."""

    def __init__(self) -> None:
        self._csv_history: list = []

    def attach(self, trainer: Any) -> None:
        self._csv_history = read_csv_history(trainer)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict) -> None:
        if _lightning.restoring_tuner_checkpoint(trainer):
            return
        _lightning.reopen_cut_epoch(checkpoint)
        keep_history(trainer, self._csv_history, checkpoint.get("global_step", 0))
        self._csv_history = []
        if hasattr(pl_module, "resume_state"):
            pl_module.resume_state = run_state.resume_of(checkpoint)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        run_state.continue_run(pl_module, getattr(pl_module, "resume_state", None) or {})
        if hasattr(pl_module, "resume_state"):
            pl_module.resume_state = {}

"""A resumed run keeps the history of its loggers: every row and scalar before the checkpoint, each step once.

- ``CSVLogger``: Lightning's writer deletes the version's ``metrics.csv`` when it is created in a folder that holds
  one, so a run resumed into its own version lost the rows of the run before it. :func:`read_csv_history` reads them
  before that (:class:`~moco_lightning.run.ExactResume`'s ``attach``), :func:`keep_history` hands the rows logged
  before the checkpoint's step back to the writer, which writes them first.
- ``TensorBoardLogger``: a resumed run writes a new events file beside the old ones; the old files still hold the
  steps logged after the checkpoint by the run that was stopped, which TensorBoard would show twice. TensorBoard's
  own restart record, a ``SessionLog.START`` event at the resumed step, makes its reader drop them.

Rows and scalars at the checkpoint's step or later are the resumed run's to log again.
"""

from __future__ import annotations

import csv
import os
from typing import Any

from moco_lightning._lightning import experiment_created


def read_csv_history(trainer: Any) -> list:
    """``[(logger, rows)]``: the ``metrics.csv`` rows of each ``CSVLogger`` whose writer does not exist yet."""
    from lightning.pytorch.loggers import CSVLogger

    found = []
    for logger in trainer.loggers if trainer.is_global_zero else ():
        path = os.path.join(logger.log_dir, "metrics.csv") if isinstance(logger, CSVLogger) else ""
        if path and not experiment_created(logger) and os.path.isfile(path):
            with open(path, newline="") as f:
                found.append((logger, list(csv.DictReader(f))))
    return found


def keep_history(trainer: Any, csv_history: list, step: int) -> None:
    """A fit resumed at optimizer ``step``: the CSV rows logged before it written back, TensorBoard told of the
    restart (rank 0; at the checkpoint's restore)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger, rows in csv_history:
        writer = logger.experiment
        writer.metrics = [row for row in rows if row.get("step") and float(row["step"]) < step] + writer.metrics
    if not trainer.is_global_zero or trainer.state.fn != "fit":
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            logger.experiment.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))

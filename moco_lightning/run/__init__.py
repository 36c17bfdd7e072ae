"""The run's machinery as Lightning callbacks: what a fit needs around a method's algorithm, on hooks that a user's
subclass cannot switch off by overriding its own hooks without ``super()``.

A module of the library brings them through ``configure_callbacks()``; ``Trainer().fit(MoCo(), dm)`` runs with all:

=====================  ==================================================================================
:class:`FitSetup`      the method's fit-start checks and set-up: shuffle BN (split BN on one device),
                       channels-last, compile, the DDP buffer list, the dictionary broadcast at fit start
:class:`SafeCheckpoints`  ``ckpt_path`` read weights-only and checked (class, structure, format, processes)
:class:`NanStop`       a non-finite loss stops every rank before a checkpoint holds the bad weights
:class:`SaveOnSignal`  SIGTERM / SIGINT / SLURM's requeue: a resumable ``last.ckpt`` at a step boundary
:class:`ExactResume`   a resumed run continues bit-equal: RNG states, the loader's position, the schedules'
                       plan, the loggers' history
:class:`CheckpointEntry`  ``checkpoint["moco_lightning"]``: the class, the format, the RNG states, the plan
:class:`LastCheckpoint`  ``last.ckpt`` holds the run's last step, whatever the saving interval
=====================  ==================================================================================

A user's own instance of one of these types in ``Trainer(callbacks=[...])`` is used instead of the module's (the
module returns only the types the Trainer does not hold: Lightning would otherwise replace the user's by the
module's). ``run_callbacks=False`` (a constructor argument) leaves :class:`FitSetup` alone, which the algorithm needs:
a plain Lightning run.

Imports: :mod:`moco_lightning.modules`, :mod:`moco_lightning.training` and the package's helpers; imported by the
methods and the downstream side.
"""

from __future__ import annotations

from typing import Any, Sequence

from lightning.pytorch import Callback

from moco_lightning.run.entry import CheckpointEntry
from moco_lightning.run.fit_setup import FitSetup, hook_not_run
from moco_lightning.run.last import LastCheckpoint
from moco_lightning.run.nan_stop import NanStop
from moco_lightning.run.resume import ExactResume
from moco_lightning.run.safe_checkpoints import SafeCheckpoints
from moco_lightning.run.signals import SaveOnSignal

#: the run machinery of a pretraining module, in the order the hooks must run (the NaN check before a save or the
#: stop on a signal; the checkpoint's entry after it)
PRETRAINING = (SafeCheckpoints, NanStop, SaveOnSignal, ExactResume, CheckpointEntry, LastCheckpoint)
#: the run machinery of LinearClassifier
CLASSIFIER = (SafeCheckpoints, SaveOnSignal, ExactResume, LastCheckpoint)


def missing(trainer: Any, kinds: Sequence[type]) -> list[Callback]:
    """A new instance of each of ``kinds`` that ``trainer`` holds no instance of (a user's own is used instead), for a
    module's ``configure_callbacks``. Each one in effect, ours or the user's, is told of the coming fit
    (``attach(trainer)``: before the Trainer's set-up, where the loggers' files are still as the last run left them)."""
    held = list(getattr(trainer, "callbacks", None) or ())
    new = [kind() for kind in kinds if not any(isinstance(c, kind) for c in held)]
    for callback in held + new:
        if isinstance(callback, tuple(kinds)) and hasattr(callback, "attach"):
            callback.attach(trainer)
    return new


__all__ = [
    "CLASSIFIER",
    "PRETRAINING",
    "CheckpointEntry",
    "ExactResume",
    "FitSetup",
    "LastCheckpoint",
    "NanStop",
    "SafeCheckpoints",
    "SaveOnSignal",
    "hook_not_run",
    "missing",
]

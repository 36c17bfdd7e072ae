"""Preemption: a run asked to stop (SIGTERM from a cluster taking the machine back, SIGINT from Ctrl-C, SLURM's
requeue signal) saves a resumable checkpoint at a step boundary and exits cleanly.

A signal handler only notes the signal: saving inside it would write whatever state the step was in (and, under
DDP, start a collective that the other ranks never join). The step decides: with one process, at the end of the
step the signal arrived in; with several, the note travels with the NaN guard's all-reduce at its next check (no
extra collective: every ``log_every_n_steps`` steps, or a checkpoint save) and every rank saves at the end of that
step. The checkpoint is the checkpoint callback's
``last.ckpt`` (``<default_root_dir>/checkpoints/last.ckpt`` without one), written after the step's momentum update
and enqueue: ``--ckpt_path last`` continues bit-equal to the run never stopped. Under SLURM with auto-requeue
(Lightning's ``SLURMEnvironment``), the requeue signal runs Lightning's own requeue at that step boundary instead
(its ``hpc_ckpt_N.ckpt``, which the requeued job restores). A second SIGINT while the first is pending stops at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Optional

from moco_lightning import _lightning


class Preemption:
    """The signal noted by :meth:`install`'s handlers, and the save-and-exit at a step boundary."""

    def __init__(self) -> None:
        self.signum = 0  # the signal this process received (0: none)

    def install(self, trainer: Any) -> None:
        """Handlers for SIGTERM, SIGINT and the SLURM requeue signal, for this fit (``on_train_start``: Lightning
        puts the previous handlers back when the fit ends)."""
        self.signum = 0
        if threading.current_thread() is not threading.main_thread():
            return
        signals = [signal.SIGTERM, signal.SIGINT]
        requeue = _lightning.slurm_requeue_signal(trainer)
        if requeue is not None:
            signals.append(requeue)
        for signum in signals:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: now
        self.signum = self.signum or signum

    def after_step(self, module: Any, agreed: int) -> None:
        """At the end of a training step: if a stop was asked (this process's signal with one process, ``agreed``,
        every rank's, with several), save the checkpoint and exit."""
        trainer = module.trainer
        signum = self.signum if trainer.world_size == 1 else agreed
        if not signum:
            return
        name = signal.Signals(signum).name
        if signum == _lightning.slurm_requeue_signal(trainer):
            path = _lightning.slurm_requeue(trainer, signum)
            then = "the requeued job restores it"
        else:
            path = checkpoint_path(trainer)
            claim_last(trainer, path)
            trainer.save_checkpoint(path)
            then = f"resume it with trainer.fit(..., ckpt_path={path!r}) (the command line: --ckpt_path last)"
        if trainer.is_global_zero:
            print(
                f"moco-lightning: {name} at step {trainer.global_step}: saved a resumable checkpoint to {path}; {then}",
                file=sys.stderr,
                flush=True,
            )
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        raise SIGTERMException  # Lightning's clean exit of a terminated run (exit code 0)


def checkpoint_path(trainer: Any) -> str:
    """Where a preempted run saves: the checkpoint callback's ``last.ckpt``, or ``<default_root_dir>/checkpoints``'s."""
    callback = trainer.checkpoint_callback
    folder: Optional[str] = getattr(callback, "dirpath", None)
    if callback is not None and folder:
        return os.path.join(folder, callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION)
    return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")


def claim_last(trainer: Any, path: str) -> None:
    """The checkpoint callback takes ``path`` for its own ``last.ckpt`` before the preemption's save (as its own
    saves do: the path is part of the state saved). Otherwise a run resumed from it restores a callback that never
    wrote ``last.ckpt``, finds the file there and writes its end state to ``last-v1.ckpt``, leaving ``last.ckpt`` at
    the preempted step, where ``evaluate`` / ``export`` / ``embed`` read it."""
    callback = trainer.checkpoint_callback
    if callback is not None and getattr(callback, "save_last", False) and hasattr(callback, "last_model_path"):
        callback.last_model_path = path

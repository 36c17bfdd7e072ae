"""Callbacks that act at a chosen optimizer step, independent of the machine's speed (config class paths
``helpers.callbacks.KillAt``... in subprocess runs with ``PYTHONPATH=tests``)."""

from __future__ import annotations

import os

from lightning.pytorch import Callback


class KillAt(Callback):
    """SIGKILLs its own process at the end of optimizer step ``step`` (after the callbacks listed before it, e.g. a
    ModelCheckpoint, have run): a kill at a chosen moment, independent of the machine's speed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step == self.step:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


class RecordSchedules(Callback):
    """The lr each optimizer step uses (at its start) and the momentum it logs (``train/momentum``: the m of the
    update that follows it), by global step."""

    def __init__(self) -> None:
        self.lrs, self.momenta = {}, {}

    def on_train_batch_start(self, trainer, *args, **kwargs) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        momentum = trainer.callback_metrics.get("train/momentum")
        if momentum is not None:
            self.momenta[trainer.global_step - 1] = float(momentum)


class SignalAt(Callback):
    """Sends ``signum`` (a number, or a name such as ``"SIGTERM"``) to its own process at the end of optimizer step
    ``step`` (after the callbacks listed before it), on every rank or on ``rank`` only: a preemption at a chosen
    moment."""

    def __init__(self, step: int, signum, rank=None) -> None:
        import signal

        self.step, self.rank = step, rank
        self.signum = getattr(signal, signum) if isinstance(signum, str) else signum

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)

"""The method's fit-time set-up on callback hooks (a subclass's ``setup`` or ``on_train_start`` without ``super()``
cannot skip it)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from moco_lightning.data_contract import require


class FitSetup(Callback):
    """``setup``: the datamodule checked against what each callback reads of it (its ``data_contract``,
    :mod:`moco_lightning.data_contract`), then the module's :meth:`~moco_lightning.methods.base.Pretraining.
    prepare_run` (the fit-start checks, shuffle BN, channels-last, compile, the buffers DDP must not re-broadcast);
    ``on_fit_start``: the dictionary's buffers equal on every rank; ``on_train_start``:
    :meth:`~moco_lightning.methods.base.Pretraining.begin_training`; ``teardown``:
    :meth:`~moco_lightning.methods.base.Pretraining.end_run` (the user's BatchNorm again).

    Kept with ``run_callbacks=False``: the algorithm needs it. The module's first training step stops with one line
    when it did not run (a ``configure_callbacks`` override that drops it)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":  # what the callbacks will read of the datamodule, before any work
            for callback in trainer.callbacks:
                for contract in getattr(callback, "data_contract", ()):
                    require(trainer.datamodule, contract, type(callback).__name__, "give the callback its own")
        pl_module.prepare_run(stage)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.sync_dictionary()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.begin_training()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        pl_module.end_run(stage)


def hook_not_run(name: str, hook: str) -> str:
    """The one line of a step that finds a hook it relies on did not run: ``configure_callbacks`` (no
    :class:`FitSetup`), else the module's ``on_train_batch_end``."""
    if hook == "configure_callbacks":
        return (
            f"{name}: the fit was not set up (fit-start checks, shuffle BN): the library's FitSetup callback did not "
            f"run; {name}.configure_callbacks() must return super()'s callbacks with its own "
            "(return [*super().configure_callbacks(), *yours])"
        )
    return (
        f"{name}.on_train_batch_end overrides Pretraining.on_train_batch_end without calling "
        "super().on_train_batch_end(outputs, batch, batch_idx): the momentum update and the dictionary's store after "
        "each optimizer step did not run (the key encoder / target and the queue stood still); call super() in it"
    )

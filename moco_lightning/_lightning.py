"""Every access of this library to Lightning's (and DDP's) internals, in one place.

Checked against lightning 2.6.1 to 2.6.6 (``tests/test_lightning_internals.py`` fails when one of these is gone).
Each function says what it needs and why no public API does it; nothing else in the library touches a private
attribute of Lightning.

- ``fit_loop._combined_loader_states_to_load`` / ``_load_combined_loader_states()``: hand a resumed run's training
  loaders their mid-epoch position (Lightning skips it when the data was set up before the restore).
- ``fit_loop.setup_data()``: load the training loader early, to scale the lr by its batch size.
- ``fit_loop.epoch_loop.batch_progress``: where a resumed run is inside its epoch; ``epoch_loop.max_steps``: a
  running fit's new length (:func:`moco_lightning.training.plan.change_length`).
- the checkpoint's ``loops`` entry: re-open an epoch that a ``max_steps`` stop cut short (below).
- ``hparams_mixin._given_hyperparameters``: the arguments LightningCLI hands a module it builds.
- ``strategy._layer_sync``: whether ``sync_batchnorm`` is on.
- ``module._ddp_params_and_buffers_to_ignore``: buffers DDP must not re-broadcast from rank 0 on every forward
  (torch's ``DistributedDataParallel`` reads it when it wraps the module).
- ``CSVLogger._experiment``: whether its writer exists yet (creating it deletes the version's ``metrics.csv``).
- ``_accelerator_connector.cluster_environment``, ``_signal_connector._slurm_sigusr_handler_fn``: SLURM's requeue
  at a step boundary (:mod:`moco_lightning.training.preemption`; Lightning runs it inside the signal handler, mid-step).
- ``ModelCheckpoint._last_global_step_saved`` / ``_save_last_checkpoint`` / ``_monitor_candidates``: the last step
  of a run in ``last.ckpt`` (:func:`save_last_now`).
- the tuners' checkpoint names (``.lr_find_*.ckpt``, ``.scale_batch_size_*.ckpt``): a tuner restoring the module it
  saved a moment before is not a resumed run (:func:`restoring_tuner_checkpoint`).
- ``LearningRateFinder._attr_name``: which attribute ``lr_find(update_attr=True)`` writes its suggestion to
  (:func:`lr_finder_attribute`).
- ``LightningModule._trainer``: whether a Trainer runs the module (:func:`attached_trainer`; ``module.trainer``
  raises outside a fit).
- ``core.saving._load_state``: build a module from a checkpoint already read (``load_from_checkpoint`` minus
  its own ``torch.load``).
- ``LightningCLI._parse_ckpt_path`` (replaced: it builds a ``--ckpt_path`` run's model from the checkpoint's
  hyper-parameters, read without our checks), ``LightningCLI._dump_config`` (replaced: the same dump read back
  with libyaml's loader where PyYAML has it, 0.2 s of every command's start in pure Python) and
  ``LightningCLI._subcommand_parsers``: :class:`CLIHooks`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from torch import nn


def load_pending_loader_states(trainer: Any) -> None:
    """Hands the training loaders the states Lightning read from the checkpoint (their mid-epoch position), if it
    has not: call at ``on_train_start``.

    Lightning loads them while it sets up the training data at the start of ``fit``, but only if that set-up has not
    happened yet; ``configure_optimizers`` asking for ``trainer.estimated_stepping_batches`` (the schedules here)
    sets up the data earlier, before the checkpoint is restored, and the states are then never loaded: the resumed
    epoch restarted from its first batch (lightning 2.6). The loader's iterator is made lazily (a generator), so at
    ``on_train_start`` it has not drawn a batch yet."""
    fit_loop = getattr(trainer, "fit_loop", None)
    if fit_loop is not None and getattr(fit_loop, "_combined_loader_states_to_load", None):
        fit_loop._load_combined_loader_states()


TUNER_CHECKPOINTS = (".lr_find_", ".scale_batch_size_")  # lightning/pytorch/tuner: the names of their checkpoints


def restoring_tuner_checkpoint(trainer: Any) -> bool:
    """Whether the checkpoint being restored is a tuner's (``lr_find``, ``scale_batch_size``, ``BatchSizeFinder``):
    the state of the module before the tuner's trial steps, restored after them; not a run to resume."""
    import os

    return os.path.basename(str(trainer.ckpt_path or "")).startswith(TUNER_CHECKPOINTS)


def lr_finder_attribute(trainer: Any, redirect: str) -> Optional[str]:
    """The attribute a ``LearningRateFinder`` of ``trainer`` (``Tuner.lr_find`` adds one) writes its suggestion to
    when ``update_attr`` is on: ``redirect`` where it would search (``attr_name=""``), else the name the user gave
    it; None without such a finder."""
    from lightning.pytorch.callbacks import LearningRateFinder

    for callback in trainer.callbacks:
        if isinstance(callback, LearningRateFinder) and callback._update_attr:
            if not callback._attr_name:
                callback._attr_name = redirect
            return callback._attr_name
    return None


def attached_trainer(module: Any) -> Any:
    """The Trainer running ``module``, or None (a module loaded with ``load_from_checkpoint``)."""
    return getattr(module, "_trainer", None)


def ensure_train_dataloader(trainer: Any) -> Any:
    """The training loader, loaded now if it is not yet (``max_steps`` alone does not load it before
    ``configure_optimizers``)."""
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    return trainer.train_dataloader


def set_max_steps(trainer: Any, total: int) -> None:
    """A running fit stops at ``total`` optimizer steps (``Trainer.max_steps`` is read-only once fitting)."""
    trainer.fit_loop.epoch_loop.max_steps = total


def batches_done_in_epoch(trainer: Any) -> int:
    """Training batches already taken in the current epoch (non-zero in an epoch resumed mid-way; at
    ``on_train_start`` of a run resumed at an epoch's end the batch counts are still the finished epoch's)."""
    epochs = trainer.fit_loop.epoch_progress.current
    if epochs.processed >= epochs.ready:  # the last epoch that started is processed: the next one has not begun
        return 0
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready


def reopen_cut_epoch(checkpoint: dict) -> bool:
    """Makes a checkpoint written when a run stopped mid-epoch (``max_steps``, a preemption) resume *inside* that epoch.

    Lightning counts such an epoch as processed once its ``on_train_epoch_end`` runs (where ``ModelCheckpoint``
    saves), so a run resumed with a larger ``max_steps`` started the next epoch and silently skipped the rest of the
    cut one (or, when ``max_epochs`` bound, trained nothing: "max_epochs reached"), while the training loader (its
    saved position: epoch e, b batches) would have continued it. The epoch's batch progress says it was cut
    (``is_last_batch`` false after some batches): the epoch is counted as started, not processed, as in a checkpoint
    written mid-epoch by ``every_n_train_steps``. Returns whether it changed anything."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not fit:
        return False
    batches, epochs = fit.get("epoch_loop.batch_progress"), fit.get("epoch_progress")
    if not batches or not epochs or batches.get("is_last_batch", True) or not batches["current"]["ready"]:
        return False
    current = epochs["current"]
    epoch = current["ready"] - 1  # the cut epoch's index
    if (
        current["started"] != current["ready"]
        or current["processed"] != current["ready"]
        or current["completed"] < epoch
    ):
        return False  # saved mid-epoch (a step checkpoint: Lightning resumes it itself), or nothing started
    finished = current["completed"] - epoch  # 1 when saved after on_train_epoch_end, 0 when inside it
    for counts in (epochs["current"], epochs["total"]):
        counts["processed"] -= 1
        counts["completed"] -= finished
    checkpoint["epoch"] = epoch
    return True


def slurm_requeue_signal(trainer: Any) -> Optional[int]:
    """The signal on which Lightning requeues a SLURM job (auto-requeue on), else None."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return int(environment.requeue_signal)
    return None


def slurm_requeue(trainer: Any, signum: int) -> str:
    """Lightning's SLURM requeue (the loggers finalised, ``hpc_ckpt_N.ckpt`` saved, ``scontrol requeue`` of the job),
    run at a step boundary; returns the checkpoint's path."""
    path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)
    return path


def save_last_now(trainer: Any) -> None:
    """Every ``ModelCheckpoint(save_last=...)`` whose last save is older than this step saves its ``last.ckpt`` now
    (at the end of training): Lightning saves it at the end only if it never saved one, so a run checkpointed every
    N steps or minutes ended with a ``last.ckpt`` of an earlier step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
            if callback._last_global_step_saved != trainer.global_step:
                callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def experiment_created(logger: Any) -> bool:
    """Whether a ``CSVLogger`` made its writer yet (creating it deletes the version's ``metrics.csv``)."""
    return getattr(logger, "_experiment", None) is not None


def saved_mid_epoch(checkpoint: dict) -> int:
    """The batches of an epoch that a checkpoint was written inside of (0: written at an epoch's end)."""
    batches = ((checkpoint.get("loops") or {}).get("fit_loop") or {}).get("epoch_loop.batch_progress")
    if not batches or batches.get("is_last_batch", True):
        return 0
    return int(batches["current"]["ready"])


def close_finished_epoch(checkpoint: dict) -> bool:
    """Makes a checkpoint written at the last batch of an epoch (a step checkpoint, before the epoch's end) read as one
    written at the epoch's end, for a run whose epochs hold another number of batches (other devices).

    Lightning resumes such a checkpoint in the next epoch only if the batches it counted reach the new loader's
    length: with more batches an epoch (2 processes -> 1) it went on inside the next epoch as if those batches were
    done there, and trained half of it. Returns whether it changed anything."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not fit:
        return False
    batches, epochs = fit.get("epoch_loop.batch_progress"), fit.get("epoch_progress")
    current = (epochs or {}).get("current")
    if not batches or not batches.get("is_last_batch") or not current or current["processed"] != current["ready"] - 1:
        return False
    for counts in (epochs["current"], epochs["total"]):
        counts["processed"] += 1
    for counts in (batches["current"], batches["total"]):
        counts["completed"] = counts["processed"]
    state = fit.get("epoch_loop.state_dict")
    if state is not None and "_batches_that_stepped" in state:
        state["_batches_that_stepped"] += 1  # counted after on_train_batch_end, where the step checkpoint was saved
    return True


def given_hyperparameters() -> dict:
    """The arguments LightningCLI hands the module it is building (``{}`` outside the CLI)."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

    return _given_hyperparameters.get() or {}


@contextlib.contextmanager
def own_hyperparameters() -> Iterator[None]:
    """Lets a LightningModule built inside another one record its own hyper-parameters.

    While LightningCLI instantiates a module it hands that module's arguments to every ``save_hyperparameters()``
    call through a context variable, so a pretraining module rebuilt inside ``LinearClassifier.__init__`` would record
    the classifier's arguments instead of its own. Cleared here for the nested construction."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters

    token = _given_hyperparameters.set(None)
    try:
        yield
    finally:
        _given_hyperparameters.reset(token)


def uses_sync_batchnorm(trainer: Any) -> bool:
    """``Trainer(sync_batchnorm=True)``: Lightning keeps it as the strategy's layer sync."""
    return getattr(trainer.strategy, "_layer_sync", None) is not None


def keep_out_of_ddp_broadcast(module: nn.Module, names: list[str]) -> None:
    """Buffers (state-dict names) that every rank updates alike: DDP then does not broadcast them from rank 0 on
    every forward (32 MiB per step for a queue of 65536 x 128). Set before DDP wraps the module (``setup``)."""
    module._ddp_params_and_buffers_to_ignore = list(names)


def ddp_ignored(module: nn.Module) -> list[str]:
    return list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))


def module_from_checkpoint(cls: type, checkpoint: dict, strict: Optional[bool], **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint`` of a checkpoint already read: the hyper-parameters (updated by ``kwargs``) build
    the module (Lightning's allowlisted CLI instantiator when the CLI wrote it), ``on_load_checkpoint`` runs, the
    weights are loaded."""
    from lightning.pytorch.core.saving import _load_state

    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    return _load_state(cls, checkpoint, strict=strict, **kwargs)


class CLIHooks:
    """What the library's LightningCLI needs of LightningCLI's internals (mixed in before LightningCLI)."""

    def _parse_ckpt_path(self) -> None:
        self.model_from_checkpoint()

    def model_from_checkpoint(self) -> None:
        """Sets the model's config of a ``--ckpt_path`` run from the checkpoint (the subclass says how)."""

    def subcommand_parser(self, subcommand: str) -> Any:
        return self._subcommand_parsers[subcommand]

    def _dump_config(self) -> None:
        """Lightning's ``_dump_config`` (the config as plain data, for the module's hyper-parameters), read back
        with libyaml's C loader when PyYAML was built with it (the same data: a test compares)."""
        import yaml

        if hasattr(self, "config_dump"):
            return
        dumped = self.parser.dump(self.config, skip_link_targets=False, skip_none=False, format="yaml")
        self.config_dump = yaml.load(dumped, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if "subcommand" in self.config:
            self.config_dump = self.config_dump[self.config.subcommand]


def record_hyperparameters(module: Any, **values: Any) -> None:
    """Sets ``values`` in ``module.hparams`` (checkpoints) and in the initial copy the loggers write to
    ``hparams.yaml``: what a run did where it differs from what it was given."""
    module.hparams.update(values)
    initial = getattr(module, "_hparams_initial", None)
    if initial is not None:
        initial.update(values)

"""moco_lightning._lightning touches Lightning's internals in one place; this fails when a Lightning release drops
or renames one of them (the behaviour behind each is tested where it is used: resume, the CLI, DDP)."""

from __future__ import annotations

import inspect

import lightning
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI

from moco_lightning import _lightning


def test_the_private_names_the_library_uses_still_exist():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, sync_batchnorm=True)
    fit_loop = trainer.fit_loop
    assert hasattr(fit_loop, "_combined_loader_states_to_load") and callable(fit_loop._load_combined_loader_states)
    assert callable(fit_loop.setup_data) and fit_loop.epoch_loop.batch_progress.current.ready == 0
    assert _lightning.uses_sync_batchnorm(trainer)  # strategy._layer_sync
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters  # noqa: F401
    from lightning.pytorch.core.saving import _load_state

    assert list(inspect.signature(_load_state).parameters)[:3] == ["cls", "checkpoint", "strict"]
    assert callable(LightningCLI._parse_ckpt_path) and "config_dump" in inspect.getsource(LightningCLI._dump_config)
    assert "_subcommand_parsers" in inspect.getsource(LightningCLI._add_subcommands)
    assert lightning.__version__ >= "2.6.1"


def test_reopen_cut_epoch_reads_the_loop_layout_lightning_writes():
    """The checkpoint layouts of a max_steps stop after 2 of 4 batches (as lightning 2.6 writes them: inside
    ``on_train_epoch_end``, where ModelCheckpoint saves, the epoch is processed but not completed; after it, both)
    are re-opened; an epoch that ended, or a step checkpoint already mid-epoch, is left alone."""

    def loops(completed: int, ready: int, last: bool, processed: int = None) -> dict:
        processed = completed if processed is None else processed
        counts = {"ready": ready, "started": ready, "processed": processed, "completed": completed}
        return {"loops": {"fit_loop": {
            "epoch_progress": {"total": dict(counts), "current": dict(counts)},
            "epoch_loop.batch_progress": {"current": {"ready": 2}, "is_last_batch": last},
        }}, "epoch": completed}  # fmt: skip

    cut = loops(1, 1, last=False)
    assert _lightning.reopen_cut_epoch(cut) and cut["epoch"] == 0
    assert cut["loops"]["fit_loop"]["epoch_progress"]["current"] == {
        "ready": 1,
        "started": 1,
        "processed": 0,
        "completed": 0,
    }
    at_epoch_end = loops(0, 1, last=False, processed=1)  # saved by ModelCheckpoint in on_train_epoch_end
    assert _lightning.reopen_cut_epoch(at_epoch_end) and at_epoch_end["epoch"] == 0
    assert at_epoch_end["loops"]["fit_loop"]["epoch_progress"]["total"]["processed"] == 0
    assert not _lightning.reopen_cut_epoch(loops(1, 1, last=True))  # the epoch ended
    assert not _lightning.reopen_cut_epoch(loops(0, 1, last=False))  # a step checkpoint: already mid-epoch


def test_the_config_dump_is_lightnings(tmp_path):
    """``CLIHooks._dump_config`` (libyaml's loader) gives the data Lightning's own (PyYAML's Python loader) gives."""
    import yaml

    from moco_lightning import MoCo, Pretraining
    from moco_lightning.cli.app import make_cli

    config = tmp_path / "c.yaml"
    config.write_text(
        "model:\n  class_path: moco_lightning.SimCLR\n  init_args: {temperature: 0.3}\n"
        "data:\n  class_path: moco_lightning.datamodules.FashionMNISTDataModule\n"
    )
    cli = make_cli(Pretraining, ["--config", str(config), "--trainer.logger", "false"], MoCo, run=False)
    assert yaml.__with_libyaml__  # the speed-up is real where the suite runs
    ours = (cli._dump_config(), cli.config_dump)[1]
    del cli.config_dump
    LightningCLI._dump_config(cli)
    assert ours == cli.config_dump and ours["model"]["init_args"]["temperature"] == 0.3


def test_the_tuners_private_names_the_library_uses_still_exist():
    """``LearningRateFinder._attr_name`` / ``_update_attr`` (where lr_find writes its suggestion) and the tuners'
    checkpoint names (a tuner's restore is not a resume)."""
    from lightning.pytorch.callbacks import LearningRateFinder
    from lightning.pytorch.tuner import batch_size_scaling, lr_finder

    finder = LearningRateFinder()
    assert finder._attr_name == "" and finder._update_attr is True, "LearningRateFinder._attr_name / _update_attr"
    for module, prefix in ((lr_finder, ".lr_find_"), (batch_size_scaling, ".scale_batch_size_")):
        assert f'f"{prefix}{{uuid.uuid4()}}.ckpt"' in inspect.getsource(module), f"the tuners' checkpoint {prefix}*"
        assert prefix in _lightning.TUNER_CHECKPOINTS


def test_every_other_private_name_of_lightning_the_library_reads_exists():
    """The rest of ``_lightning.py``'s list, each checked by name: a Lightning upgrade that moves one fails here,
    naming it (the behaviour behind each is tested where it is used)."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    checkpoint = ModelCheckpoint()
    found = {
        "Trainer._checkpoint_connector.hpc_save_path": callable(
            getattr(getattr(trainer, "_checkpoint_connector", None), "hpc_save_path", None)
        ),
        "Trainer._signal_connector._slurm_sigusr_handler_fn": callable(
            getattr(getattr(trainer, "_signal_connector", None), "_slurm_sigusr_handler_fn", None)
        ),
        "Trainer._accelerator_connector.cluster_environment": hasattr(
            getattr(trainer, "_accelerator_connector", None), "cluster_environment"
        ),
        "fit_loop.epoch_loop.max_steps": hasattr(trainer.fit_loop.epoch_loop, "max_steps"),
        "ModelCheckpoint._last_global_step_saved": hasattr(checkpoint, "_last_global_step_saved"),
        "ModelCheckpoint._save_last_checkpoint": callable(getattr(checkpoint, "_save_last_checkpoint", None)),
        "ModelCheckpoint._monitor_candidates": callable(getattr(checkpoint, "_monitor_candidates", None)),
        "CSVLogger._experiment": hasattr(CSVLogger("."), "_experiment"),
        "LightningModule._trainer": hasattr(LightningModule(), "_trainer"),
    }
    assert [name for name, ok in found.items() if not ok] == []
    source = inspect.getsource(_lightning)  # each is listed in the module's docstring, where a reader looks first
    doc = _lightning.__doc__ or ""
    for name in (
        "_combined_loader_states_to_load",
        "_given_hyperparameters",
        "_layer_sync",
        "_experiment",
        "_slurm_sigusr_handler_fn",
        "_last_global_step_saved",
        "_trainer",
        "_load_state",
        "_attr_name",
    ):
        assert name in doc and name in source, name  # fmt: skip

"""The library's LightningCLI: :class:`MoCoCLI` (resumable ``--ckpt_path last``, checked resume settings, a
final-metrics table), :func:`run_cli` (bad input as one ``error:`` line), :func:`from_config` (a config in Python)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from moco_lightning._lightning import CLIHooks
from moco_lightning.cli.messages import (
    CLI_HELP,
    HelpFormatter,
    bad_choice,
    condense_parser_error,
    final_metrics_table,
    missing_argument,
    usage,
    yaml_error,
)
from moco_lightning.cli.resume import check_checkpoint_class, resolve_last_checkpoint
from moco_lightning.downstream.linear_eval import LinearClassifier
from moco_lightning.errors import BadInputError, ConfigError
from moco_lightning.methods.base import Pretraining
from moco_lightning.methods.moco import MoCo
from moco_lightning.training.checkpoint_io import read_checkpoint
from moco_lightning.training.compat import stem_of_cifar_stem
from moco_lightning.training.precision import AutoPrecisionTrainer


class MoCoCLI(CLIHooks, LightningCLI):
    """LightningCLI with resumable ``--ckpt_path last``, checked resume settings and a final-metrics table.

    ``default_model``: the class of a ``model:`` section without ``class_path`` (the configs of MoCo v1/v2 give
    only its arguments)."""

    def __init__(self, *args: Any, default_model: Optional[type] = None, **kwargs: Any) -> None:
        self._default_model = default_model
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        if self._default_model is not None:
            self._model_default(parser, self._default_model)

    @staticmethod
    def _model_default(parser: Any, cls: type) -> None:
        parser.set_defaults({"model": {"class_path": f"{cls.__module__}.{cls.__qualname__}"}})

    def parse_arguments(self, parser: Any, args: Any) -> None:
        given = sys.argv[1:] if args is None else args
        sub = next((a for a in given if a in SUBCOMMANDS), None)
        no_subcommands = getattr(parser, "_subcommands_action", None) is None  # run=False: from_config
        if self._default_model is not None and (sub is not None or no_subcommands):
            # A config without a model class_path trains the default class (MoCo). But jsonargparse carries the
            # default class's settings over to another class_path (SimCLR got MoCo's temperature): find the class
            # the command names (without printing), make it the default, then parse for real. With a subcommand
            # (moco-lightning fit) and without (from_config: a config in Python) alike.
            quiet = [a for a in given if not a.startswith("--print_config")]
            parsed = parser.parse_args(quiet, _skip_validation=True)
            named = _model_class(_plain(parsed[sub]["model"] if sub else parsed["model"]), self._default_model)
            self._model_default(self.subcommand_parser(sub) if sub else parser, named)
        super().parse_arguments(parser, args)
        sub = self.config.get("subcommand")
        self._given_model: Optional[dict] = None
        if sub in ("test", "predict"):
            raise ConfigError(REFUSED[sub])
        if sub and sub in self.config:
            if self.config[sub].get("ckpt_path") == "last":
                self.config[sub]["ckpt_path"] = resolve_last_checkpoint(self.config[sub])
            path = self.config[sub].get("ckpt_path")
            if path:  # Lightning now replaces the model's settings by the checkpoint's
                self._given_model = _plain(self.config[sub]["model"])
                model_class = _model_class(self._given_model, self._default_model or self.model_class)
                check_checkpoint_class(read_checkpoint(path, arg="--ckpt_path", keep=True), path, model_class)

    def model_from_checkpoint(self) -> None:
        """The model's settings of a ``--ckpt_path`` run are the checkpoint's (as Lightning does), read safely
        (weights only) and upgraded from older formats."""
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        if not path or not Path(path).is_file():
            return
        checkpoint = read_checkpoint(path, arg="--ckpt_path", keep=True)
        hparams = dict(checkpoint.get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "init_args": hparams}
        self.config = self.parser.parse_object({sub: {"model": hparams}}, self.config)

    def before_instantiate_classes(self) -> None:
        sub = self.subcommand
        for key in ("optimizer", "lr_scheduler"):
            if sub and self.config[sub].get(key) is not None:
                raise ConfigError(
                    f"--{key} replaces the module's own optimizer and schedule (the lr given per 256 images and scaled "
                    "by the global batch, the key encoder kept out of it, LARS, warm-up): set model.optimizer, "
                    "model.lr, model.weight_decay, model.lr_schedule, model.warmup_epochs instead"
                )
        if sub is None or self._given_model is None:
            return
        saved, given = _init_args(_plain(self.config[sub]["model"])), _init_args(self._given_model)
        stem_of_cifar_stem(given)  # the config's cifar_stem: true is stem: cifar, as the checkpoint's
        structural = set(getattr(_model_class(self._given_model, self.model_class), "STRUCTURAL", ()))
        differ = {k: (given[k], saved[k]) for k in saved if k in given and given[k] != saved[k]}
        wrong = {k: v for k, v in differ.items() if k in structural}
        if wrong:
            raise ConfigError(
                f"--ckpt_path {self.config[sub]['ckpt_path']}: the checkpoint does not fit the configured model ("
                + "; ".join(f"{k}: checkpoint {s!r}, config {g!r}" for k, (g, s) in sorted(wrong.items()))
                + "). Resume with the settings it was trained with, or drop --ckpt_path to start a new run."
            )
        if differ:
            warnings.warn(
                f"resuming from {self.config[sub]['ckpt_path']}: the checkpoint's model settings are used, these "
                "configured values are ignored: "
                + "; ".join(f"{k}: config {g!r}, checkpoint {s!r}" for k, (g, s) in sorted(differ.items())),
                stacklevel=2,
            )

    def after_fit(self) -> None:
        metrics = {k: float(v) for k, v in sorted(self.trainer.callback_metrics.items()) if v.numel() == 1}
        log_dir = self.trainer.log_dir  # a collective under DDP: every rank must ask
        if not self.trainer.is_global_zero:
            return
        if metrics:
            print(final_metrics_table(metrics, self.trainer))
        skipped = getattr(self.datamodule, "bad_images", None)
        if skipped:
            print(
                f"Skipped {len(skipped)} unreadable image(s) (skip_bad_images): {', '.join(skipped[:5])}"
                + (", ..." if len(skipped) > 5 else "")
            )
        if metrics and log_dir and self.trainer.logger is not None:
            print(f"TensorBoard: tensorboard --logdir {log_dir}")


def from_config(config: Any, *overrides: str) -> tuple[Any, Any]:
    """``(model, datamodule)`` of a config of ``moco-lightning fit``, with command-line style overrides
    (``"--model.width=0.25"``), built by the same CLI and not run: a config in Python code, without the Trainer's
    logger and callbacks."""
    from moco_lightning._lightning import own_hyperparameters

    args = ["--config", str(config), "--trainer.logger=false", "--trainer.callbacks=[]", *overrides]
    try:
        with own_hyperparameters():  # also inside another module being built by a CLI
            cli = make_cli(Pretraining, args, MoCo, run=False, save_config_callback=None)
    except Exception as e:  # a constructor's one-line error, not jsonargparse's Union report around it
        cause = library_cause(e)
        if cause is None or cause is e:
            raise
        raise cause from None
    return cli.model, cli.datamodule


def library_cause(error: BaseException) -> Optional[BaseException]:
    """The library's or Lightning's own error that ``error`` wraps (jsonargparse wraps a constructor's error in its
    own ValueError), or None."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    cause: Optional[BaseException] = error
    while cause is not None and not isinstance(cause, (ConfigError, BadInputError, MisconfigurationException)):
        cause = cause.__cause__ or cause.__context__
    return cause


def make_cli(model_class: type, args: Any, default_model: Optional[type], **kwargs: Any) -> MoCoCLI:
    """The library's LightningCLI over any subclass of ``model_class`` and any datamodule, precision ``auto``."""
    return MoCoCLI(
        model_class,
        LightningDataModule,
        default_model=default_model,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_class=AutoPrecisionTrainer,
        args=args,
        **kwargs,
    )


def _init_args(model: dict) -> dict:
    """The constructor arguments of a model config, with or without ``class_path``/``init_args``."""
    args = dict(model.get("init_args", model)) if isinstance(model, dict) else {}
    if isinstance(model, dict) and "class_path" in model:
        args["class_path"] = model["class_path"]
    return args


def _model_class(model: dict, default: type) -> type:
    path = model.get("class_path") if isinstance(model, dict) else None
    if not path:
        return default
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name, default)


def _plain(value: Any) -> Any:
    """A jsonargparse Namespace (nested) as plain dicts and lists, for comparing settings."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != "__path__"}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


SUBCOMMANDS = ("fit", "validate", "test", "predict")

REFUSED = {  # subcommands Lightning offers that have nothing to run here: one line each, saying what to use instead
    "test": "test: there is no test step, and a datamodule of this library has no test split of its own (its val "
    "split is the held-out one): `validate --ckpt_path <checkpoint>` reports the held-out metrics; an encoder's "
    "accuracy comes from linear evaluation (moco-lightning linear fit --model.ckpt_path ...)",
    "predict": "predict: for features, export the backbone (`moco-lightning export --ckpt <checkpoint> --out "
    "backbone.pt`) and run it on your images, or call trainer.predict(model, dataloaders=...) from Python "
    "(predict_step returns backbone features); for class predictions use linear_eval's classifier in Python",
}


def run_cli(
    model_class: type,
    args: Optional[list[str]] = None,
    default_model: Optional[type] = None,
    prog: Optional[str] = None,
) -> Optional[MoCoCLI]:
    """Lightning's CLI over any subclass of ``model_class`` (``model: class_path: moco_lightning.MoCoV3``; without a
    class_path, ``default_model``, else ``model_class`` itself) and any datamodule (``data: class_path: ...``);
    ``prog``: the command's name in its messages (default ``moco-lightning``, ``moco-lightning linear`` for the
    linear classifier, else ``python -m <module>``)."""
    from argparse import ArgumentError

    if prog is None:
        named = {MoCo: "moco-lightning", LinearClassifier: "moco-lightning linear"}
        prog = named.get(default_model or model_class, f"python -m {model_class.__module__}")
    argv = sys.argv[1:] if args is None else args
    sub = next((a for a in argv if a in SUBCOMMANDS), None)
    no_exit = {"exit_on_error": False}  # a parse error is raised to here, not printed after 60 lines of usage
    try:
        return make_cli(
            model_class,
            args,
            default_model,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={
                **no_exit,
                "description": CLI_HELP if default_model is MoCo else None,
                **({"usage": usage(prog, SUBCOMMANDS)} if default_model is MoCo else {}),
                "formatter_class": HelpFormatter,
                "prog": prog,
                **{name: no_exit for name in SUBCOMMANDS},
            },
        )
    except ArgumentError as e:
        if os.environ.get("MOCO_LIGHTNING_DEBUG"):
            raise
        command = f"{prog} {sub}" if sub else prog
        text = yaml_error(argv) or missing_argument(e) or bad_choice(e) or condense_parser_error(str(e))
        sys.stderr.write(f"{command}: error: {text}\n  ({command} --help lists the options)\n")
        sys.exit(2)
    except Exception as e:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        cause = library_cause(e)
        if cause is None or os.environ.get("MOCO_LIGHTNING_DEBUG"):
            raise
        command = f"{prog} {sub}" if sub else prog
        text = " ".join(str(cause).split())  # Lightning's messages span lines
        if isinstance(cause, MisconfigurationException):  # the Trainer's: say where it comes from
            hint = "; this machine has no GPU: use trainer.accelerator cpu or auto" if "gpu" in text.lower() else ""
            text = f"trainer: {text}{hint}"
        sys.stderr.write(f"{command}: error: {text}\n  (MOCO_LIGHTNING_DEBUG=1 shows the traceback)\n")
        sys.exit(2)

"""The ``moco-lightning`` command: Lightning's CLI over the pretraining modules (:class:`MoCo` unless the config's
``model: class_path:`` names another: ``moco_lightning.MoCoV3``, ``.SimCLR``, ``.BYOL``, ``.SwAV``...) and any
datamodule.

    moco-lightning fit --config configs/quickstart.yaml
    moco-lightning fit --config configs/quickstart.yaml --ckpt_path last     # resume the newest run
    moco-lightning fit --config configs/byol_fashion_mnist.yaml             # another method: its config's class_path
    moco-lightning fit --config configs/moco_v2.yaml --data.init_args.data_dir /data/imagenet
    python -m moco_lightning fit --print_config
    moco-lightning export --ckpt last.ckpt --out backbone.pt

What it adds to LightningCLI:

- ``--ckpt_path last`` resumes the newest run under the logger's ``save_dir/name`` (its ``last.ckpt``) and keeps
  logging into that run's ``version_N``. Lightning alone looks for "last" only in the new run's own folder, finds
  nothing and silently starts from scratch. With no earlier run it says so in one line and starts a new one.
- Resuming with model settings that differ from the checkpoint's: a structural one (backbone, width, K, dim...)
  is an error naming each; any other is replaced by the checkpoint's value (what Lightning does) with a warning
  naming each, instead of silently.
- A bad setting or input ends with its message alone (``error: ...``, exit code 2); ``MOCO_LIGHTNING_DEBUG=1``
  shows the traceback.
- ``fit`` ends with a table of the final metrics (and the count of unreadable images skipped, if any).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from ._lightning import CLIHooks
from .base import Pretraining
from .checkpoint import read_checkpoint, upgrade
from .errors import ConfigError
from .moco import MoCo
from .precision import AutoPrecisionTrainer


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
        sub = next((a for a in (sys.argv[1:] if args is None else args) if a in SUBCOMMANDS), None)
        if self._default_model is not None and sub is not None:
            # A config without a model class_path trains the default class (MoCo). But jsonargparse carries the
            # default class's settings over to another class_path (SimCLR got MoCo's temperature): find the class
            # the command names (without printing), make it the default, then parse for real.
            quiet = [a for a in (sys.argv[1:] if args is None else args) if not a.startswith("--print_config")]
            named = _model_class(
                _plain(parser.parse_args(quiet, _skip_validation=True)[sub]["model"]), self._default_model
            )
            self._model_default(self.subcommand_parser(sub), named)
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
                check_checkpoint_class(
                    read_checkpoint(path, arg="--ckpt_path", keep=True), path, self._given_model, self.model_class
                )

    def model_from_checkpoint(self) -> None:
        """The model's settings of a ``--ckpt_path`` run are the checkpoint's (as Lightning does), read safely
        (weights only) and upgraded from older formats."""
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        if not path or not Path(path).is_file():
            return
        checkpoint = read_checkpoint(path, arg="--ckpt_path", keep=True)
        cls = _model_class(self._given_model, self._default_model or self.model_class)
        upgrade(checkpoint, cls)
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
    from ._lightning import own_hyperparameters

    args = ["--config", str(config), "--trainer.logger=false", "--trainer.callbacks=[]", *overrides]
    with own_hyperparameters():  # also inside another module being built by a CLI
        cli = make_cli(Pretraining, args, MoCo, run=False, save_config_callback=None)
    return cli.model, cli.datamodule


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


def final_metrics_table(metrics: dict, trainer: Any) -> str:
    """The metrics at the end of fit, each evaluation metric with the step it was measured at when that is not the
    last one (a kNN monitor that ran only at step 0 reports the random-init encoder: say so)."""
    measured: dict = {}
    for callback in trainer.callbacks:
        measured.update(getattr(callback, "measured_at", None) or {})
    step, width = trainer.global_step, max(map(len, metrics))
    lines = [f"\nFinal metrics (at step {step}):"]
    for name, value in metrics.items():
        at = measured.get(name)
        if at is None or at == step:
            when = ""
        elif at == 0:
            when = "  (step 0: before training)"
        else:
            when = f"  (measured at step {at})"
        lines.append(f"  {name:<{width}}  {value:.4g}{when}")
    return "\n".join(lines)


def check_checkpoint_class(ckpt: dict, path: str, model: Any, default: type) -> None:
    """A checkpoint of another method (SimCLR into a MoCo run) is an error naming both classes, not a silent switch."""
    saved = (ckpt.get("hyper_parameters") or {}).get("_class_path")
    configured = model.get("class_path") if isinstance(model, dict) else None
    configured = configured or f"{default.__module__}.{default.__qualname__}"
    if saved and saved.rsplit(".", 1)[-1] != configured.rsplit(".", 1)[-1]:
        raise ConfigError(
            f"--ckpt_path {path}: the checkpoint is a {saved} run, the config trains {configured}; resume it with "
            "its own config (or model.class_path), or drop --ckpt_path to start a new run"
        )


def resolve_last_checkpoint(config: Any) -> Optional[str]:
    """The checkpoint ``--ckpt_path last`` resumes, or None (with one line saying so): the newest readable
    ``last.ckpt`` of the earlier runs (or a SLURM requeue's ``hpc_ckpt_N.ckpt``); without one, the newest readable
    checkpoint of any name there (Lightning's default ``epoch=E-step=S.ckpt``), saying so.

    Looks in every ModelCheckpoint's fixed ``dirpath``, else in ``<save_dir>/<name>/version_*/checkpoints`` of the
    first logger (Lightning's default: ``<default_root_dir>/lightning_logs``); the logger is pointed at the version
    found, so the resumed run goes on logging into it."""
    trainer = config["trainer"]
    dirpaths = [
        Path(d)
        for cb in (trainer.get("callbacks") or [])
        if str(_get(cb, "class_path") or "").endswith("ModelCheckpoint")
        for d in [_get(_get(cb, "init_args") or {}, "dirpath")]
        if d
    ]
    logger = trainer.get("logger")
    first = logger[0] if isinstance(logger, list) and logger else logger
    root = trainer.get("default_root_dir") or os.getcwd()
    if first in (None, True):
        save_dir, name, args = root, "lightning_logs", None
    elif first is False:
        save_dir, name, args = root, None, None  # no logger: Lightning checkpoints into default_root_dir/checkpoints
    else:
        args = _get(first, "init_args")
        save_dir, name = _get(args, "save_dir") or root, _get(args, "name")
        name = "lightning_logs" if name is None and "TensorBoard" in str(_get(first, "class_path")) else name
    base = Path(save_dir) / name if name else Path(save_dir)
    folders = [*dirpaths, *base.glob("version_*/checkpoints"), base / "checkpoints"]
    hpc = list(Path(root).glob("hpc_ckpt_*.ckpt"))  # a SLURM requeue's (Lightning's auto-requeue)
    where = ", ".join([*(str(d) for d in dirpaths), f"{base} (version_*/checkpoints)"])
    newest, any_name = None, False
    lasts = [p for d in folders for p in d.glob("last*.ckpt")] + hpc
    if lasts:
        newest = newest_readable(lasts)
    else:
        others = [p for d in folders for p in d.glob("*.ckpt")]
        if others:
            newest, any_name = newest_readable(others), True
    if newest is None:
        what = "no readable checkpoint" if lasts else "no checkpoint"
        print(
            f"moco-lightning: --ckpt_path last: {what} under {where}: starting a new run", file=sys.stderr, flush=True
        )
        return None
    in_logger = newest.parent.name == "checkpoints" and newest.parent.parent.parent == base
    version = newest.parent.parent.name if in_logger else ""
    if version.startswith("version_") and first not in (None, True, False):
        v = version[len("version_") :]
        args["version"] = int(v) if v.isdigit() else version
    elif version.startswith("version_") and first in (None, True):
        from jsonargparse import Namespace

        v = version[len("version_") :]
        trainer["logger"] = Namespace(
            class_path="lightning.pytorch.loggers.TensorBoardLogger",
            init_args=Namespace(save_dir=str(save_dir), name=name, version=int(v) if v.isdigit() else version),
        )
    if any_name:
        print(
            f"moco-lightning: --ckpt_path last: no last.ckpt under {where}: resuming the newest checkpoint, {newest}",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"moco-lightning: --ckpt_path last: resuming {newest}", file=sys.stderr, flush=True)
    return str(newest)


def newest_readable(paths: list) -> Optional[Path]:
    """The newest of ``paths`` that loads, falling back past torn ones (and to the run's other checkpoints) with one
    line naming both; None when none loads."""
    lasts = sorted(paths, key=lambda p: p.stat().st_mtime, reverse=True)
    others = {c for p in paths for c in Path(p).parent.glob("*.ckpt")} - set(lasts)  # top-k and step saves
    ordered = lasts + sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)  # last.ckpt first, then those
    newest, why = lasts[0], ""
    for p in ordered:
        try:
            read_checkpoint(p, keep=True)
        except ConfigError as e:  # torn, empty, or refused (it needs pickle)
            why = why or str(e).split(": ", 1)[-1].split(";")[0].split(" (")[0]
            continue
        if Path(p) != Path(newest):
            print(
                f"moco-lightning: --ckpt_path last: {newest} could not be used ({why}); resuming {p}, the newest "
                "readable checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return Path(p)
    return None


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


def _get(ns: Any, key: str) -> Any:
    if ns is None:
        return None
    return ns.get(key) if hasattr(ns, "get") else getattr(ns, key, None)


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
    "accuracy comes from linear evaluation (python -m moco_lightning.linear_eval fit --model.ckpt_path ...)",
    "predict": "predict: for features, export the backbone (`moco-lightning export --ckpt <checkpoint> --out "
    "backbone.pt`) and run it on your images, or call trainer.predict(model, dataloaders=...) from Python "
    "(predict_step returns backbone features); for class predictions use linear_eval's classifier in Python",
}
DESCRIPTION = """moco-lightning: self-supervised pretraining (MoCo v1/v2/v3, SimCLR, BYOL, SwAV) with Lightning.

  moco-lightning fit --config configs/quickstart.yaml           pretrain (the demo)
  moco-lightning fit --config ... --ckpt_path last              resume the newest run
  moco-lightning export --ckpt last.ckpt --out backbone.pt      the backbone as a state dict (export --help)
  moco-lightning evaluate --ckpt last.ckpt                      kNN, linear, 1 % / 10 % labels (evaluate --help)
  python -m moco_lightning.linear_eval fit --config configs/linear_eval.yaml --model.ckpt_path last.ckpt
"""


def _help_formatter() -> type:
    import argparse

    from jsonargparse import DefaultHelpFormatter

    class HelpFormatter(DefaultHelpFormatter):
        """jsonargparse's, keeping the description's line breaks (its examples)."""

        _fill_text = argparse.RawDescriptionHelpFormatter._fill_text

    return HelpFormatter


_HelpFormatter = _help_formatter()


def yaml_error(argv: list[str]) -> Optional[str]:
    """The config file of ``argv`` that is not valid YAML, with the line and column of the fault (jsonargparse's
    message names neither the file nor the line in it)."""
    import yaml

    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    files += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for name in files:
        try:
            yaml.safe_load(Path(name).read_text())
        except OSError:
            continue
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            return f"--config {name}: not valid YAML{where}: {getattr(e, 'problem', None) or e}"
    return None


def missing_argument(error: BaseException) -> Optional[str]:
    """A required constructor argument that the config leaves out (``data_dir`` of an image folder), named with its
    section: jsonargparse says so only deep in its chain of errors."""
    import re

    while error is not None:
        m = re.search(r"given class_path '([^']+)':\s+the following arguments are required: ([\w, ]+)", str(error))
        if m:
            section = "data" if ".datamodules." in m.group(1) else "model"
            names = [n.strip() for n in m.group(2).split(",")]
            return (
                f"{', '.join(f'{section}.{n}' for n in names)}: required by {m.group(1)} and not set: give "
                + " and ".join(
                    f"--{section}.init_args.{n} (or {n}: in the config's {section}.init_args)" for n in names
                )
            )
        error = error.__cause__ or error.__context__
    return None


def bad_choice(error: BaseException) -> Optional[str]:
    """A class path that does not import (``--model.class_path moco_lightning.Foo``: the classes it could be) or a
    value outside a setting's choices (``--model.stem foo``: the allowed ones), from jsonargparse's chain of errors,
    whose first line says only "Does not validate against any of the Union subtypes"."""
    import re

    keys, unknown, cause = [], None, error
    while cause is not None:
        text = str(cause)
        key = re.match(r'\s*Parser key "([^"]+)"', text)
        if key and (not keys or keys[-1] != key.group(1)):
            keys.append(key.group(1))
        m = re.fullmatch(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)", text.strip(), re.S)
        if m and keys:
            return f"{'.'.join(keys)}: {m.group(2)!r} is not allowed; one of {m.group(1)}"
        m = re.match(r"Problem with given class_path '([^']+)':\s*(.*)", text.strip(), re.S)
        if m and unknown is None:
            unknown = m.group(1), m.group(2).strip().splitlines()[0]
        if unknown and isinstance(cause, (ImportError, AttributeError)) and keys:
            section = keys[0]
            return (
                f"{section}.class_path: {unknown[0]} cannot be imported ({cause}); "
                + ("the methods: " if section == "model" else "the datamodules: " if section == "data" else "")
                + ", ".join(known_classes(section))
            )
        cause = cause.__cause__ or cause.__context__
    return None


def known_classes(section: str) -> list[str]:
    """The class paths a ``model:`` (the pretraining methods) or ``data:`` section (the datamodules) can name."""
    import moco_lightning
    from moco_lightning import datamodules

    module, base = (moco_lightning, Pretraining) if section == "model" else (datamodules, LightningDataModule)
    found = [getattr(module, n) for n in getattr(module, "__all__", dir(module))]
    bases = ("Pretraining", "Contrastive", "MomentumContrast", "TwoViewDataModule", "InMemoryDataModule")
    found = [c for c in found if isinstance(c, type) and issubclass(c, base) and c.__name__ not in bases]
    return [f"{module.__name__}.{c.__name__}" for c in found]


def condense_parser_error(message: str) -> str:
    """jsonargparse's nested report of a bad setting as one line: the setting's dotted name and what is wrong
    (a wrong type, an unknown option with the closest accepted names), without the alternatives of its Union."""
    import re

    lines = [line.strip() for line in message.splitlines() if line.strip()]
    keys, detail, cls = [], lines[0] if lines else message, None
    for i, line in enumerate(lines):
        if line.startswith("- Expected a <class 'NoneType'>"):
            break  # the other member of the Optional: not what the user meant
        m = re.match(r'(?:- )?Parser key "([^"]+)":\s*(.*)', line)
        if m:
            keys.append(m.group(1))
            detail = m.group(2) or (lines[i + 1] if i + 1 < len(lines) else "")
        m = re.search(r"given class_path '([^']+)'", line)
        if m:
            cls = m.group(1)
        m = re.match(r"Option '([^']+)' is not accepted", line)
        if m:
            keys.append(m.group(1))
            detail = "not an argument of " + (cls or "this class") + _closest(m.group(1), cls)
            break
    return f"{'.'.join(keys)}: {detail}" if keys else detail


def _closest(name: str, class_path: Optional[str]) -> str:
    """The "; did you mean ...?" from the constructor arguments of ``class_path`` (and its bases), or ""."""
    import difflib
    import importlib
    import inspect

    if not class_path:
        return ""
    try:
        module, _, attr = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return ""
    names = {p for c in cls.__mro__ if "__init__" in vars(c) for p in inspect.signature(c.__init__).parameters}
    close = difflib.get_close_matches(name, sorted(names - {"self", "args", "kwargs"}), n=3)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["export"]:
        from .export import main as export_main

        return export_main(argv[1:])
    if argv[:1] == ["evaluate"]:
        from .evaluate import main as evaluate_main

        return evaluate_main(argv[1:])
    try:
        run_cli(Pretraining, args, default_model=MoCo)
    finally:
        end_process_group()


def end_process_group() -> None:
    """Destroys a DDP process group before the interpreter shuts down: a gloo group left to the interpreter's
    finalisation sometimes aborted a finished run at exit ("terminate called without an active exception", SIGABRT),
    its worker threads destroyed while still joinable; Lightning's own atexit handler runs too late for that."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run_cli(
    model_class: type, args: Optional[list[str]] = None, default_model: Optional[type] = None
) -> Optional[MoCoCLI]:
    """Lightning's CLI over any subclass of ``model_class`` (``model: class_path: moco_lightning.MoCoV3``; without a
    class_path, ``default_model``, else ``model_class`` itself) and any datamodule (``data: class_path: ...``)."""
    from argparse import ArgumentError

    from moco_lightning.datamodules.image_folder import BadImageError

    module = "moco_lightning.linear_eval" if model_class.__module__ == "__main__" else model_class.__module__
    prog = "moco-lightning" if default_model is MoCo else f"python -m {module}"
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
                "description": DESCRIPTION if default_model is MoCo else None,
                "formatter_class": _HelpFormatter,
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

        cause = e  # jsonargparse wraps a constructor's error in its own ValueError: look down the chain
        while cause is not None and not isinstance(cause, (ConfigError, BadImageError, MisconfigurationException)):
            cause = cause.__cause__ or cause.__context__
        if cause is None or os.environ.get("MOCO_LIGHTNING_DEBUG"):
            raise
        command = f"{prog} {sub}" if sub else prog
        text = " ".join(str(cause).split())  # Lightning's messages span lines
        if isinstance(cause, MisconfigurationException):  # the Trainer's: say where it comes from
            hint = "; this machine has no GPU: use trainer.accelerator cpu or auto" if "gpu" in text.lower() else ""
            text = f"trainer: {text}{hint}"
        sys.stderr.write(f"{command}: error: {text}\n  (MOCO_LIGHTNING_DEBUG=1 shows the traceback)\n")
        sys.exit(2)


if __name__ == "__main__":
    main()

"""The command line's one-line messages for a bad setting: jsonargparse's nested reports condensed to the setting's
dotted name and what is wrong, a config that is not YAML with its line and column, a class path that does not
import with the classes it could be."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import LightningDataModule

from moco_lightning.methods.base import Pretraining


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


CLI_HELP = """moco-lightning: self-supervised pretraining (MoCo v1/v2/v3, SimCLR, BYOL, SwAV) with Lightning.

  moco-lightning fit --config configs/quickstart.yaml           pretrain (the demo)
  moco-lightning fit --config ... --ckpt_path last              resume the newest run
  moco-lightning export --ckpt last.ckpt --out backbone.pt      the backbone as a state dict (export --help)
  moco-lightning export ... --format detectron2|torchvision-detection|onnx|pt2|torchscript
                                      for detection or serving
  moco-lightning evaluate --ckpt last.ckpt                      kNN, linear, 1 % / 10 % labels (evaluate --help)
  moco-lightning evaluate --ckpt last.ckpt --data_dir DIR       the same on your folder (train/, val/ of classes)
  moco-lightning embed --ckpt last.ckpt --data DIR --out OUT    every image's features, .npy + index.csv
                                      (--neighbours K: a picture of nearest neighbours; --projector: TensorBoard)
  moco-lightning linear fit --config configs/linear_eval.yaml --model.ckpt_path last.ckpt
                                      linear evaluation (also: python -m moco_lightning.cli.linear fit ...)
"""

#: the commands beside LightningCLI's own (fit, validate, test, predict): name -> module whose ``main(argv)`` runs it
COMMANDS = {
    "evaluate": "moco_lightning.cli.evaluate",
    "export": "moco_lightning.cli.export",
    "embed": "moco_lightning.cli.embed",
    "linear": "moco_lightning.cli.linear",
}


def usage(prog: str, lightning_commands: tuple) -> str:
    """The usage line of ``moco-lightning --help``: every subcommand, LightningCLI's and the library's."""
    return f"{prog} [-h] [-c CONFIG] [--print_config] {{{','.join([*lightning_commands, *COMMANDS])}}} ..."


def _help_formatter() -> type:
    import argparse

    from jsonargparse import DefaultHelpFormatter

    class HelpFormatter(DefaultHelpFormatter):
        """jsonargparse's, keeping the description's line breaks (its examples)."""

        _fill_text = argparse.RawDescriptionHelpFormatter._fill_text

    return HelpFormatter


HelpFormatter = _help_formatter()  # the command line's help: jsonargparse's, keeping line breaks


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

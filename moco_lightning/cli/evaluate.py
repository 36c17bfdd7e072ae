"""``moco-lightning evaluate``: the command over :func:`moco_lightning.downstream.evaluate.evaluate` (its module
docstring is the command's help). The checkpoint is read once, into an
:class:`~moco_lightning.downstream.encoder.Encoder` that the datamodule's settings and every measurement use."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from moco_lightning.cli.resume import BEST_LAST, named_checkpoint
from moco_lightning.data_contract import EvaluationLoaders, LabelBudgets, lacks
from moco_lightning.datamodules import BadImageError
from moco_lightning.downstream import evaluate as measure
from moco_lightning.downstream.embed import check_out_folder
from moco_lightning.downstream.encoder import Encoder, read_encoder
from moco_lightning.downstream.evaluate import CURVE, HOLDOUT, MAX_STEPS, evaluate
from moco_lightning.downstream.report import markdown, plot, run_name
from moco_lightning.errors import ConfigError
from moco_lightning.training.compat import constructor_arguments

FOLDER_HOLDOUT = 0.2  # the share of an image folder's training images held out where it has no evaluation split


def folder_settings(encoder: Encoder) -> dict:
    """An image folder's settings for ``encoder``: the size, channels, mean, std and resize it was pretrained with
    (its recorded evaluation transform; without one, the architecture's size and channels)."""
    recorded = encoder.recorded_transform
    if recorded is None:
        return {k: encoder.architecture[k] for k in ("image_size", "in_channels") if k in encoder.architecture}
    return dict(image_size=recorded["image_size"], in_channels=recorded["in_channels"], mean=recorded["mean"],
                std=recorded["std"], eval_resize=recorded.get("resize"))  # fmt: skip


def datamodule_of(
    config: Optional[str],
    split: str,
    fast: bool,
    data_dir: Optional[str] = None,
    ckpt: Union[str, Encoder, None] = None,
    skip_bad_images: bool = False,
    holdout: Optional[float] = None,
) -> Any:
    """The evaluation datamodule: the ``data:`` section of ``config`` (any datamodule class path), an image folder
    ``data_dir`` (``train/`` and ``val/`` of class folders, read as the encoder ``ckpt`` was pretrained:
    :func:`folder_settings`), or Fashion-MNIST; with the evaluation views, ``holdout`` for ``split="val"``, the
    first 2000 / 500 images for ``fast``, and ``skip_bad_images`` where the datamodule reads files."""
    import importlib

    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningDataModule

    from moco_lightning.datamodules import ImageFolderDataModule

    data: dict = {"class_path": "moco_lightning.datamodules.FashionMNISTDataModule", "init_args": {}}
    if config and data_dir:
        raise ConfigError("give --config (its data: section) or --data_dir (an image folder), not both")
    if data_dir:
        settings = folder_settings(read_encoder(ckpt, "--ckpt")) if ckpt else {}
        data = {"class_path": "moco_lightning.datamodules.ImageFolderDataModule",
                "init_args": {"data_dir": data_dir, **settings}}  # fmt: skip
    if config:
        import yaml

        section = (yaml.safe_load(Path(config).read_text()) or {}).get("data")
        if not section:
            raise ConfigError(f"--config {config}: no data: section (the datamodule to evaluate on)")
        data = section
    path = str(data.get("class_path", ""))
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError as e:
        raise ConfigError(f"evaluate: data.class_path {path!r}: cannot import {module} ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, LightningDataModule)):
        raise ConfigError(f"evaluate: data.class_path {path!r} is not a LightningDataModule")
    missing = [m[:-2] for m in lacks(cls, EvaluationLoaders)]  # (num_classes: set by __init__, not on the class)
    if missing:
        raise ConfigError(
            f"evaluate: {name} has no {' / '.join(missing)}: evaluate reads the features of the training split (the "
            "kNN bank, the linear classifiers' training set) and of the evaluation split through them, in evaluation "
            "views (image, target); add them to your datamodule, as moco_lightning.datamodules' have"
        )
    accepted = constructor_arguments(cls, LightningDataModule)
    init = dict(data.get("init_args") or {})
    init.update({k: v for k, v in (("pretrain", False), ("supervised_min_scale", 1.0)) if k in accepted})
    if skip_bad_images:
        if "skip_bad_images" not in accepted:
            raise ConfigError(f"--skip_bad_images: {name} reads no image files (it has no skip_bad_images argument)")
        init["skip_bad_images"] = True
    for key in ("local_views", "local_size", "erase_prob", "translate", "rotation"):
        init.pop(key, None)  # pretraining views: not used by evaluation
    if split == "val":
        if "holdout" not in accepted:
            raise ConfigError(
                f"--split val holds out the end of the training split, which {name} cannot do (no holdout argument): "
                "keep a validation folder apart from the test folder and point --config / --data_dir at it"
            )
        folder = issubclass(cls, ImageFolderDataModule)  # files: a share of them, not 10 000
        init["holdout"] = holdout or (FOLDER_HOLDOUT if folder else HOLDOUT if not fast else 500)
    elif data_dir and not (Path(data_dir).expanduser() / "val").is_dir():
        init["holdout"] = holdout or FOLDER_HOLDOUT
        said = f"{init['holdout']:.0%}" if init["holdout"] < 1 else f"{init['holdout']:g} images"
        print(f"evaluate: {data_dir} has no val/ folder: {said} of train/ (each class alike) is held out as the "
              "evaluation split (--holdout)", file=sys.stderr)  # fmt: skip
    elif holdout is not None:
        raise ConfigError("--holdout: only with --split val, or an image folder without val/")
    if fast:
        init.update({k: v for k, v in (("train_subset", 2000), ("val_subset", 500)) if k in accepted})
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data")
    return parser.instantiate_classes(parser.parse_object({"data": {**data, "init_args": init}})).data


def check_label_budgets(dm: Any, budgets: int) -> None:
    """Label budgets need the datamodule's ``train_targets()`` and ``select_train()``."""
    missing = [m[:-2] for m in lacks(dm, LabelBudgets)]
    if budgets and missing:
        raise ConfigError(
            f"evaluate: the label budgets (--fractions / --per_class) need {type(dm).__name__}.{' and .'.join(missing)}"
            "() (the training split's targets, and keeping a subset of it: every datamodule of moco_lightning has "
            "them); add them, or give --fractions with no value to measure kNN and the full-label linear alone"
        )


def main(argv: Optional[Sequence[str]] = None) -> None:
    doc = (measure.__doc__ or "").split("\n\n")
    p = argparse.ArgumentParser(
        prog="moco-lightning evaluate",
        description=doc[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(doc[1:]),
    )
    p.add_argument("--ckpt", required=True, help="a checkpoint of any method, an export (.pt), " + BEST_LAST)
    p.add_argument(
        "--config",
        default=None,
        help="a YAML whose data: section is the datamodule (default Fashion-MNIST); the fit config of --ckpt best",
    )
    p.add_argument("--data_dir", default=None, help="an image folder: train/ and val/ of class folders (or --config)")
    p.add_argument(
        "--split", choices=("test", "val"), default="test",
        help="val: the last 10000 training images (an image folder: 20 %% of train/, each class alike)",
    )  # fmt: skip
    p.add_argument(
        "--fractions", type=float, nargs="*", default=None, help="label fractions (default 0.01 0.1; --fast: 0.05)"
    )
    curve = f"--fractions {' '.join(f'{f:g}' for f in CURVE)}"
    p.add_argument(
        "--curve", action="store_true",
        help=f"the label-efficiency curve: {curve} (fine-tuning at most {MAX_STEPS} steps)",
    )  # fmt: skip
    p.add_argument(
        "--per_class", type=int, nargs="*", default=[], help="label budgets in images per class (e.g. 10 100)"
    )
    p.add_argument("--k", type=int, nargs="+", default=[20, 200], help="kNN neighbours (default 20 200)")
    p.add_argument(
        "--baseline", action="append", default=[], metavar="FILE",
        help="weights you already have, measured beside it the same way (repeatable): a torchvision / timm state "
        "dict (e.g. ImageNet weights), another run's checkpoint or export",
    )  # fmt: skip
    p.add_argument(
        "--baseline_arch", default=None, metavar="NAME[,stem=S][,width=W]",
        help="the architecture of a --baseline state dict whose keys do not tell it (resnet50, timm:resnet10t)",
    )  # fmt: skip
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="fine-tuning steps (default max(30 epochs, min(600, 200 epochs)), at most 3000; --fast: 10)",
    )
    p.add_argument("--out", default=None, help="folder for evaluate.md/.json/.png (default runs/evaluate/<name>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--holdout", type=float, default=None,
        help="--split val (or a folder without val/): the training images held out, a share (below 1) or a number "
        "(default: 20 %% of a folder, 10000 images of a built-in dataset)",
    )  # fmt: skip
    p.add_argument(
        "--skip_bad_images", action="store_true",
        help="an image folder: read a readable image of the same class in place of an unreadable file",
    )  # fmt: skip
    p.add_argument(
        "--fast",
        action="store_true",
        help="a smoke run: 2000 / 500 images; 5 %% of labels and 10 steps unless --fractions / --steps say otherwise",
    )
    args = p.parse_args(argv)
    if args.curve and args.fractions is not None:
        p.exit(2, f"moco-lightning evaluate: error: --curve is {curve}: give one of them\n")
    fractions = list(CURVE) if args.curve else args.fractions
    fractions = fractions if fractions is not None else [0.05] if args.fast else [0.01, 0.1]
    steps = args.steps if args.steps is not None else 10 if args.fast else None
    if steps is not None and steps < 1:
        p.exit(2, f"moco-lightning evaluate: error: --steps {steps}: give at least 1 fine-tuning step\n")
    if any(not 0 < f <= 1 for f in fractions):
        p.exit(2, f"moco-lightning evaluate: error: --fractions {fractions}: each must be in (0, 1]\n")
    if any(n < 1 for n in args.per_class):
        p.exit(2, f"moco-lightning evaluate: error: --per_class {args.per_class}: each must be at least 1\n")
    try:
        args.ckpt = named_checkpoint(args.ckpt, args.config)
    except ValueError as e:
        p.exit(2, f"moco-lightning evaluate: error: {e}\n")
    out = Path(args.out or Path("runs") / "evaluate" / run_name(args.ckpt))
    try:
        check_out_folder(out)  # before the work, not after it
        encoder = Encoder.read(args.ckpt, arg="--ckpt")  # the file read once, for the data and every measurement
        dm = datamodule_of(args.config, args.split, args.fast, args.data_dir, encoder, args.skip_bad_images,
                           args.holdout)  # fmt: skip
        check_label_budgets(dm, len(fractions) + len(args.per_class))
        result = evaluate(encoder, dm, fractions, args.k, steps, args.seed, per_class=args.per_class,
                          baselines=args.baseline, baseline_arch=args.baseline_arch)  # fmt: skip
    except (FileNotFoundError, ValueError) as e:
        p.exit(2, f"moco-lightning evaluate: error: {e}\n")
    except BadImageError as e:
        p.exit(2, f"moco-lightning evaluate: error: {e.for_option('--skip_bad_images')}\n")
    result["split"] = args.split
    skipped = getattr(dm, "bad_images", [])
    if skipped:
        result["unreadable_images_replaced"] = skipped
        print(f"evaluate: {len(skipped)} unreadable file(s) read as another image of the same class "
              f"(--skip_bad_images): {', '.join(skipped)}", file=sys.stderr)  # fmt: skip
    table = markdown(result)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluate.md").write_text(table + "\n")
    (out / "evaluate.json").write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, out / "evaluate.png") if result["fractions"] else None
    plotted = f", {png}" if png else " (no plot: pip install matplotlib)" if result["fractions"] else ""
    took = f"{result['seconds']:.0f} s, split {args.split}"
    print(f"\nwrote {out / 'evaluate.md'}, {out / 'evaluate.json'}{plotted} ({took})", file=sys.stderr)

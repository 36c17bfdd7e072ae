"""``moco-lightning evaluate``: the command over :func:`moco_lightning.evaluate.evaluate` (its module docstring is
the command's help)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .. import evaluate as measure
from ..errors import ConfigError
from ..evaluate import HOLDOUT, evaluate, markdown, plot, run_name


def datamodule_of(config: Optional[str], split: str, fast: bool) -> Any:
    """The evaluation datamodule: the ``data:`` section of ``config`` (default: Fashion-MNIST) with the evaluation
    views, ``holdout`` for ``split="val"``, and the first 2000 / 500 images for ``fast``."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningDataModule

    data: dict = {"class_path": "moco_lightning.datamodules.FashionMNISTDataModule", "init_args": {}}
    if config:
        import yaml

        section = (yaml.safe_load(Path(config).read_text()) or {}).get("data")
        if not section:
            raise ConfigError(f"--config {config}: no data: section (the datamodule to evaluate on)")
        data = section
    from moco_lightning.datamodules import InMemoryDataModule

    module, _, name = str(data.get("class_path", "")).rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name, None) if module.startswith("moco_lightning.") else None
    if not (isinstance(cls, type) and issubclass(cls, InMemoryDataModule)):
        raise ConfigError(
            f"evaluate: data.class_path {data.get('class_path')!r}: evaluate runs on the in-memory datamodules of "
            "moco_lightning.datamodules (Fashion-MNIST, CIFAR-10/100, STL-10): the label fractions need their "
            "train_targets() and select_train()"
        )
    init = dict(data.get("init_args") or {}, pretrain=False, supervised_min_scale=1.0)
    for key in ("local_views", "local_size", "erase_prob", "translate", "rotation"):
        init.pop(key, None)  # pretraining views: not used by evaluation
    if split == "val":
        init["holdout"] = HOLDOUT if not fast else 500
    if fast:
        init.update(train_subset=2000, val_subset=500)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data")
    return parser.instantiate_classes(parser.parse_object({"data": {**data, "init_args": init}})).data


def main(argv: Optional[Sequence[str]] = None) -> None:
    doc = (measure.__doc__ or "").split("\n\n")
    p = argparse.ArgumentParser(
        prog="moco-lightning evaluate",
        description=doc[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(doc[1:]),
    )
    p.add_argument("--ckpt", required=True, help="a checkpoint of any pretraining method, or an export (.pt)")
    p.add_argument(
        "--config", default=None, help="a YAML whose data: section is the datamodule (default Fashion-MNIST)"
    )
    p.add_argument("--split", choices=("test", "val"), default="test", help="val: the last 10000 training images")
    p.add_argument(
        "--fractions", type=float, nargs="*", default=None, help="label fractions (default 0.01 0.1; --fast: 0.05)"
    )
    p.add_argument("--k", type=int, nargs="+", default=[20, 200], help="kNN neighbours (default 20 200)")
    p.add_argument(
        "--steps", type=int, default=None, help="fine-tuning steps (default max(600, 30 epochs); --fast: 10)"
    )
    p.add_argument("--out", default=None, help="folder for evaluate.md/.json/.png (default runs/evaluate/<name>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fast",
        action="store_true",
        help="a smoke run: 2000 / 500 images; 5 %% of labels and 10 steps unless --fractions / --steps say otherwise",
    )
    args = p.parse_args(argv)
    fractions = args.fractions if args.fractions is not None else [0.05] if args.fast else [0.01, 0.1]
    steps = args.steps if args.steps is not None else 10 if args.fast else None
    if steps is not None and steps < 1:
        p.exit(2, f"moco-lightning evaluate: error: --steps {steps}: give at least 1 fine-tuning step\n")
    if any(not 0 < f <= 1 for f in fractions):
        p.exit(2, f"moco-lightning evaluate: error: --fractions {fractions}: each must be in (0, 1]\n")
    try:
        result = evaluate(
            args.ckpt, datamodule_of(args.config, args.split, args.fast), fractions, args.k, steps, args.seed
        )
    except (FileNotFoundError, ValueError) as e:
        p.exit(2, f"moco-lightning evaluate: error: {e}\n")
    result["split"] = args.split
    table = markdown(result)
    print(table)
    out = Path(args.out or Path("runs") / "evaluate" / run_name(args.ckpt))
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluate.md").write_text(table + "\n")
    (out / "evaluate.json").write_text(json.dumps(result, indent=2) + "\n")
    png = plot(result, out / "evaluate.png") if result["fractions"] else None
    plotted = f", {png}" if png else " (no plot: pip install matplotlib)"
    took = f"{result['seconds']:.0f} s, split {args.split}"
    print(f"\nwrote {out / 'evaluate.md'}, {out / 'evaluate.json'}{plotted} ({took})", file=sys.stderr)

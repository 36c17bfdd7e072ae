"""``moco-lightning evaluate``: what a pretrained encoder is worth, in one command.

    moco-lightning evaluate --ckpt runs/quickstart/version_0/checkpoints/last.ckpt     # any method, or an export
    moco-lightning evaluate --ckpt backbone.pt --split val       # the held-out end of the training split, not test
    moco-lightning evaluate --ckpt last.ckpt --config configs/cifar10.yaml              # another datamodule
    moco-lightning evaluate --ckpt last.ckpt --fast              # a smoke run in seconds

On the datamodule's evaluation views (default: Fashion-MNIST), beside the same measurements of the raw pixels:

- **kNN** top-1 at k 20 and 200 (weighted cosine vote, T 0.1: the library's ``knn_counts``), bank = the training split;
- **linear, all labels**: a linear classifier on the frozen, standardised features (``probe_accuracy``: Adam, 20
  epochs), the raw pixels the same way;
- for each **label fraction** (default 1 % and 10 %: a seeded, class-stratified subset, SimCLR's semi-supervised
  protocol): linear on frozen features (and pixels), the encoder **fine-tuned** (``LinearClassifier(finetune=True)``,
  the recipe of ``configs/low_label.yaml``: SGD momentum 0.9, wd 5e-4, head lr 0.05, backbone lr 0.01, cosine,
  batches of 64 with flips), and the same architecture **from scratch** (random initialisation, lr 0.05
  everywhere), both for the same ``max(30 epochs, min(600, 200 epochs))`` steps, at most 3000.

``--curve`` measures the label-efficiency curve, ``--fractions 0.005 0.01 0.02 0.05 0.1 1`` (``CURVE``), and the
figure it is for: how many labels training from scratch needs to match the fine-tuned encoder at the fewest labels.

The table is printed as Markdown and written with the figures (``evaluate.json``) and a plot of accuracy against
the labelled fraction (``evaluate.png``) to ``--out`` (default ``runs/evaluate/<run>_<version>_<checkpoint>``).
``--split val`` holds the last 10 000 training images out as the evaluation split (``holdout``): select recipes on
it, and report the chosen one once on the test split.
"""

from __future__ import annotations

import copy
import math
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moco_lightning.errors import ConfigError

if TYPE_CHECKING:
    from moco_lightning.downstream.encoder import Encoder

#: the fine-tuning recipe of configs/low_label.yaml (the same for the pretrained encoder and from scratch)
FINETUNE = dict(lr=0.05, backbone_lr=0.01, momentum=0.9, weight_decay=5e-4, schedule="cosine")
BATCH, KNN_T, HOLDOUT = 64, 0.1, 10_000
#: the label-efficiency curve's fractions (``--curve``)
CURVE = (0.005, 0.01, 0.02, 0.05, 0.1, 1.0)
#: fine-tuning steps at most: the 10 % budget of Fashion-MNIST keeps its 2812; all its 60k labels get 3.2 epochs
MAX_STEPS = 3000


def finetune_steps(n_labelled: int) -> int:
    """``max(30 epochs, min(600, 200 epochs))`` of batches of ``min(64, n_labelled)``, at most ``MAX_STEPS``: 600 at
    1 % of Fashion-MNIST (64 epochs), 2812 at 10 %, 3000 at 100 % (3.2 epochs: 30 would take 28125 steps, hours on a
    CPU); a few labelled images get 200 epochs, not 600 (30 of a folder's 3 x 10 images: 200)."""
    epoch = n_labelled / max(1, min(BATCH, n_labelled))  # steps an epoch
    return min(MAX_STEPS, max(round(30 * epoch), min(600, round(200 * epoch))))


def knn_top1(bank: tuple[Tensor, Tensor], queries: tuple[Tensor, Tensor], classes: int, k: int) -> float:
    from moco_lightning.downstream.knn import knn_counts

    correct, total = knn_counts(
        F.normalize(queries[0], dim=1), queries[1], F.normalize(bank[0], dim=1), bank[1], classes, k, KNN_T, topk=(1,)
    ).tolist()
    return correct / total


def linear_top1(
    bank: tuple[Tensor, Tensor], queries: tuple[Tensor, Tensor], classes: int, min_steps: int = 500, seed: int = 0
) -> float:
    """A linear classifier on frozen, standardised features: Adam, at least ``min_steps`` steps and 20 epochs."""
    from moco_lightning.downstream.probe import probe_accuracy

    epochs = max(20, math.ceil(min_steps / math.ceil(len(bank[1]) / 256)))
    return probe_accuracy(bank[0], bank[1], queries[0], queries[1], classes, epochs=epochs, seed=seed)


def evaluate(
    ckpt: Union[str, "Encoder"],
    datamodule: Optional[Any] = None,
    fractions: Sequence[float] = (0.01, 0.1),
    ks: Sequence[int] = (20, 200),
    steps: Optional[int] = None,
    seed: int = 0,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    full_linear: bool = True,
    fine_tune: bool = True,
    scratch: bool = True,
    pixels: bool = True,
    per_class: Sequence[int] = (),
    baselines: Sequence[Union[str, "Encoder"]] = (),
    baseline_arch: Optional[str] = None,
) -> dict:
    """The figures of :mod:`moco_lightning.downstream.evaluate` for the encoder of ``ckpt`` (a checkpoint of any
    method, an export, or an :class:`~moco_lightning.downstream.encoder.Encoder` read already) on ``datamodule``
    (any datamodule with evaluation loaders, ``num_classes`` and, for the label budgets, ``train_targets()`` /
    ``select_train()``: every datamodule of this library, image folders included; default: Fashion-MNIST's test
    split). Label budgets: ``fractions`` of each class and ``per_class`` images of each class.
    ``full_linear``, ``fine_tune``, ``scratch``, ``pixels``: measure those columns (a search skips the costly ones and
    the raw pixels, which do not change between its trials). ``baselines``: encoders the user has (files: a torchvision
    / timm state dict, another run's checkpoint or export; :mod:`moco_lightning.downstream.baseline`, ``baseline_arch``
    naming an architecture its keys do not tell), measured beside it by the same protocol: kNN, linear on all labels
    and, at each budget, linear on frozen features and fine-tuned (the same recipe and steps)."""
    from lightning.pytorch import seed_everything

    from moco_lightning.datamodules import FashionMNISTDataModule
    from moco_lightning.datamodules.selection import balanced_subset
    from moco_lightning.downstream.encoder import read_encoder
    from moco_lightning.downstream.features import embed

    t0 = time.perf_counter()
    encoder = read_encoder(ckpt, arg="--ckpt")  # the file read once: every budget's classifier is built from it
    backbone, _ = encoder.build()
    dm = datamodule if datamodule is not None else FashionMNISTDataModule(pretrain=False, supervised_min_scale=1.0)
    if getattr(dm, "pretrain", False):
        raise ConfigError("evaluate needs the datamodule's evaluation views: set its pretrain false")
    template = copy.deepcopy(dm)  # each fine-tuning run restricts the training split of a fresh copy to its labels
    dm.setup("fit")
    classes, names = dm.num_classes, getattr(dm, "classes", None)
    if per_class and hasattr(dm, "train_targets"):  # a budget larger than a class: refused before any work
        for n in per_class:
            balanced_subset(dm.train_targets(), per_class=n, seed=seed, names=names, setting="--per_class")
    cpu = torch.device("cpu")
    progress(f"evaluate: {encoder.source}: features of the training and evaluation splits")
    others = read_baselines(baselines, dm, baseline_arch)
    splits = {}
    columns = (("encoder", backbone), ("pixels", nn.Flatten()))[: 2 if pixels else 1]
    columns += tuple((name, other.build()[0]) for name, (other, _) in others.items())
    for name, module in columns:
        train = embed(module, dm.eval_train_dataloader(), cpu, gather=False, normalize=False)
        held = embed(module, dm.eval_val_dataloader(), cpu, gather=False, normalize=False)
        splits[name] = (train, held)
    n_train, n_eval = len(splits["encoder"][0][1]), len(splits["encoder"][1][1])
    out: dict = {"ckpt": encoder.source, "train_images": n_train, "eval_images": n_eval, "classes": classes, "rows": {}}
    out["baselines"] = {name: {"source": other.source, "architecture": other.architecture, "preprocessing": how}
                        for name, (other, how) in others.items()}  # fmt: skip
    for name, (train, held) in splits.items():
        for k in ks:  # a k above the bank's size is every training image: said in the row's name
            row = f"kNN k {k}" if k <= n_train else f"kNN k {n_train} (--k {k} capped: {n_train} training images)"
            out["rows"].setdefault(row, {})[name] = knn_top1(train, held, classes, min(k, n_train))
        if full_linear:
            progress(f"evaluate: {name}: linear on all {n_train} labels")
            out["rows"].setdefault("linear, all labels", {})[name] = linear_top1(train, held, classes)
    out["fractions"] = {}
    targets = splits["encoder"][0][1]
    budgets = [(f"{f:g}", dict(fraction=f)) for f in fractions] + [(f"{n}/class", dict(per_class=n)) for n in per_class]
    for key, budget in budgets:
        idx = balanced_subset(targets, seed=seed, names=names, setting="--per_class", **budget)
        row = {"labels": len(idx), "share": len(idx) / n_train}
        frozen = (("linear", "encoder"), ("linear_pixels", "pixels"))[: 2 if pixels else 1]
        for column, name in frozen + tuple((f"linear {name}", name) for name in others):
            every = out["rows"].get("linear, all labels", {}).get(name) if len(idx) == n_train else None
            subset = tuple(t[idx] for t in splits[name][0])  # all the labels: the full-label linear, measured already
            row[column] = every if every is not None else linear_top1(subset, splits[name][1], classes)
        n_steps, batch = steps or finetune_steps(len(idx)), min(BATCH, len(idx))  # a small subset: one batch of all
        if fine_tune or scratch:
            row["steps"], row["batch"] = n_steps, batch
        for column, from_scratch, wanted in (("fine_tuned", False, fine_tune), ("from_scratch", True, scratch)):
            if not wanted:
                continue
            progress(f"evaluate: {key} of the labels ({len(idx)}): {column.replace('_', ' ')}, {n_steps} steps")
            seed_everything(seed, verbose=False)
            row[column] = _finetune(encoder, copy.deepcopy(template), budget, n_steps, from_scratch, seed, batch)
        for name, (other, _) in others.items() if fine_tune else ():
            progress(f"evaluate: {key} of the labels ({len(idx)}): {name} fine-tuned, {n_steps} steps")
            seed_everything(seed, verbose=False)
            row[f"fine_tuned {name}"] = _finetune(other, copy.deepcopy(template), budget, n_steps, False, seed, batch)
        if fine_tune and scratch:
            row["fine_tuned_minus_scratch"] = row["fine_tuned"] - row["from_scratch"]
        out["fractions"][key] = row
    out["labels_to_match"] = labels_to_match(out["fractions"])
    out["seconds"] = time.perf_counter() - t0
    return out


def read_baselines(sources: Sequence[Union[str, "Encoder"]], dm: Any, arch: Optional[str]) -> dict:
    """``{column name: (encoder, how it is fed)}`` of the baselines, for the images of ``dm``; the name is the file's
    (``baseline <stem>``, numbered where two share one)."""
    from pathlib import Path

    from moco_lightning.downstream.baseline import read_baseline

    found: dict = {}
    for i, source in enumerate(sources):
        name = f"baseline {Path(str(getattr(source, 'source', source))).stem}"
        name = f"{name} ({i + 1})" if name in found else name
        if not isinstance(source, str) and hasattr(source, "architecture"):  # an Encoder read already
            found[name] = (source, "an encoder given as it is")
        else:
            found[name] = read_baseline(source, dm.in_channels, dm.image_size, arch)
    return found


def _finetune(
    encoder: "Encoder", data: Any, budget: dict, steps: int, scratch: bool, seed: int, batch: int = BATCH
) -> float:
    """Held-out top-1 of ``LinearClassifier`` fine-tuned (or from scratch) on a label ``budget`` of ``data``
    (``{"fraction": f}`` or ``{"per_class": n}``; a fresh datamodule: the labelled subset replaces its training split),
    in batches of ``batch``."""
    from lightning.pytorch import Trainer

    from moco_lightning.downstream.linear_eval import LinearClassifier

    data.batch_size = batch
    recipe = dict(FINETUNE, backbone_lr=None) if scratch else FINETUNE
    labels = dict(label_fraction=budget.get("fraction"), labels_per_class=budget.get("per_class"))
    model = LinearClassifier.on_encoder(encoder, **labels, label_seed=seed, finetune=True, from_scratch=scratch,
                                        **recipe)  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", max_steps=steps, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        check_val_every_n_epoch=10**6,  # validation once, after the training steps
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
        return float(trainer.validate(model, datamodule=data, verbose=False)[0]["val/acc1"])


def labels_to_match(fractions: dict) -> Optional[dict]:
    """The figure a label-efficiency curve is for: how many labels training from scratch needs to reach what the
    fine-tuned encoder reaches with the fewest labels measured. The from-scratch curve is interpolated linearly in
    log(labels) between measured budgets; ``labels`` is None when no budget measured reaches it (then at least
    ``beyond`` labels). None without two budgets measured both ways."""
    rows = sorted((r["labels"], r["fine_tuned"], r["from_scratch"]) for r in fractions.values()
                  if "fine_tuned" in r and "from_scratch" in r)  # fmt: skip
    if len(rows) < 2:
        return None
    base, target = rows[0][0], rows[0][1]
    found = None
    for (n0, _, a0), (n1, _, a1) in zip(rows, rows[1:]):
        if a0 >= target:
            found = n0
            break
        if a1 >= target:  # between n0 and n1, on a log scale of labels
            t = (target - a0) / (a1 - a0)
            found = round(math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0))))
            break
    out = {"fine_tuned_labels": base, "fine_tuned": target, "labels": found, "beyond": rows[-1][0]}
    out["times"] = found / base if found is not None else None
    return out

"""Which labelled training images a classifier learns from: the low-label protocol of SimCLR (Chen et al. 2020,
§B.5 and Table 7: 1 % or 10 % of the labels, drawn per class), and the checks that a datamodule can train a
classifier at all.

A datamodule takes part through ``train_targets()`` and ``select_train(indices)`` (every in-memory datamodule of
this library has them); the chosen indices are written to ``labelled_indices.txt`` in the run's folder.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from moco_lightning.errors import ConfigError


def check_label_subset(fraction: Optional[float], per_class: Optional[int]) -> None:
    if (fraction is None) == (per_class is None):
        raise ConfigError("give exactly one of label_fraction (in (0, 1]) and labels_per_class (>= 1)")
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"label_fraction={fraction} is not allowed; label_fraction must be in (0, 1]")
    if per_class is not None and per_class < 1:
        raise ConfigError(f"labels_per_class={per_class} is not allowed; labels_per_class must be >= 1")


def balanced_subset(
    targets: Tensor,
    fraction: Optional[float] = None,
    per_class: Optional[int] = None,
    seed: int = 0,
    names: Optional[Sequence[str]] = None,
    setting: str = "labels_per_class",
) -> Tensor:
    """Sorted indices of a seeded, class-stratified subset of ``targets``: ``per_class`` images of every class, or
    ``fraction`` of each class (at least one). Targets < 0 (unlabelled) are never drawn. Errors name the class by
    ``names`` (an image folder's class folders) and the budget by ``setting`` (the caller's name for it)."""
    check_label_subset(fraction, per_class)
    targets = torch.as_tensor(targets).long()
    g = torch.Generator().manual_seed(seed)
    chosen = []
    for c in torch.unique(targets[targets >= 0]).tolist():
        idx = (targets == c).nonzero().flatten()
        n = per_class if per_class is not None else max(1, round(fraction * len(idx)))
        if n > len(idx):
            name = f"class {names[c]!r}" if names is not None and c < len(names) else f"class {c}"
            raise ConfigError(
                f"{setting}={per_class}, but {name} has only {len(idx)} training images: give at most {len(idx)}"
            )
        chosen.append(idx[torch.randperm(len(idx), generator=g)[:n]])
    return torch.cat(chosen).sort().values if chosen else torch.zeros(0, dtype=torch.long)


def check_subset_size(n: int, batch_size: int) -> None:
    """A labelled subset must fill one training batch (training drops the last partial batch)."""
    if n < batch_size:
        raise ConfigError(
            f"the labelled subset has {n} images, fewer than batch_size={batch_size} (training drops the last "
            "partial batch, so nothing would be trained): lower data.batch_size or use more labels"
        )


def select_labels(
    dm: Any, targets: Optional[Tensor], fraction: Optional[float], per_class: Optional[int], seed: int, trainer: Any
) -> Tensor:
    """Restricts ``dm``'s training split to the label subset of ``targets`` (its ``train_targets()``); the indices
    are written to ``labelled_indices.txt`` in the ``trainer``'s log folder (rank 0; none without a logger) and
    returned."""
    if targets is None or not hasattr(dm, "select_train"):
        raise ConfigError(
            f"LinearClassifier: label_fraction/labels_per_class need a datamodule with train_targets() and "
            f"select_train(indices) (every in-memory datamodule of moco_lightning); {type(dm).__name__} has not"
        )
    indices = balanced_subset(targets, fraction, per_class, seed)
    dm.select_train(indices)
    folder = trainer.log_dir if trainer.logger is not None and trainer.is_global_zero else None
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "labelled_indices.txt"), "w") as f:
            f.write("\n".join(str(i) for i in indices.tolist()) + "\n")
    return indices


def check_classification_data(dm: Any, backbone: nn.Module, head_classes: Optional[int]) -> None:
    """``dm`` gives what a classifier of ``backbone`` can learn: labelled single images of the backbone's channels,
    at least two classes, as many as the head has (``head_classes``, when built)."""
    if dm is None:
        return
    if getattr(dm, "pretrain", False):
        raise ConfigError(
            "LinearClassifier trains on (image, target) batches, but the datamodule gives pretraining views "
            "(pretrain true): set data.init_args.pretrain false"
        )
    n = getattr(dm, "num_classes", None)
    if n is not None and n < 2:
        raise ConfigError(
            f"LinearClassifier: the datamodule has {n} class(es): a classifier needs at least 2 labelled classes "
            "(for an image folder: one subfolder of train/ and val/ per class)"
        )
    if n is not None and head_classes is not None and head_classes != n:
        raise ConfigError(
            f"LinearClassifier: model.num_classes={head_classes}, but the datamodule has {n} classes: "
            f"set model.num_classes {n} (or leave it unset: read from the datamodule)"
        )
    first = next((m for m in backbone.modules() if isinstance(m, nn.Conv2d)), None)
    channels = getattr(dm, "in_channels", None)
    if first is not None and channels is not None and first.in_channels != channels:
        raise ConfigError(
            f"LinearClassifier: the backbone takes {first.in_channels}-channel images, the datamodule gives "
            f"{channels}-channel ones: set the datamodule's in_channels {first.in_channels} (grayscale: 1), or "
            "evaluate a backbone pretrained on such images"
        )


def training_targets(dm: Any, classes: Optional[int]) -> Optional[Tensor]:
    """``dm.train_targets()`` (None where the datamodule cannot say), after checking that every one of ``classes``
    has training images: a classifier could never predict a class it never saw."""
    if not hasattr(dm, "train_targets"):
        return None
    targets = torch.as_tensor(dm.train_targets()).long()
    classes = getattr(dm, "num_classes", None) or classes
    present = set(torch.unique(targets[targets >= 0]).tolist())
    missing = sorted(set(range(classes)) - present) if classes else []
    if missing:
        raise ConfigError(
            f"LinearClassifier: the training split holds {len(present)} of the {classes} classes (none of "
            f"{missing[:10]}{', ...' if len(missing) > 10 else ''}): the classifier could never predict those; "
            "train on a split with every class (a larger data.train_subset, or none)"
        )
    return targets

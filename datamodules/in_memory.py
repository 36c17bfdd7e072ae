"""Datasets that fit in memory as uint8 tensors (Fashion-MNIST, CIFAR-10, STL-10): the dataset, the evaluation
collate and :class:`InMemoryDataModule`, whose views are drawn batched on the batch's device."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from moco_lightning.errors import ConfigError

from .base import TwoViewDataModule
from .loading import Batch, SeededRandomSampler, collate
from .selection import check_subset_size
from .transforms import ViewSettings, linear_eval_views


class ImageTensorDataset(Dataset):
    """uint8 images (N, C, H, W) held in memory, with targets: items ``(image, target, index)``."""

    def __init__(self, images: Tensor, targets: Tensor) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ConfigError(f"images must be a uint8 tensor (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(targets):
            raise ConfigError(f"{len(images)} images but {len(targets)} targets")
        self.images, self.targets = images, targets

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> Tuple[Tensor, Tensor, int]:
        return self.images[i], self.targets[i], i

    def __getitems__(self, indices: Sequence[int]) -> "Batch":
        """A whole batch by tensor indexing (the DataLoader's fetcher calls this instead of one item at a time)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        return Batch((self.images[index], self.targets[index], index))


class NormalizeCollate:
    """Collates uint8 image items into one normalised float batch (the evaluation transform)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], size: Optional[int] = None) -> None:
        self.mean = torch.tensor(mean).view(1, -1, 1, 1)
        self.std = torch.tensor(std).view(1, -1, 1, 1)
        self.size = size

    def __call__(self, items: list) -> Tuple[Tensor, Tensor, Tensor]:
        images, targets, index = collate(items)
        x = images.float().div_(255)
        if self.size is not None and x.shape[-1] != self.size:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        return (x - self.mean) / self.std, targets, index


class InMemoryDataModule(TwoViewDataModule):
    """Base for datasets held in memory as uint8 tensors; augmentation runs batched on the device.

    Subclasses set ``num_classes``, ``mean``, ``std``, ``in_channels``, pass their view ``settings`` (a
    :class:`~moco_lightning.datamodules.transforms.ViewSettings`) and implement :meth:`load_split` returning
    ``(images uint8 (N, C, H, W), targets int64 (N,))``.

    Args:
        batch_size: per device; pretraining drops the last partial batch.
        image_size: side of the views and of the evaluation images.
        num_workers: DataLoader workers (0: batches are cut from memory in the training process).
        seed: the sampler's order (from ``(seed, epoch)``) and the augmentation generator's start.
        pretrain: two-view batches (True) or the linear-evaluation views (random resized crop 0.08-1 + flip).
        local_views, local_size, local_scale: multi-crop (SwAV §3.2): small extra views for the query encoder
            (:class:`BatchViews`); ``local_size`` None: 96/224 of ``image_size``.
        train_subset, val_subset: the first N images of each split (None: all).
        holdout: the last N training images become the held-out split in place of the dataset's own (its test
            split): for selecting recipes and hyper-parameters without looking at the test split (None: off).
        supervised_min_scale: smallest crop area of the supervised training views (``pretrain=False``: linear
            evaluation, fine-tuning, training from scratch): 0.08 is the linear protocol's; 1.0 is flips only.
    """

    def __init__(
        self,
        settings: ViewSettings,
        batch_size: int = 256,
        image_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
        pretrain: bool = True,
        local_views: int = 0,
        local_size: Optional[int] = None,
        local_scale: Tuple[float, float] = (0.05, 0.14),
        train_subset: Optional[int] = None,
        val_subset: Optional[int] = None,
        supervised_min_scale: float = 0.08,
        holdout: Optional[int] = None,
    ) -> None:
        for name, value in (("train_subset", train_subset), ("val_subset", val_subset), ("holdout", holdout)):
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be None (the whole split) or >= 1, got {value}")
        settings = settings.with_local_views(local_views, local_size, local_scale)
        views = (
            settings.batch_views(self.mean, self.std)
            if pretrain
            else linear_eval_views(image_size, self.mean, self.std, min_scale=supervised_min_scale)
        )
        super().__init__(batch_size, image_size, num_workers, seed, pretrain, views)
        self.view_settings = settings
        self.train_subset, self.val_subset, self.holdout = train_subset, val_subset, holdout
        self._splits: dict[str, ImageTensorDataset] = {}

    # --- what a subclass provides -----------------------------------------------------------
    def load_split(self, split: str) -> Tuple[Tensor, Tensor]:
        """``split`` is "train" or "val"; returns (uint8 images (N, C, H, W), int64 targets)."""
        raise NotImplementedError

    # --- Lightning hooks --------------------------------------------------------------------
    def setup(self, stage: Optional[str] = None) -> None:
        self._load_splits()
        if self.pretrain and len(self._splits["train"]) < self.batch_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is larger than the {len(self._splits['train'])} training images "
                "(pretraining drops the last partial batch): lower batch_size or raise train_subset"
            )

    def train_dataloader(self) -> DataLoader:
        ds = self._splits["train"]
        return self._loader(ds, sampler=SeededRandomSampler(len(ds), self.seed), drop_last=True)

    def val_dataloader(self) -> DataLoader:
        if self.pretrain:
            return self._loader(self._splits["val"])
        return self.eval_val_dataloader()

    def eval_train_dataloader(self) -> DataLoader:
        return self._loader(self._splits["train"], collate_fn=self._eval_collate(), persistent=False)

    def eval_val_dataloader(self) -> DataLoader:
        return self._loader(self._splits["val"], collate_fn=self._eval_collate(), persistent=False)

    def split_dataset(self, split: str) -> ImageTensorDataset:
        """The ``"train"`` or ``"val"`` split as loaded (images uint8, targets), what the loaders draw from."""
        self._load_splits()
        return self._splits[split]

    # --- low-label training (LinearClassifier's label_fraction / labels_per_class) -------------------
    def train_targets(self) -> Tensor:
        """The targets of the training split (as loaded, after ``train_subset``)."""
        self._load_splits()
        return self._splits["train"].targets

    def select_train(self, indices: Tensor) -> None:
        """Keeps only these images of the training split (a labelled subset; positions in :meth:`train_targets`)."""
        self._load_splits()
        ds = self._splits["train"]
        indices = torch.as_tensor(indices, dtype=torch.long)
        check_subset_size(len(indices), self.batch_size)
        self._splits["train"] = ImageTensorDataset(ds.images[indices], ds.targets[indices])

    # --- helpers ----------------------------------------------------------------------------
    def _load_splits(self) -> None:
        """Loads "train" and "val" once each (cut to train_subset / val_subset) into ``self._splits``; with
        ``holdout`` the held-out split is the end of the training split, never the test split."""
        if self.holdout and not self._splits:
            images, targets = self.load_split("train")
            if self.holdout >= len(targets):
                raise ConfigError(
                    f"holdout={self.holdout} takes every one of the {len(targets)} training images: hold out fewer"
                )
            cut = len(targets) - self.holdout
            self._held_out = {"train": (images[:cut], targets[:cut]), "val": (images[cut:], targets[cut:])}
        for split, limit in (("train", self.train_subset), ("val", self.val_subset)):
            if split not in self._splits:
                images, targets = self._held_out[split] if self.holdout else self.load_split(split)
                if limit is not None:
                    images, targets = images[:limit], targets[:limit]
                self._splits[split] = ImageTensorDataset(images, targets.long())

    def _eval_collate(self) -> NormalizeCollate:
        return NormalizeCollate(self.mean, self.std, self.image_size)

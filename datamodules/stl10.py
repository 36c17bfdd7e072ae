"""STL-10 (Coates, Ng, Lee 2011, https://cs.stanford.edu/~acoates/stl10/): 96x96 colour images, 10 classes;
5 000 labelled training images, 8 000 test images and 100 000 unlabelled images.

Read from the binaries torchvision downloads and extracts:
``<data_dir>/stl10_binary/{unlabeled_X.bin, train_X.bin, train_y.bin, test_X.bin, test_y.bin}``
(images: uint8, each 3 x 96 x 96 stored column-major per channel; labels: uint8 1..10).

- pretraining: unlabelled + labelled-train images (targets of the unlabelled ones are -1);
- kNN bank / linear-probe training (``eval_train_dataloader``, ``pretrain=False``): the labelled train split;
- evaluation (``val_dataloader``, ``eval_val_dataloader``): the test split.

All of it lives in memory as uint8: the full unlabelled split is 100 000 x 3 x 96 x 96 = 2.76 GB
(read in chunks, no second copy). ``unlabeled_subset`` keeps only its first N images (0: none).

``download=True`` fetches the 2.6 GB archive with torchvision's ``STL10(data_dir, download=True)``
(MD5-checked) when files are missing; loading reads the binaries directly (torchvision's class
re-hashes 2.6 GB and loads all 100 000 images on each construction).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from moco_lightning.errors import ConfigError, DataNotFoundError

from .in_memory import ImageTensorDataset, InMemoryDataModule
from .loading import SeededRandomSampler
from .transforms import Preset, view_settings

IMAGE_BYTES = 3 * 96 * 96
FILES = {
    "unlabeled": ("unlabeled_X.bin", None),
    "train": ("train_X.bin", "train_y.bin"),
    "val": ("test_X.bin", "test_y.bin"),
}


def read_stl10_images(
    path: Path, limit: Optional[int] = None, out: Optional[Tensor] = None, chunk: int = 4096
) -> Tensor:
    """Reads an STL-10 ``*_X.bin`` file into uint8 (N, 3, 96, 96), at most ``limit`` images, into ``out``
    when given (its first N rows), ``chunk`` images at a time."""
    size = path.stat().st_size
    if size == 0 or size % IMAGE_BYTES:
        raise ConfigError(
            f"{path}: {size} bytes is not a whole number of 3x96x96 images ({IMAGE_BYTES} bytes each): truncated or "
            "not an STL-10 binary; delete it and get the dataset again (data.download=true)"
        )
    n = size // IMAGE_BYTES if limit is None else min(limit, size // IMAGE_BYTES)
    if out is None:
        out = torch.empty((n, 3, 96, 96), dtype=torch.uint8)
    with open(path, "rb") as f:
        for start in range(0, n, chunk):
            k = min(chunk, n - start)
            block = np.fromfile(f, dtype=np.uint8, count=k * IMAGE_BYTES).reshape(k, 3, 96, 96)
            out[start : start + k] = torch.from_numpy(block).transpose(2, 3)  # column-major -> (C, H, W)
    return out[:n]


def read_stl10_labels(path: Path, n_images: int) -> Tensor:
    labels = np.fromfile(path, dtype=np.uint8).astype(np.int64)
    if len(labels) != n_images:
        raise ConfigError(f"{path}: {len(labels)} labels for {n_images} images (truncated or mismatched files)")
    if len(labels) and (labels.min() < 1 or labels.max() > 10):
        raise ConfigError(f"{path}: labels must be 1..10, found {labels.min()}..{labels.max()}")
    return torch.from_numpy(labels - 1)


class STL10DataModule(InMemoryDataModule):
    """STL-10 for MoCo pretraining and evaluation (see :mod:`moco_lightning.datamodules.base`).

    Args:
        data_dir: folder holding ``stl10_binary/`` (or that folder itself).
        download: download through torchvision into ``data_dir`` when files are missing.
        unlabeled_subset: pretrain on only the first N unlabelled images (None: all 100 000; 0: none,
            the 5 000 labelled images alone). Not read at all when ``pretrain=False``.
        image_size: side of the views (96: native).
        preset, min_scale, jitter_strength, blur: view augmentation, see
            :class:`~moco_lightning.datamodules.cifar.CIFAR10DataModule` (at 96 px the preset's blur is on).
        **kwargs: batch size, workers, seed, pretrain, multi-crop, ``train_subset`` / ``val_subset`` (the first N
            labelled-train / test images): see :class:`~moco_lightning.datamodules.in_memory.InMemoryDataModule`.
    """

    num_classes = 10
    mean = (0.4467, 0.4398, 0.4066)
    std = (0.2603, 0.2566, 0.2713)
    in_channels = 3

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        image_size: int = 96,
        preset: Preset = "moco_v2",
        min_scale: Optional[float] = None,
        jitter_strength: float = 1.0,
        blur: Optional[bool] = None,
        unlabeled_subset: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        if unlabeled_subset is not None and unlabeled_subset < 0:
            raise ConfigError(
                f"unlabeled_subset must be None (all 100 000), 0 (none) or a positive count, got {unlabeled_subset}"
            )
        settings = view_settings(preset, image_size, min_scale=min_scale, jitter_strength=jitter_strength, blur=blur)
        super().__init__(settings, image_size=image_size, **kwargs)
        self.data_dir, self.download, self.preset = data_dir, download, preset
        self.unlabeled_subset = unlabeled_subset

    # --- files --------------------------------------------------------------------------------
    def _needed(self) -> list[str]:
        names = [f for split in ("train", "val") for f in FILES[split]]
        if self.pretrain and self.unlabeled_subset != 0:
            names.append(FILES["unlabeled"][0])
        return names

    def _find_dir(self) -> Optional[Path]:
        d = Path(self.data_dir).expanduser()
        for candidate in (d / "stl10_binary", d):
            if all((candidate / f).is_file() for f in self._needed()):
                return candidate
        return None

    def _folder(self) -> Path:
        folder = self._find_dir()
        if folder is None:
            expected = Path(self.data_dir).expanduser() / "stl10_binary"
            missing = [f for f in self._needed() if not (expected / f).is_file()]
            raise DataNotFoundError(
                f"STL-10 not found: expected {expected}/{{{', '.join(self._needed())}}} "
                f"(missing: {', '.join(missing)}), "
                "the binary version from https://cs.stanford.edu/~acoates/stl10/ (stl10_binary.tar.gz, 2.6 GB). "
                f"Set data.download=true to fetch it through torchvision into data_dir={self.data_dir!r}, or point "
                "data.data_dir at the folder holding stl10_binary/."
            )
        return folder

    def prepare_data(self) -> None:
        if self.download and self._find_dir() is None:
            from torchvision.datasets import STL10

            STL10(os.fspath(Path(self.data_dir).expanduser()), split="test", download=True)

    def load_split(self, split: str) -> Tuple[Tensor, Tensor]:
        """ "train" (labelled), "val" (test) or "unlabeled" (targets -1)."""
        folder = self._folder()
        image_file, label_file = FILES[split]
        limit = self.unlabeled_subset if split == "unlabeled" else None
        images = read_stl10_images(folder / image_file, limit)
        if label_file is None:
            return images, torch.full((len(images),), -1, dtype=torch.long)
        return images, read_stl10_labels(folder / label_file, len(images))

    # --- Lightning hooks --------------------------------------------------------------------
    def setup(self, stage: Optional[str] = None) -> None:
        self._load_splits()
        if self.pretrain and "pretrain" not in self._splits:
            labelled = self._splits["train"]
            if self.unlabeled_subset == 0:
                self._splits["pretrain"] = labelled
            else:
                # one allocation: unlabelled images read straight into it, the labelled ones after
                path = self._folder() / FILES["unlabeled"][0]
                n_unl = path.stat().st_size // IMAGE_BYTES
                if self.unlabeled_subset is not None:
                    n_unl = min(n_unl, self.unlabeled_subset)
                images = torch.empty((n_unl + len(labelled), 3, 96, 96), dtype=torch.uint8)
                read_stl10_images(path, n_unl, out=images)
                images[n_unl:] = labelled.images
                targets = torch.cat([torch.full((n_unl,), -1, dtype=torch.long), labelled.targets])
                self._splits["pretrain"] = ImageTensorDataset(images, targets)
        n = len(self._splits["pretrain" if self.pretrain else "train"])
        if self.pretrain and n < self.batch_size:
            raise ConfigError(
                f"batch_size={self.batch_size} is larger than the {n} pretraining images "
                "(pretraining drops the last partial batch): lower batch_size or raise unlabeled_subset / train_subset"
            )

    def train_dataloader(self) -> DataLoader:
        ds = self._splits["pretrain" if self.pretrain else "train"]
        return self._loader(ds, sampler=SeededRandomSampler(len(ds), self.seed), drop_last=True)

"""Tiny data: Fashion-MNIST subsets, a toy datamodule honouring the library's contract, the fixture checkpoint."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset

#: a tiny MoCo checkpoint of moco-lightning 0.2.0 (format 2): 1-channel, 28 px
FIXTURE_CKPT = str(Path(__file__).resolve().parents[1] / "fixtures" / "format2" / "MoCo.ckpt")


def tiny_data(**kwargs: Any) -> Any:
    """Fashion-MNIST: 64 training and 32 held-out images, batches of 16."""
    from moco_lightning.datamodules import FashionMNISTDataModule

    return FashionMNISTDataModule(**{**dict(batch_size=16, train_subset=64, val_subset=32, seed=0), **kwargs})


def training(dm: Any) -> Any:
    """``dm`` as a Trainer in its training loop sees it (for a datamodule's training-time hooks without a fit)."""
    dm.trainer = SimpleNamespace(training=True, validating=False, sanity_checking=False, global_rank=0)
    return dm


def toy_images(n: int, num_classes: int, size: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 1, size, size) images in [0, 1], the class drawn as a texture over the whole image (global
    pooling keeps it): horizontal stripes, vertical stripes, a checkerboard, then uniform grey; plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % num_classes
    r = torch.arange(size).view(-1, 1)
    c = torch.arange(size).view(1, -1)
    patterns = [(r % 2 == 0) + 0 * c, (c % 2 == 0) + 0 * r, (r + c) % 2 == 0, torch.full((size, size), 0.5)]
    x = torch.stack([0.8 * patterns[int(k) % 4].float() for k in y]).unsqueeze(1)
    x = x + 0.05 + 0.1 * torch.rand(n, 1, size, size, generator=g)
    return x.clamp(0, 1), y


class ToyData(LightningDataModule):
    """``num_classes``, ``mean``, ``std``; train batches ``([v1, v2], y, idx)``; evaluation loaders in order."""

    mean = (0.3,)
    std = (0.4,)

    def __init__(
        self, n_train: int = 48, n_val: int = 24, batch_size: int = 8, num_classes: int = 3, size: int = 8
    ) -> None:
        super().__init__()
        self.num_classes, self.batch_size, self.size = num_classes, batch_size, size
        self.train_x, self.train_y = toy_images(n_train, num_classes, size, seed=1)
        self.val_x, self.val_y = toy_images(n_val, num_classes, size, seed=2)
        self.eval_train_calls = 0

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean[0]) / self.std[0]

    def _views(self, items: list) -> tuple:
        x = torch.stack([i[0] for i in items])
        y = torch.stack([i[1] for i in items])
        idx = torch.stack([i[2] for i in items])
        views = [self._norm((x + 0.03 * torch.randn_like(x)).clamp(0, 1)) for _ in range(2)]
        return views, y, idx

    def _eval(self, items: list) -> tuple:
        x, y, idx = (torch.stack([i[j] for i in items]) for j in range(3))
        return self._norm(x), y, idx

    def train_dataloader(self) -> DataLoader:
        ds = TensorDataset(self.train_x, self.train_y, torch.arange(len(self.train_y)))
        return DataLoader(ds, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=self._views)

    def eval_train_dataloader(self) -> DataLoader:
        self.eval_train_calls += 1
        ds = TensorDataset(self.train_x, self.train_y, torch.arange(len(self.train_y)))
        return DataLoader(ds, batch_size=self.batch_size, collate_fn=self._eval)

    def eval_val_dataloader(self) -> DataLoader:
        ds = TensorDataset(self.val_x, self.val_y, torch.arange(len(self.val_y)))
        return DataLoader(ds, batch_size=self.batch_size, collate_fn=self._eval)

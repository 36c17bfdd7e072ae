"""Toys for the callback tests: a tiny datamodule honouring the library's contract, a plain (non-MoCo)
conv net whose ``forward`` returns features, and a logger that records what it is given."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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


class TinyNet(LightningModule):
    """Not MoCo: a conv net (with BatchNorm) whose ``forward(x)`` returns 16-d features, trained with an
    in-batch InfoNCE on two views. ``training_step`` returns ``{"loss", "q", "k"}`` (+ ``"features"``)."""

    def __init__(self, return_features: bool = False, train_backbone: bool = True) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(1, 8, 3, 1, 1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, 2, 1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(16, 8)
        self.dummy = nn.Parameter(torch.zeros(1))
        self.return_features, self.train_backbone = return_features, train_backbone
        self.forward_calls = 0
        self.outputs: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_calls += 1
        return self.backbone(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        v1, v2 = batch[0]
        if not self.train_backbone:  # the backbone is never run by the module itself
            return {"loss": (self.dummy - 1).pow(2).sum()}
        h = self.backbone(v1)
        q = F.normalize(self.head(h), dim=1)
        k = F.normalize(self.head(self.backbone(v2)), dim=1)
        loss = F.cross_entropy(q @ k.t() / 0.2, torch.arange(len(q), device=q.device))
        out = {"loss": loss, "q": q.detach(), "k": k.detach()}
        if self.return_features:
            out["features"] = h.detach()
        self.outputs.append({key: v.detach().clone() for key, v in out.items()})
        return out

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
        self.records.append((step, {k: float(v) for k, v in metrics.items()}))

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(s, m[key]) for s, m in self.records if key in m]


def trainer(**kwargs: Any) -> Trainer:
    """conftest's CPU trainer, logging every step."""
    from conftest import cpu_trainer

    return cpu_trainer(**{"log_every_n_steps": 1, **kwargs})

"""Tiny models: exact, fast tests on a CPU."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from moco_lightning.training.compat import constructor_arguments


def tiny_backbone(in_channels: int = 1, stride: int = 2) -> nn.Module:
    """A 2-layer conv net returning 16-d features (the first convolution's ``stride``)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 8, 3, stride, 1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, 2, 1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def no_bn_backbone() -> nn.Module:
    """Batch-size independent (GroupNorm), so 2 ranks x B and 1 process x 2B compute the same thing."""
    return nn.Sequential(nn.Conv2d(1, 8, 3, 2, 1), nn.GroupNorm(2, 8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _build(cls: type, defaults: dict, kwargs: dict) -> Any:
    """``cls`` with the ``defaults`` it takes (another method's are dropped) and every one of ``kwargs``."""
    accepted = constructor_arguments(cls)
    return cls(**{**{k: v for k, v in defaults.items() if k in accepted}, **kwargs})


def tiny_moco(cls: Any = None, **kwargs: Any) -> Any:
    """A contrastive method (default MoCo) on the tiny backbone: 8-d embeddings, a 32-key queue, constant lr."""
    from moco_lightning import MoCo

    defaults = dict(
        backbone=tiny_backbone(), in_channels=1, image_size=28, head="mlp", hidden_dim=32, dim=8, queue_size=32,
        momentum=0.9, temperature=0.2, lr=0.06, lr_schedule="constant", shuffle_bn="off",
    )  # fmt: skip
    return _build(cls or MoCo, defaults, kwargs)


def tiny(cls: Any, **kwargs: Any) -> Any:
    """SimCLR / BYOL / SwAV on the tiny backbone, with plain SGD at a constant lr (the classes' own defaults are the
    papers' LARS recipes with warm-up: test_matrix checks those); SwAV with 10 prototypes, never frozen."""
    defaults = dict(
        backbone=tiny_backbone(), in_channels=1, image_size=28, hidden_dim=32, dim=8, lr=0.06,
        lr_schedule="constant", optimizer="sgd", warmup_epochs=0.0, weight_decay=1e-4,
        n_prototypes=10, freeze_prototypes_epochs=0.0,
    )  # fmt: skip
    return _build(cls, defaults, kwargs)


class TinyNet(LightningModule):
    """Not a method of the library: a conv net (with BatchNorm) whose ``forward(x)`` returns 16-d features, trained
    with an in-batch InfoNCE on two views. ``training_step`` returns ``{"loss", "q", "k"}`` (+ ``"features"``)."""

    def __init__(self, return_features: bool = False, train_backbone: bool = True) -> None:
        super().__init__()
        self.backbone = tiny_backbone(stride=1)
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


def cosine(step: float, total: float, start: float, end: float) -> float:
    """Half a cosine from ``start`` (step 0) to ``end`` (step ``total``): the schedules' formula, written here to check
    the library's."""
    import math

    return end - (end - start) * (1 + math.cos(math.pi * min(step, total) / max(total, 1))) / 2

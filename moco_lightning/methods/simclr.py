"""SimCLR (Chen, Kornblith, Norouzi, Hinton, ICML 2020, https://arxiv.org/abs/2002.05709): the negatives are the
rest of the batch.

Both views of N images go through one encoder (concatenated: BatchNorm sees all 2N images, as the official code);
NT-Xent (:func:`moco_lightning.modules.loss.nt_xent`) contrasts each of the 2N embeddings with its other view
(positive) and the other 2N − 2 embeddings (negatives), gathered across ranks with gradients, so the dictionary is
the global batch.
It is MoCo's end-to-end mechanism (:class:`moco_lightning.EndToEnd`, Fig. 2a of the MoCo paper) with both views as
queries *and* as negatives: 2N − 2 negatives instead of N − 1. Every negative costs the activations of an image
in memory, which is why SimCLR needs large batches (4096 in the paper) and MoCo's queue does not.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import torch
from lightly.models.modules.heads import SimCLRProjectionHead
from torch import Tensor, nn

from moco_lightning.errors import check_arguments
from moco_lightning.methods.base import Pretraining
from moco_lightning.modules.batches import two_views
from moco_lightning.modules.loss import nt_xent


class SimCLR(Pretraining):
    """SimCLR. ``forward(x)`` returns backbone features.

    Args:
        hidden_dim, dim: the 2-layer projection head (lightly's ``SimCLRProjectionHead``: fc-BN-ReLU-fc).
        temperature: τ of NT-Xent (the paper: 0.1 to 0.5, tuned per batch size; 0.5 for CIFAR-10).
        optimizer, lr, weight_decay, warmup_epochs: the paper's (§B.1): LARS, lr 0.3 per 256 images (4.8 at batch
            4096), weight decay 1e-6, 10 warm-up epochs, then cosine.
        **kwargs: the backbone, optimizer and schedule of :class:`~moco_lightning.methods.base.Pretraining`.
    """

    STRUCTURAL = Pretraining.STRUCTURAL + ("hidden_dim", "dim")

    def __init__(
        self,
        hidden_dim: int = 2048,
        dim: int = 128,
        temperature: float = 0.5,
        optimizer: Literal["sgd", "lars", "adamw"] = "lars",
        lr: float = 0.3,
        weight_decay: float = 1e-6,
        warmup_epochs: float = 10.0,
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, SimCLR.__init__, locals())
        super().__init__(optimizer=optimizer, lr=lr, weight_decay=weight_decay, warmup_epochs=warmup_epochs, **kwargs)
        self.projection_head = SimCLRProjectionHead(self.feature_dim, hidden_dim, dim)
        self.temperature = temperature

    def criterion(self, z0: Tensor, z1: Tensor) -> Tensor:
        """NT-Xent of the two views' projections over the global batch (fp32, no host sync)."""
        return nt_xent(z0, z1, self.temperature, self._equal_sizes)

    def trained_modules(self) -> list[nn.Module]:
        return [self.backbone, self.projection_head]

    def views_loss(self, views: Sequence[Tensor], index: Optional[Tensor] = None) -> dict[str, Any]:
        """NT-Xent over both views (fp32 logits); the features of the first view for the callbacks."""
        x0, x1 = two_views(views, type(self).__name__)
        h = self.backbone(self.in_layout(torch.cat([x0, x1])))
        z0, z1 = self.projection_head(h).float().chunk(2)
        with torch.autocast(h.device.type, enabled=False):  # the similarities in fp32 under autocast
            loss = self.criterion(z0, z1)
        return dict(loss=loss, features=h[: len(x0)].detach())

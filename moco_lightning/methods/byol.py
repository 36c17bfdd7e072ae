"""BYOL (Grill et al., NeurIPS 2020, https://arxiv.org/abs/2006.07733): no negatives at all.

An online network (backbone, projector, predictor; trained) predicts the target network's projection of the other
view; the target (backbone, projector) is an exponential moving average of the online one, as MoCo's key encoder,
with the momentum on a cosine from ``momentum`` (0.996) to 1. Loss: the normalised MSE ``2 − 2·cos(p, z')``,
symmetrised over the two views. Heads: lightly's ``BYOLProjectionHead`` / ``BYOLPredictionHead`` (fc-BN-ReLU-fc,
hidden 4096, output 256). The momentum update follows the optimizer step in ``on_train_batch_end``, as MoCo's.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import torch
from lightly.models.modules.heads import BYOLPredictionHead, BYOLProjectionHead
from torch import Tensor, nn

from moco_lightning.errors import check_arguments
from moco_lightning.methods.base import Pretraining
from moco_lightning.modules.batches import two_views
from moco_lightning.modules.loss import normalized_mse
from moco_lightning.modules.momentum import MomentumCopy


class BYOL(Pretraining):
    """BYOL. ``forward(x)`` returns the online backbone's features.

    Args:
        hidden_dim, dim: projector and predictor sizes (4096, 256).
        momentum: τ_base of the target's θ_t ← τ·θ_t + (1 − τ)·θ_online.
        momentum_schedule: ``"cosine"`` (the paper: τ from τ_base to 1 over training) or ``"constant"``.
        optimizer, lr, weight_decay, warmup_epochs: the paper's (§3.2): LARS, lr 0.2 per 256 images (3.2 at batch
            4096), weight decay 1.5e-6, 10 warm-up epochs, then cosine.
        **kwargs: the backbone, optimizer and schedule of :class:`~moco_lightning.methods.base.Pretraining`.
    """

    STRUCTURAL = Pretraining.STRUCTURAL + ("hidden_dim", "dim")

    def __init__(
        self,
        hidden_dim: int = 4096,
        dim: int = 256,
        momentum: float = 0.996,
        momentum_schedule: Literal["constant", "cosine"] = "cosine",
        optimizer: Literal["sgd", "lars", "adamw"] = "lars",
        lr: float = 0.2,
        weight_decay: float = 1.5e-6,
        warmup_epochs: float = 10.0,
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, BYOL.__init__, locals())
        super().__init__(optimizer=optimizer, lr=lr, weight_decay=weight_decay, warmup_epochs=warmup_epochs, **kwargs)
        self.projection_head = BYOLProjectionHead(self.feature_dim, hidden_dim, dim)
        self.prediction_head = BYOLPredictionHead(dim, hidden_dim, dim)
        # the target: a copy of the online backbone and projector, moved only by the momentum update
        self.momentum_copy = MomentumCopy(
            self, "target_", ("backbone", "projection_head"), momentum, momentum_schedule, "the target network"
        )

    def trained_modules(self) -> list[nn.Module]:
        return [self.backbone, self.projection_head, self.prediction_head]

    def views_loss(self, views: Sequence[Tensor], index: Optional[Tensor] = None) -> dict[str, Any]:
        """The symmetrised loss L(p₀, z₁') + L(p₁, z₀'); both views in one batch through each network. ``q``, ``k``:
        the first view's normalised prediction and the second view's target projection (for the diagnostics)."""
        x0, x1 = two_views(views, type(self).__name__)
        x = self.in_layout(torch.cat([x0, x1]))
        h = self.backbone(x)
        p0, p1 = self.prediction_head(self.projection_head(h)).float().chunk(2)
        with torch.no_grad():
            z0, z1 = self.target_projection_head(self.target_backbone(x)).float().chunk(2)
        with torch.autocast(h.device.type, enabled=False):  # the cosines and the loss in fp32 under autocast
            loss = normalized_mse(p0, z1) + normalized_mse(p1, z0)
        q, k = (nn.functional.normalize(z.detach(), dim=1) for z in (p0, z1))
        return dict(loss=loss, features=h[: len(x0)].detach(), q=q, k=k)

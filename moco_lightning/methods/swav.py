"""SwAV (Caron, Misra, Mairal, Goyal, Bojanowski, Joulin, NeurIPS 2020, https://arxiv.org/abs/2006.09882): no
pairwise negatives; the embeddings are compared with K learned prototypes.

Each view's embedding z (L2-normalised) is scored against the prototypes; the scores of each global view give soft
codes Q by Sinkhorn–Knopp (3 iterations, ε 0.05, equal partition of the batch over the prototypes, computed over
the global batch under DDP), and every other view — the other global view and every local view of multi-crop
(§3.2) — predicts those codes (swapped prediction: cross-entropy against softmax(z·C / T), T 0.1). lightly's
``SwaVProjectionHead`` and ``SwaVLoss`` (with its ``sinkhorn``); the prototypes are bias-free unit vectors
(:class:`moco_lightning.modules.heads.Prototypes`), renormalised before each step and frozen for the first epoch (their
gradient is dropped, as the official code: it stabilises the start). Not here: SwAV's queue of earlier batches'
embeddings (the paper adds it from epoch ~15 for batches below 256).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import torch
from lightly.loss import SwaVLoss
from lightly.models.modules.heads import SwaVProjectionHead
from torch import Tensor, nn

from moco_lightning.errors import ConfigError, check_arguments
from moco_lightning.methods.base import Pretraining
from moco_lightning.modules.heads import Prototypes
from moco_lightning.training.plan import steps_per_epoch


class SwAV(Pretraining):
    """SwAV. ``forward(x)`` returns backbone features. Batches ``([global_1, global_2, *local_views], ...)``: the
    datamodules' ``local_views`` give multi-crop.

    Args:
        hidden_dim, dim: the projection head (fc-BN-ReLU-fc, lightly's ``SwaVProjectionHead``).
        n_prototypes: K (ImageNet: 3000; keep it well below the global batch times a few hundred steps' worth).
        temperature: T of the swapped prediction's softmax.
        sinkhorn_iterations, sinkhorn_epsilon: of the Sinkhorn–Knopp codes.
        freeze_prototypes_epochs: the prototypes get no update for this many epochs (the paper: 1).
        optimizer, lr, weight_decay, warmup_epochs: the official code's recipe for batch 256: LARS, lr 0.6, weight
            decay 1e-6, no warm-up, then cosine (its batch-4096 recipe: lr 4.8 with 10 warm-up epochs).
        **kwargs: the backbone, optimizer and schedule of :class:`~moco_lightning.methods.base.Pretraining`.
    """

    STRUCTURAL = Pretraining.STRUCTURAL + ("hidden_dim", "dim", "n_prototypes")

    def __init__(
        self,
        hidden_dim: int = 2048,
        dim: int = 128,
        n_prototypes: int = 3000,
        temperature: float = 0.1,
        sinkhorn_iterations: int = 3,
        sinkhorn_epsilon: float = 0.05,
        freeze_prototypes_epochs: float = 1.0,
        optimizer: Literal["sgd", "lars", "adamw"] = "lars",
        lr: float = 0.6,
        weight_decay: float = 1e-6,
        warmup_epochs: float = 0.0,
        **kwargs: Any,
    ) -> None:
        check_arguments(type(self).__name__, SwAV.__init__, locals())
        super().__init__(optimizer=optimizer, lr=lr, weight_decay=weight_decay, warmup_epochs=warmup_epochs, **kwargs)
        self.projection_head = SwaVProjectionHead(self.feature_dim, hidden_dim, dim)
        self.prototypes = Prototypes(dim, n_prototypes)
        self.criterion = SwaVLoss(
            temperature=temperature,
            sinkhorn_iterations=sinkhorn_iterations,
            sinkhorn_epsilon=sinkhorn_epsilon,
            sinkhorn_gather_distributed=True,
        )
        self._frozen_steps = 0  # optimizer steps without prototype updates, from freeze_prototypes_epochs
        self._drop_due = False  # a training step's prototype gradient awaits on_after_backward's drop

    def trained_modules(self) -> list[nn.Module]:
        return [self.backbone, self.projection_head, self.prototypes]

    def scores(self, views: list[Tensor]) -> tuple[list[Tensor], Tensor]:
        """Prototype scores (fp32) of each view (one forward pass for views of one size); the first view's features."""
        h = self.backbone(self.in_layout(torch.cat(views)))
        z = nn.functional.normalize(self.projection_head(h).float(), dim=1)
        with torch.autocast(h.device.type, enabled=False):  # scores in fp32: Sinkhorn takes exp(score / 0.05)
            scores = self.prototypes(z)
        return list(scores.chunk(len(views))), h[: len(views[0])].detach()

    def views_loss(self, views: Sequence[Tensor], index: Optional[Tensor] = None) -> dict[str, Any]:
        """Swapped prediction: the codes of each global view predicted by every other view (global and local)."""
        self.prototypes.normalize()
        high, features = self.scores(list(views[:2]))
        low = self.scores(list(views[2:]))[0] if len(views) > 2 else []
        with torch.autocast(high[0].device.type, enabled=False):  # exp(score / ε) in fp32
            loss = self.criterion(high, low)
        self._drop_due = self.training and torch.is_grad_enabled() and self.global_step < self._frozen_steps
        return dict(loss=loss.squeeze(), features=features)

    def loss_is_usable(self, loss: Tensor, batch_idx: int, views: Sequence[Tensor] = ()) -> bool:
        usable = super().loss_is_usable(loss, batch_idx, views)
        self._drop_due = self._drop_due and usable  # a skipped batch has no backward
        return usable

    def check_step_finished(self) -> None:
        """Also: the prototypes' gradient of the last step was dropped (frozen epochs), else one line naming
        ``on_after_backward``."""
        super().check_step_finished()
        if self._drop_due:
            raise ConfigError(
                f"{type(self).__name__}.on_after_backward overrides SwAV.on_after_backward without calling "
                "super().on_after_backward(): the prototypes were not kept frozen in the first "
                f"freeze_prototypes_epochs={self.hparams.freeze_prototypes_epochs}; call super() in it"
            )

    def begin_training(self) -> None:
        super().begin_training()
        self._frozen_steps = round(self.hparams.freeze_prototypes_epochs * steps_per_epoch(self.trainer))

    def on_after_backward(self) -> None:
        if self.global_step < self._frozen_steps:  # after DDP's all-reduce: every rank drops the same gradient
            self.prototypes.layer.weight.grad = None
        self._drop_due = False

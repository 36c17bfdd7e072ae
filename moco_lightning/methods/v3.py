"""MoCo v3 (Chen, Xie, He, ICCV 2021, https://arxiv.org/abs/2104.02057) as the official code has it.

What changes from v1/v2 (``facebookresearch/moco-v3``, ``moco/builder.py``): no queue (the keys of the global
batch, gathered across ranks; the positive of rank r's i-th query is column r·N + i); the loss is symmetric and
multiplied by 2T; the query side has a projector *and* a predictor, the key side the projector only (heads of
:func:`moco_lightning.modules.heads.v3_heads`, ResNet or ViT layout chosen from the backbone); the momentum follows a
cosine from ``momentum`` to 1; LARS (ResNets) or AdamW (ViTs); for ViTs the patch projection can stay random
(§5, "random patch projection": it stabilises training).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from torch import Tensor, nn

from moco_lightning.errors import ConfigError
from moco_lightning.methods.contrastive import MomentumContrast, Terms
from moco_lightning.modules.backbones import zero_init_residuals
from moco_lightning.modules.dictionary import InBatch
from moco_lightning.modules.heads import is_vit, v3_heads


class MoCoV3(MomentumContrast):
    """MoCo v3. Defaults: the paper's ResNet-50 recipe (LARS lr 0.6 per 256, wd 1e-6, 10 warm-up epochs, T 1.0,
    momentum 0.99 → 1 on a cosine, heads 4096-256).

    Args:
        vit: the official ViT heads (3-layer projector, predictor with the last BN) or the ResNet ones (2-layer
            projector, predictor without it); None: chosen from the backbone.
        freeze_patch_embed: keep a ViT's patch embedding fixed (``conv_proj``, torchvision's and ours).
        zero_init_residual: the last BatchNorm of every residual block starts at 0 (each block starts as the
            identity), as the official code builds its ResNets (``zero_init_residual=True``); torchvision ResNet
            backbones given by name only.
        **kwargs: the key encoder's and :class:`~moco_lightning.methods.contrastive.Contrastive`'s arguments and the
            backbone/optimizer ones (v3 has no queue and no head choice: the loss is always symmetric, the heads
            v3's); the defaults below are v3's.
    """

    STRUCTURAL = MomentumContrast.STRUCTURAL + ("vit",)

    def __init__(
        self,
        vit: Optional[bool] = None,
        freeze_patch_embed: bool = False,
        zero_init_residual: bool = True,
        hidden_dim: int = 4096,
        dim: int = 256,
        temperature: float = 1.0,
        momentum: float = 0.99,
        momentum_schedule: Literal["constant", "cosine"] = "cosine",
        shuffle_bn: Literal["auto", "ddp", "split", "off"] = "off",
        optimizer: Literal["sgd", "lars", "adamw"] = "lars",
        lr: float = 0.6,
        weight_decay: float = 1e-6,
        warmup_epochs: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            hidden_dim=hidden_dim,
            dim=dim,
            temperature=temperature,
            momentum=momentum,
            momentum_schedule=momentum_schedule,
            shuffle_bn=shuffle_bn,
            optimizer=optimizer,
            lr=lr,
            weight_decay=weight_decay,
            warmup_epochs=warmup_epochs,
            **kwargs,
        )
        self.dictionary = InBatch()
        if freeze_patch_embed:
            proj = getattr(self.backbone, "conv_proj", None)
            if not isinstance(proj, nn.Conv2d):
                raise ConfigError(
                    "MoCoV3: freeze_patch_embed=True needs a ViT backbone with a patch embedding "
                    "'conv_proj' (torchvision's vit_* or moco_lightning.modules.backbones.ViT)"
                )
            proj.requires_grad_(False)
        if zero_init_residual and isinstance(self.hparams.get("backbone"), str) and zero_init_residuals(self.backbone):
            self.momentum_copy.reset(self)  # f_k starts as a copy of f_q

    def frozen_modules(self) -> list[nn.Module]:
        frozen = super().frozen_modules()
        return frozen + [self.backbone.conv_proj] if self.hparams.freeze_patch_embed else frozen

    def build_heads(self) -> tuple[nn.Module, Optional[nn.Module]]:
        vit: Optional[bool] = self.hparams.vit
        return v3_heads(
            self.feature_dim, self.hparams.hidden_dim, self.hparams.dim, is_vit(self.backbone) if vit is None else vit
        )

    def loss_terms(self, x_q: Tensor, x_k: Tensor, index: Optional[Tensor]) -> Terms:
        """The official builder's order: q₁, q₂, then k₁, k₂ (the key encoder's BatchNorm sees x₁ first);
        loss terms L(q₁, k₂) + L(q₂, k₁), the other keys of the global batch as negatives, times 2T (the
        gradient's size then does not depend on T)."""
        h, q1 = self.query(x_q)
        q2 = self.query(x_k)[1]
        k1, k2 = self.key(x_q), self.key(x_k)
        return Terms(h, [(q1, k2, None), (q2, k1, None)], [q1, q2], [k1, k2], 2 * self.hparams.temperature)

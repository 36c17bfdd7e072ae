"""The projection heads of MoCo v1, v2 and v3 (and v3's predictor).

- v1 (He et al. 2020): a linear layer to ``dim`` (lightly's ``ProjectionHead``).
- v2 (Chen et al. 2020): fc-ReLU-fc, hidden ``hidden_dim`` (lightly's ``MoCoProjectionHead``).
- v3 (Chen, Xie, He 2021), exactly the official ``moco/builder.py``: every Linear without bias, hidden layers
  Linear-BN-ReLU, the last Linear followed by a BatchNorm1d without affine parameters unless ``last_bn=False``.
  ResNets: a **2-layer** projector and a 2-layer predictor **without** the last BN; ViTs: a **3-layer** projector
  and a 2-layer predictor **with** the last BN. Hidden 4096, output 256.

SimCLR's, BYOL's and SwAV's heads are lightly's, except SwAV's prototypes (:class:`Prototypes`).
"""

from __future__ import annotations

import torch
from lightly.models.modules.heads import MoCoProjectionHead, ProjectionHead
from torch import Tensor, nn


class MLP(nn.Module):
    """The official MoCo v3 ``_build_mlp``: ``num_layers`` bias-free Linear layers, BN-ReLU between them, and a
    BatchNorm1d without affine parameters after the last one when ``last_bn``. The layers are ``.layers``."""

    def __init__(self, num_layers: int, input_dim: int, hidden_dim: int, output_dim: int, last_bn: bool = True) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(num_layers):
            d_in = input_dim if i == 0 else hidden_dim
            d_out = output_dim if i == num_layers - 1 else hidden_dim
            layers.append(nn.Linear(d_in, d_out, bias=False))
            if i < num_layers - 1:
                layers += [nn.BatchNorm1d(d_out), nn.ReLU(inplace=True)]
            elif last_bn:
                layers.append(nn.BatchNorm1d(d_out, affine=False))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def projection_head(kind: str, feature_dim: int, hidden_dim: int, dim: int) -> nn.Module:
    """``"linear"`` (v1) or ``"mlp"`` (v2)."""
    if kind == "linear":
        return ProjectionHead([(feature_dim, dim, None, None)])
    return MoCoProjectionHead(feature_dim, hidden_dim, dim)


def v3_heads(feature_dim: int, hidden_dim: int, dim: int, vit: bool) -> tuple[MLP, MLP]:
    """(projector, predictor) of the official MoCo v3: ``MoCo_ViT`` when ``vit``, else ``MoCo_ResNet``."""
    if vit:
        return MLP(3, feature_dim, hidden_dim, dim), MLP(2, dim, hidden_dim, dim)
    return MLP(2, feature_dim, hidden_dim, dim), MLP(2, dim, hidden_dim, dim, last_bn=False)


def is_vit(backbone: nn.Module) -> bool:
    """A vision transformer (torchvision's, this library's ``ViT`` or timm's): decides v3's head layout."""
    return any("VisionTransformer" in c.__name__ for m in backbone.modules() for c in type(m).__mro__)


class Prototypes(nn.Module):
    """SwAV's prototypes (Caron et al. 2020): a bias-free linear layer whose rows are unit vectors, renormalised by
    :meth:`normalize` before each step, as the official code (``prototypes``, ``bias=False``).

    Not lightly's ``SwaVPrototypes``: its ``nn.Linear`` has a bias (a per-prototype offset the paper does not have)
    and it freezes the prototypes by toggling ``requires_grad``, which DistributedDataParallel does not follow after
    it was built (parameters that require no gradient at DDP's construction are never all-reduced afterwards).
    :class:`moco_lightning.SwAV` freezes them by dropping their gradient instead, as the official code."""

    def __init__(self, dim: int, n_prototypes: int) -> None:
        super().__init__()
        self.layer = nn.Linear(dim, n_prototypes, bias=False)

    @torch.no_grad()
    def normalize(self) -> None:
        self.layer.weight.copy_(nn.functional.normalize(self.layer.weight, dim=1))

    def forward(self, z: Tensor) -> Tensor:
        """Scores z·c_k of L2-normalised embeddings ``z`` against every prototype c_k."""
        return self.layer(z)

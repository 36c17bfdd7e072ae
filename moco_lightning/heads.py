"""The projection heads of MoCo v1, v2 and v3 (and v3's predictor).

- v1 (He et al. 2020): a linear layer to ``dim`` (lightly's ``ProjectionHead``).
- v2 (Chen et al. 2020): fc-ReLU-fc, hidden ``hidden_dim`` (lightly's ``MoCoProjectionHead``).
- v3 (Chen, Xie, He 2021), exactly the official ``moco/builder.py``: every Linear without bias, hidden layers
  Linear-BN-ReLU, the last Linear followed by a BatchNorm1d without affine parameters unless ``last_bn=False``.
  ResNets: a **2-layer** projector and a 2-layer predictor **without** the last BN; ViTs: a **3-layer** projector
  and a 2-layer predictor **with** the last BN. Hidden 4096, output 256.
"""

from __future__ import annotations

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

"""The heads: v1 linear, v2 MLP, and MoCo v3's projector and predictor exactly as the official code builds them."""

import pytest
import torch
from helpers.models import tiny_moco
from torch import nn

from moco_lightning import MoCoV3
from moco_lightning.modules.backbones import ViT
from moco_lightning.modules.heads import MLP, is_vit, v3_heads


def layout(module: nn.Module) -> list:
    """(type, in, out, bias / affine) of every layer, in order."""
    out = []
    for m in module.layers:
        if isinstance(m, nn.Linear):
            out.append(("Linear", m.in_features, m.out_features, m.bias is not None))
        elif isinstance(m, nn.BatchNorm1d):
            out.append(("BN", m.num_features, m.affine))
        else:
            out.append((type(m).__name__,))
    return out


#: the official 2-layer predictor of MoCo v3 (256 -> 4096 -> 256), ResNet layout: no BN after the last Linear
PREDICTOR = [("Linear", 256, 4096, False), ("BN", 4096, True), ("ReLU",), ("Linear", 4096, 256, False)]


def test_resnet_heads_are_the_official_two_layer_projector_and_predictor_without_last_bn():
    projector, predictor = v3_heads(2048, 4096, 256, vit=False)
    assert layout(projector) == [
        ("Linear", 2048, 4096, False),
        ("BN", 4096, True),
        ("ReLU",),
        ("Linear", 4096, 256, False),
        ("BN", 256, False),
    ]
    assert layout(predictor) == PREDICTOR


def test_vit_heads_are_the_official_three_layer_projector_and_predictor_with_last_bn():
    projector, predictor = v3_heads(384, 4096, 256, vit=True)
    assert layout(projector) == [
        ("Linear", 384, 4096, False),
        ("BN", 4096, True),
        ("ReLU",),
        ("Linear", 4096, 4096, False),
        ("BN", 4096, True),
        ("ReLU",),
        ("Linear", 4096, 256, False),
        ("BN", 256, False),
    ]
    assert layout(predictor) == PREDICTOR + [("BN", 256, False)]  # ViT: the last BN too


@pytest.mark.parametrize("backbone,vit", [("resnet18", False), ("vit", True)])
def test_moco_v3_chooses_the_layout_from_the_backbone_and_copies_only_the_projector(backbone, vit):
    bb = (
        ViT(image_size=28, patch_size=7, in_channels=1, num_layers=1, num_heads=2, hidden_dim=32, mlp_dim=64)
        if backbone == "vit"
        else "resnet18"
    )
    model = tiny_moco(MoCoV3, backbone=bb, hidden_dim=64, dim=16)
    assert is_vit(model.backbone) == vit
    n_linear = sum(isinstance(m, nn.Linear) for m in model.projection_head.layers)
    assert n_linear == (3 if vit else 2)
    assert isinstance(model.prediction_head.layers[-1], nn.BatchNorm1d) == vit
    assert layout(model.key_projection_head) == layout(model.projection_head)
    assert not hasattr(model, "key_prediction_head")
    forced = tiny_moco(MoCoV3, backbone="resnet18", hidden_dim=64, dim=16, vit=True)  # the explicit argument wins
    assert sum(isinstance(m, nn.Linear) for m in forced.projection_head.layers) == 3


def test_mlp_forward_shapes():
    assert MLP(2, 10, 20, 5)(torch.randn(4, 10)).shape == (4, 5)

import pytest
import torch
import torchvision
from torch import nn

from moco_lightning.backbones import build_backbone


@pytest.mark.parametrize("name,dim", [("resnet18", 512), ("resnet50", 2048), ("mobilenet_v3_small", 576)])
def test_torchvision_names_lose_their_classifier_and_report_the_feature_size(name, dim):
    model, d = build_backbone(name)
    assert d == dim
    model.eval()
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, dim)


def test_cifar_stem_and_grayscale():
    model, d = build_backbone("resnet18", cifar_stem=True, in_channels=1)
    assert (model.conv1.in_channels, model.conv1.kernel_size, model.conv1.stride) == (1, (3, 3), (1, 1))
    assert isinstance(model.maxpool, nn.Identity)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 512)
    gray, _ = build_backbone("mobilenet_v3_small", in_channels=1)  # first conv rebuilt, wherever it is
    gray.eval()
    assert gray(torch.randn(2, 1, 64, 64)).shape == (2, 576)


def test_width_multiplier_keeps_torchvision_structure():
    narrow, d = build_backbone("resnet18", width=0.5)
    assert d == 256 and narrow.conv1.out_channels == 32 and narrow.layer4[1].conv2.out_channels == 256
    full = torchvision.models.resnet18()
    full.fc = nn.Identity()
    assert set(narrow.state_dict()) == set(full.state_dict())  # same keys: export works alike
    params = sum(p.numel() for p in narrow.parameters())
    assert abs(params / sum(p.numel() for p in full.parameters()) - 0.25) < 0.01  # channels/2 -> weights/4
    bottleneck, d50 = build_backbone("resnet50", width=0.25)
    assert d50 == 512 and bottleneck(torch.randn(2, 3, 64, 64)).shape == (2, 512)
    with pytest.raises(ValueError, match="width=0.5 applies to torchvision's resnetNN backbones"):
        build_backbone("mobilenet_v3_small", width=0.5)


def test_any_module_feature_size_is_probed_and_bad_modules_are_explained():
    module = nn.Sequential(nn.Conv2d(1, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 7))
    assert build_backbone(module, in_channels=1, image_size=16)[1] == 7
    with pytest.raises(ValueError, match=r"could not run the backbone on a \(2, 3, 224, 224\) input"):
        build_backbone(module)
    with pytest.raises(ValueError, match=r"must return features of shape \(N, D\)"):
        build_backbone(nn.Conv2d(3, 4, 3), image_size=8)
    with pytest.raises(ValueError, match="cifar_stem=True applies to ResNet-style backbones"):
        build_backbone("mobilenet_v3_small", cifar_stem=True)


@pytest.mark.parametrize(
    "name,kwargs,dim",
    [
        ("timm:resnet10t", dict(in_channels=1, image_size=28, cifar_stem=True), 512),
        ("timm:vit_tiny_patch16_224", dict(in_channels=1, image_size=32), 192),
    ],
)
def test_timm_backbones_build_with_random_weights_and_no_classifier(name, kwargs, dim):
    model, feature_dim = build_backbone(name, **kwargs)
    assert feature_dim == dim
    x = torch.randn(2, kwargs["in_channels"], kwargs["image_size"], kwargs["image_size"])
    assert model.eval()(x).shape == (2, dim)


def test_timm_errors_name_the_model_and_the_fix():
    with pytest.raises(ValueError, match="timm .* has no model 'resnet_does_not_exist'"):
        build_backbone("timm:resnet_does_not_exist")
    with pytest.raises(ValueError, match="width=0.5 applies to torchvision's resnetNN"):
        build_backbone("timm:resnet10t", width=0.5)


def test_a_narrow_resnet_pickles_for_spawned_ddp_processes():
    """DDPStrategy(start_method="spawn") pickles the model: the narrow ResNet's class was local to a function
    ("Can't pickle local object '_narrow_resnet.<locals>.NarrowResNet'"; found by gpu_check's spawn run)."""
    import pickle

    model = build_backbone("resnet18", width=0.5, in_channels=1)[0].eval()
    again = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, 1, 32, 32)
    assert torch.equal(again(x), model(x)) and again.layer4[0].conv1.out_channels == 256

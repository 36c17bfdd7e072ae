import pytest
import torch
import torchvision
from torch import nn

from moco_lightning.modules.backbones import build_backbone


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
    with pytest.raises(ValueError, match=r"a small-image stem \(stem / cifar_stem\) applies to ResNet-style backbones"):
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


@pytest.mark.parametrize("stem, side", [("imagenet", 1), ("cifar", 4), ("cifar_stride2", 2)])
def test_each_stem_gives_its_map_size_on_28_px_images(stem, side):
    """28-px images reach the last stage at 1x1 (imagenet: 7x7 conv stride 2 + max-pool), 4x4 (cifar: 3x3 stride 1)
    or 2x2 (cifar_stride2: 3x3 stride 2, no max-pool; 14x14 maps in the first stage)."""
    model, dim = build_backbone("resnet18", in_channels=1, image_size=28, width=0.125, stem=stem)
    model.avgpool = nn.Identity()
    maps = model.eval()(torch.zeros(2, 1, 28, 28)).reshape(2, dim, -1)
    assert maps.shape[-1] == side * side
    first = model.conv1
    assert first.kernel_size == ((7, 7) if stem == "imagenet" else (3, 3)) and first.in_channels == 1
    assert isinstance(model.maxpool, nn.Identity) == (stem != "imagenet")


def test_cifar_stem_is_the_old_spelling_of_stem_cifar_and_a_contradiction_is_refused():
    from moco_lightning.errors import ConfigError

    a, _ = build_backbone("resnet18", cifar_stem=True, in_channels=1, image_size=28, width=0.125)
    b, _ = build_backbone("resnet18", stem="cifar", in_channels=1, image_size=28, width=0.125)
    assert a.conv1.stride == b.conv1.stride == (1, 1) and str(a) == str(b)
    with pytest.raises(ConfigError, match="cifar_stem=True and stem='cifar_stride2' disagree"):
        build_backbone("resnet18", cifar_stem=True, stem="cifar_stride2")
    with pytest.raises(ConfigError, match="stem='small' is not allowed"):
        build_backbone("resnet18", stem="small")
    timm_model, _ = build_backbone("timm:resnet10t", stem="cifar_stride2", in_channels=1, image_size=28)
    assert next(m for m in timm_model.conv1.modules() if isinstance(m, nn.Conv2d)).stride == (2, 2)


def test_the_stem_travels_with_exports_and_from_scratch_baselines(tmp_path):
    """An export records the stem, load_backbone rebuilds it; linear evaluation from scratch rebuilds the same stem."""
    from helpers.data import tiny_data
    from lightning.pytorch import Trainer

    from moco_lightning import MoCo, load_backbone
    from moco_lightning.downstream.export import export_backbone
    from moco_lightning.downstream.linear_eval import LinearClassifier

    model = MoCo(backbone="resnet18", width=0.125, in_channels=1, image_size=28, stem="cifar_stride2",
                 hidden_dim=16, dim=8, queue_size=32, shuffle_bn="off")  # fmt: skip
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(model, tiny_data())
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    export_backbone(tmp_path / "m.ckpt", tmp_path / "b.pt")
    rebuilt = load_backbone(tmp_path / "b.pt")
    assert rebuilt.conv1.stride == (2, 2) and isinstance(rebuilt.maxpool, nn.Identity)
    scratch = LinearClassifier(ckpt_path=str(tmp_path / "m.ckpt"), from_scratch=True, num_classes=10)
    assert scratch.backbone.conv1.stride == (2, 2) and str(scratch.backbone) == str(model.backbone)


def test_cifar_stem_is_the_deprecated_spelling_of_stem_cifar_and_old_checkpoints_read_it_as_stem(tmp_path):
    """``cifar_stem=True`` builds the ``stem="cifar"`` network with a FutureWarning naming its replacement; a
    checkpoint that recorded it (format 2, moco-lightning 0.2) reloads as ``stem="cifar"`` without the warning."""
    import warnings

    from helpers.data import FIXTURE_CKPT

    from moco_lightning import MoCo

    args = dict(backbone="resnet18", width=0.0625, in_channels=1, image_size=28, hidden_dim=16, dim=8, queue_size=32)
    with pytest.warns(FutureWarning, match=r"MoCo: cifar_stem=True is deprecated .* use stem='cifar'"):
        old = MoCo(cifar_stem=True, **args)
    new = MoCo(stem="cifar", **args)
    assert [tuple(p.shape) for p in old.parameters()] == [tuple(p.shape) for p in new.parameters()]
    assert old.backbone.conv1.stride == (1, 1) and isinstance(old.backbone.maxpool, torch.nn.Identity)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        loaded = MoCo.load_from_checkpoint(FIXTURE_CKPT)
    assert loaded.hparams.stem == "cifar" and not loaded.hparams.cifar_stem

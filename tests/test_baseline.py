"""``evaluate --baseline``: weights a user already has (a torchvision / timm state dict, another run's file), read
with their architecture recognised or named, fed the evaluated encoder's images exactly as said, and measured in
the same table by the same protocol."""

import json

import pytest
import torch
import torchvision
from helpers.data import FIXTURE_CKPT
from helpers.files import write_fashion_folder

from moco_lightning.cli import main
from moco_lightning.downstream.baseline import read_baseline
from moco_lightning.errors import ConfigError
from moco_lightning.modules.backbones import build_backbone


@pytest.mark.parametrize("depth", [18, 50])
def test_a_torchvision_resnet_is_recognised_and_fed_gray_images_as_the_rgb_model_sees_them(depth, tmp_path):
    """The architecture from the keys, the classifier dropped, conv1's RGB kernels summed for one channel: the features
    equal the 3-channel model's on the gray image repeated in three channels."""
    torch.manual_seed(0)
    model = getattr(torchvision.models, f"resnet{depth}")(num_classes=7).eval()
    torch.save(model.state_dict(), tmp_path / "imagenet.pt")
    encoder, how = read_baseline(tmp_path / "imagenet.pt", in_channels=1, image_size=28)
    assert encoder.architecture == dict(backbone=f"resnet{depth}", width=1.0, stem="imagenet", in_channels=1,
                                        image_size=28)  # fmt: skip
    assert "recognised from its keys" in how and "conv1.weight's 3 input kernels summed" in how
    backbone = encoder.build()[0].eval()
    gray = torch.randn(4, 1, 28, 28)
    model.fc = torch.nn.Identity()
    with torch.no_grad():
        assert torch.allclose(backbone(gray), model(gray.expand(-1, 3, -1, -1)), rtol=1e-4, atol=1e-5)


def test_a_small_stem_or_unknown_keys_are_named_with_baseline_arch(tmp_path):
    torch.manual_seed(0)
    small, _ = build_backbone("resnet18", in_channels=1, image_size=28, width=0.5, stem="cifar_stride2")
    torch.save(dict(small.state_dict()), tmp_path / "small.pt")  # a plain state dict: no description
    with pytest.raises(ConfigError, match=r"conv1 is 3x3.*--baseline_arch resnet18,stem=cifar "):
        read_baseline(tmp_path / "small.pt", 1, 28)
    encoder, how = read_baseline(tmp_path / "small.pt", 1, 28, arch="resnet18,stem=cifar_stride2")
    assert encoder.architecture["width"] == 0.5 and "--baseline_arch" in how
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(encoder.build()[0].eval()(x), small.eval()(x))
    torch.save({"blocks.0.weight": torch.zeros(4, 1, 3, 3)}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match=r"cannot be told from its keys.*--baseline_arch"):
        read_baseline(tmp_path / "other.pt", 1, 28)
    with pytest.raises(ConfigError, match=r"do not fit resnet50 \(missing .*\): check --baseline_arch"):
        read_baseline(tmp_path / "small.pt", 1, 28, arch="resnet50,stem=cifar")


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_evaluate_measures_a_baseline_beside_the_encoder_by_the_same_protocol(tmp_path, capsys):
    """A torchvision state dict and another run's checkpoint, in the same table: kNN, linear, and at each budget
    linear frozen and fine-tuned; what each baseline is and how it is fed, in the report."""
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), tmp_path / "r18.pt")
    root = write_fashion_folder(tmp_path / "folder", n_train=20, n_val=8, n_unlabelled=0)  # 3 classes: small and fast
    main(["evaluate", "--ckpt", FIXTURE_CKPT, "--data_dir", str(root), "--steps", "2", "--k", "20", "--fractions",
          "0.5", "--out", str(tmp_path / "ev"), "--baseline", str(tmp_path / "r18.pt"), "--baseline",
          FIXTURE_CKPT])  # fmt: skip
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "ev" / "evaluate.json").read_text())
    names = ["baseline r18", "baseline MoCo"]
    assert list(result["baselines"]) == names
    for name in names:
        assert 0 <= result["rows"]["kNN k 20"][name] <= 1 and 0 <= result["fractions"]["0.5"][f"fine_tuned {name}"] <= 1
    same = result["rows"]["kNN k 20"]
    assert same["baseline MoCo"] == same["encoder"]  # the same file as a baseline: the same features, the same kNN
    assert "| | encoder | raw pixels | baseline r18 | baseline MoCo |" in out
    assert "baseline r18: `" in out and "recognised from its keys" in out and "28 px, 1 channel(s)" in out

"""Detection transfer: the detectron2 pickle has the official converter's names, shapes, values and layout (checked
against detectron2's own ResNet naming, written out here), the torchvision-detection file loads strictly into a
ResNet-FPN body with which a Faster R-CNN takes a training step, and a backbone no detection model can hold is
refused in one line."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers.detection import official_converter
from helpers.trainers import cpu_trainer

from moco_lightning import MoCo
from moco_lightning.cli.export import main
from moco_lightning.downstream.detection import detectron2_settings
from moco_lightning.downstream.export import export_backbone
from moco_lightning.errors import ConfigError


def checkpoint(path, **architecture):
    """A MoCo checkpoint of the given architecture (untrained: the tests are about names and weights)."""
    settings = dict(backbone="resnet18", in_channels=3, image_size=32, queue_size=32, dim=8, hidden_dim=16)
    trainer = cpu_trainer()
    trainer.strategy.connect(MoCo(**{**settings, **architecture}))
    trainer.save_checkpoint(path)
    return path


def detectron2_resnet_names(blocks: list[int], convs: int) -> set[str]:
    """The parameter names of detectron2's ResNet (``build_resnet_backbone``; FrozenBN: weight, bias, running mean
    and var) for stages of ``blocks`` blocks of ``convs`` convolutions (2: BasicBlock, 3: BottleneckBlock)."""
    norm = ("weight", "bias", "running_mean", "running_var")
    names = {"stem.conv1.weight"} | {f"stem.conv1.norm.{n}" for n in norm}
    for stage, count in enumerate(blocks, start=2):
        for b in range(count):
            convs_here = [f"conv{c}" for c in range(1, convs + 1)]
            if b == 0 and (stage > 2 or convs == 3):  # a projection shortcut where the shape changes
                convs_here.append("shortcut")
            for conv in convs_here:
                names |= {f"res{stage}.{b}.{conv}.weight"} | {f"res{stage}.{b}.{conv}.norm.{n}" for n in norm}
    return names


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
@pytest.mark.parametrize("backbone, blocks, convs", [("resnet18", [2, 2, 2, 2], 2), ("resnet50", [3, 4, 6, 3], 3)])
def test_the_detectron2_pickle_is_the_official_converters_with_detectron2s_names(tmp_path, backbone, blocks, convs):
    ckpt = checkpoint(tmp_path / "m.ckpt", backbone=backbone)
    export_backbone(ckpt, tmp_path / "d2.pkl", format="detectron2")
    with open(tmp_path / "d2.pkl", "rb") as f:
        written = pickle.load(f)
    assert written["__author__"] == "MOCO" and written["matching_heuristics"] is True
    state = {k[len("backbone.") :]: v for k, v in torch.load(ckpt)["state_dict"].items() if k.startswith("backbone.")}
    official = {k: v for k, v in official_converter(state).items() if not k.endswith("num_batches_tracked")}
    assert set(written["model"]) == set(official) == detectron2_resnet_names(blocks, convs)
    for name, value in official.items():
        assert written["model"][name].shape == value.shape and (written["model"][name] == value).all(), name
    export_backbone(ckpt, tmp_path / "plain.pkl", format="detectron2", matching_heuristics=False)
    with open(tmp_path / "plain.pkl", "rb") as f:
        assert pickle.load(f)["matching_heuristics"] is False


@pytest.mark.slow  # an integration run of seconds: the whole suite, not the fast loop
def test_the_torchvision_detection_file_loads_strictly_into_a_fpn_body_and_faster_rcnn_trains(tmp_path, seeded):
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    ckpt = checkpoint(tmp_path / "m.ckpt")
    export_backbone(ckpt, tmp_path / "body.pt", format="torchvision-detection")
    fpn = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5)
    fpn.body.load_state_dict(torch.load(tmp_path / "body.pt"), strict=True)
    saved = torch.load(ckpt)["state_dict"]
    assert torch.equal(fpn.body.layer4[1].conv2.weight, saved["backbone.layer4.1.conv2.weight"])
    assert torch.equal(fpn.body.bn1.running_var, saved["backbone.bn1.running_var"])
    detector = FasterRCNN(fpn, num_classes=3, min_size=64, max_size=64).train()
    before = fpn.body.layer1[0].conv1.weight.detach().clone()
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    targets = [{"boxes": torch.tensor([[4.0, 6.0, 40.0, 50.0]]), "labels": torch.tensor([1])}] * 2
    losses = detector(images, targets)
    loss = sum(losses.values())
    assert torch.isfinite(loss)
    loss.backward()
    torch.optim.SGD(detector.parameters(), lr=0.01).step()
    assert not torch.equal(before, fpn.body.layer1[0].conv1.weight)


@pytest.mark.parametrize("fmt", ["detectron2", "torchvision-detection"])
@pytest.mark.parametrize(
    "architecture, named",
    [
        ({"stem": "cifar"}, "stem 'cifar'"),
        ({"in_channels": 1}, "in_channels 1"),
        ({"backbone": "mobilenet_v3_small"}, "mobilenet_v3_small"),
    ],
)
def test_a_backbone_detection_cannot_hold_is_refused_in_one_line(tmp_path, fmt, architecture, named):
    ckpt = checkpoint(tmp_path / "m.ckpt", **architecture)
    with pytest.raises(ConfigError, match=rf"--format {fmt}: this encoder cannot be a detection backbone: .*{named}"):
        export_backbone(ckpt, tmp_path / "d.pkl", format=fmt)
    assert not (tmp_path / "d.pkl").exists()


def test_the_export_prints_the_detectron2_settings_of_a_narrow_resnet(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "m.ckpt", width=0.5)
    main(["--ckpt", str(ckpt), "--out", str(tmp_path / "d2.pkl"), "--format", "detectron2"])
    printed = capsys.readouterr().out
    assert "MODEL.RESNETS.DEPTH: 18" in printed and "MODEL.RESNETS.STEM_OUT_CHANNELS: 32" in printed
    assert "MODEL.RESNETS.RES2_OUT_CHANNELS: 32" in printed
    with pytest.raises(ConfigError, match="width 0.5 .*torchvision builds full-width"):
        export_backbone(ckpt, tmp_path / "b.pt", format="torchvision-detection")
    lines = detectron2_settings({"backbone": "resnext50_32x4d"}, {"mean": [0.5] * 3, "std": [0.25] * 3})
    assert "MODEL.RESNETS.NUM_GROUPS: 32" in lines and "MODEL.RESNETS.WIDTH_PER_GROUP: 4" in lines
    assert "MODEL.PIXEL_MEAN: [127.5, 127.5, 127.5]" in lines and "MODEL.PIXEL_STD: [63.75, 63.75, 63.75]" in lines
